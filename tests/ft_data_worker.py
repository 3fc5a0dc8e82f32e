"""The counter model: is every sample trained exactly once an epoch under --ft, whatever fails?

One weight per sample, zero at the start; SGD with lr 1; each worker's loss is the sum of its
batch's weights times the data-parallel workers alive. DDP averages, so every committed step
lowers the weight of each sample it trained on by exactly 1: after E epochs every weight is
exactly -E if and only if every sample was trained once an epoch.

argv: EPOCHS OUT, then options. Writes OUT.rankN.json: the final weights (rank 0 of each
replica), the batches this process drew (epoch, indices, committed) and its steps.
"""

import argparse
import json
import os
import time

import torch
import torch.nn as nn
from torch.utils.data import Dataset

import ftrun.ft as ft


class Indices(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(i)


class Counter(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(n))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.w[idx]


p = argparse.ArgumentParser()
p.add_argument("epochs", type=int)
p.add_argument("out")
p.add_argument("--size", type=int, default=500)
p.add_argument("--batch", type=int, default=4)
p.add_argument("--workers", type=int, default=0)
p.add_argument("--accumulate", type=int, default=1)
p.add_argument("--step-sleep", type=float, default=0.0)
p.add_argument("--style", choices=["epochs", "steps"], default="epochs")
p.add_argument("--steps", type=int, default=0, help="--style steps: the loop's total")
p.add_argument("--no-shuffle", action="store_true")
args = p.parse_args()

k = int(os.environ.get("FTRUN_REPLICA_SIZE", "1"))
torch.manual_seed(0)
model = Counter(args.size)
if k > 1:
    from torch.distributed.fsdp import fully_shard

    fully_shard(model, mesh=ft.device_mesh())
    ddp = ft.replicate(model)
else:
    ddp = ft.DistributedDataParallel(model)
opt = ft.Optimizer(torch.optim.SGD(ddp.parameters(), lr=1.0))
loader = ft.DataLoader(Indices(args.size), batch_size=args.batch, shuffle=not args.no_shuffle, seed=3,
                       num_workers=args.workers, persistent_workers=args.workers > 0)
drawn = []


def train_on(batches):
    """One optimizer step over `batches` (micro-batches, all but the last under no_sync)."""
    for j, idx in enumerate(batches):
        loss = ddp(idx).sum() * ft.num_replicas() * k
        if j < len(batches) - 1 and k == 1:
            with ddp.no_sync():
                loss.backward()
        else:
            loss.backward()
    committed = opt.step()
    opt.zero_grad(set_to_none=True)
    for idx in batches:
        drawn.append([ft.global_step(), [int(i) for i in idx], bool(committed)])
    if args.step_sleep:
        time.sleep(args.step_sleep)


if args.style == "epochs":
    for epoch in ft.epochs(args.epochs):
        pending = []
        for i, idx in enumerate(loader):
            pending.append(idx)
            if len(pending) == args.accumulate or i + 1 == len(loader):
                train_on(pending)
                pending = []
else:  # a step loop that takes its batches from the loader, a new pass at each epoch's end
    batches = iter(loader)
    for step in ft.steps(args.steps):
        micro = []
        while len(micro) < args.accumulate:
            try:
                micro.append(next(batches))
            except StopIteration:
                batches = iter(loader)
        train_on(micro)

rank = int(os.environ["RANK"])
weights = None
if k == 1:
    weights = model.w.detach().tolist()
else:
    weights = model.w.full_tensor().detach().tolist()
with open(f"{args.out}.rank{rank}.json", "w") as f:
    json.dump({"weights": weights, "drawn": drawn, "step": ft.global_step(), "loader_epoch": loader.epoch}, f)
print(f"done rank {rank} step {ft.global_step()}", flush=True)
