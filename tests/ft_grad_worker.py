"""A --ft worker that reads its gradients as scripts do: clip_grad_norm_ and GradScaler.

argv: STEPS OUT [HOOK_NOTE]. Each replica writes OUT.rankN.json with, per committed step,
the pre-clip gradient norm it saw after loss.backward(), and the parameters and optimizer
state at the end (OUT.rankN.pt, OUT.rankN.opt.pt). At step 0 (a layout round) and at step
INF_STEP, replica index 0's batch overflows to inf while the scale is still the initial one:
GradScaler skips the step on every replica only if every replica reads averaged gradients.
"""

import json
import os
import sys
import time

import torch
import torch.nn as nn

import ftrun.ft as ft

steps, out = int(sys.argv[1]), sys.argv[2]
INF_STEPS = (0, 25)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))
ddp = ft.DistributedDataParallel(model)
opt = ft.Optimizer(torch.optim.Adam(ddp.parameters(), lr=1e-3))
scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
ft.register_state("scaler", scaler)
norms, skipped, yields = {}, [], []
initial = scaler.get_scale()
for step in ft.steps(steps):
    yields.append((step, ft.redo()))
    i, n = ft.replica_index(), ft.num_replicas()
    g = torch.Generator().manual_seed(step)
    x = torch.randn(48, 64, generator=g)
    y = torch.randn(48, 1, generator=g)
    x, y = x.chunk(n)[i].clone(), y.chunk(n)[i]
    if step in INF_STEPS and i == 0 and scaler.get_scale() == initial / (2 ** INF_STEPS.index(step)):
        x[0, 0] = 3e38  # overflows this replica's loss: its local gradients are inf
    opt.zero_grad(set_to_none=True)
    loss = nn.functional.mse_loss(ddp(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    norm = float(torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0))
    before = scaler.get_scale()
    committed = scaler.step(opt)  # opt.step() (True: committed), unless the gradients hold inf or nan (None)
    scaler.update()
    if scaler.get_scale() < before:
        skipped.append(step)
    elif committed:
        norms[step] = norm
    time.sleep(0.01)
rank = int(os.environ["RANK"])
torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, f"{out}.rank{rank}.pt")
torch.save(opt.optimizer.state_dict(), f"{out}.rank{rank}.opt.pt")
with open(f"{out}.rank{rank}.json", "w") as f:
    json.dump({"step": ft.global_step(), "norms": norms, "skipped": skipped, "scale": scaler.get_scale(),
               "yields": yields}, f)
print(f"done at step {ft.global_step()}", flush=True)
