"""A tiny --ft training loop that samples the run store's key count around two steps.

Used by tests/test_ft.py: a long run's store must not grow with its steps.
Prints `[keys] {"200": n, "2000": m}` (the fewest keys seen over the 150
steps before each mark: longer than the supervisor's collection period, so
keys of the rounds in flight do not count).
"""

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

import ftrun.ft as ft

marks = [int(x) for x in sys.argv[1].split(",")]
host, _, port = os.environ["FTRUN_STORE"].rpartition(":")
store = dist.TCPStore(host, int(port), None, False, datetime.timedelta(seconds=30))
torch.manual_seed(0)
model = ft.DistributedDataParallel(torch.nn.Linear(8, 1))
opt = ft.Optimizer(torch.optim.SGD(model.parameters(), lr=0.01))
seen = {m: None for m in marks}
for step in ft.steps(max(marks) + 1):
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()
    for m in marks:
        if m - 150 <= step < m and int(os.environ["RANK"]) == 0:
            n = store.num_keys()
            seen[m] = n if seen[m] is None else min(seen[m], n)
if int(os.environ["RANK"]) == 0:
    print("[keys] " + json.dumps(seen), flush=True)
