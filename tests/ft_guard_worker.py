"""A training script for the guard's tests (tests/test_ft_guard.py), as a user ports one to --ft:
a model with a BatchNorm under ft.DistributedDataParallel, AdamW, an LR scheduler it registers,
and state it keeps without registering: an EMA of the model (torch.optim.swa_utils.AveragedModel),
updated after every step taken.

--plant RANK:STEP:WHAT[,...] changes that rank's state outside the optimizer once, after the step that
brings the run to STEP (as a bug, a bit flip or a script's unsynchronised code would): `param`
(a weight), `buffer` (the EMA's count of averaged models), `state` (the registered scheduler's
counter), `adam` (an optimizer moment). --die-at RANK:STEP: that rank's first process SIGKILLs
itself at that step. --out OUT: every rank writes its whole state to OUT.rankN.pt at the end.
"""

import argparse
import os
import signal
import time

import torch
import torch.nn as nn
from torch.optim.swa_utils import AveragedModel

import ftrun.ft as ft

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=60)
p.add_argument("--out", default=None)
p.add_argument("--plant", default="")
p.add_argument("--die-at", default="")
p.add_argument("--hidden", type=int, default=64)
p.add_argument("--step-sleep", type=float, default=0.0, help="pretend each step does more work")
args = p.parse_args()
rank = int(os.environ["RANK"])
plants = [(int(r), int(s), w) for r, s, w in (x.split(":") for x in args.plant.split(",") if x)]
die = {int(r): int(s) for r, s in (x.split(":") for x in args.die_at.split(",") if x)}

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, args.hidden), nn.BatchNorm1d(args.hidden), nn.ReLU(), nn.Linear(args.hidden, 1))
ddp = ft.DistributedDataParallel(model)
opt = ft.Optimizer(torch.optim.AdamW(ddp.parameters(), lr=1e-3))
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.9)
ft.register_state("sched", sched)
ema = AveragedModel(model)  # not registered: ftrun finds it in the script's globals

first_process = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"  # a restart plants nothing
for step in ft.steps(args.steps):
    if first_process and die.get(rank) == step:
        os.kill(os.getpid(), signal.SIGKILL)
    g = torch.Generator().manual_seed(step)
    x = torch.randn(48, 16, generator=g)
    y = x.sum(1, keepdim=True)
    n, i = ft.num_replicas(), ft.replica_index()
    x, y = x.chunk(n)[i], y.chunk(n)[i]
    opt.zero_grad()
    nn.functional.mse_loss(ddp(x), y).backward()
    if args.step_sleep:
        time.sleep(args.step_sleep)
    if opt.step():
        sched.step()
        ema.update_parameters(model)
        for r, at, what in list(plants):
            if r != rank or ft.global_step() != at or not first_process:
                continue
            plants.remove((r, at, what))
            with torch.no_grad():
                if what == "param":
                    model[0].weight[0, 0] += 1e-3
                elif what == "buffer":
                    ema.n_averaged += 1
                elif what == "state":
                    sched.last_epoch += 1
                elif what == "adam":
                    next(iter(opt.state.values()))["exp_avg"].mul_(1.5)

if args.out:
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                "ema": ema.state_dict()}, f"{args.out}.rank{rank}.pt")
print(f"rank {rank} done at step {ft.global_step()}", flush=True)
