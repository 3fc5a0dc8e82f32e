"""A --ft training loop whose state changes before the optimizer step: for tests/test_checkpoint.py.

The model has BatchNorm (its running statistics change in every forward), and
a registered sampler moves on at the top of every iteration, before the
forward (its position picks the batch). A checkpoint copies the parameters in
the background while the forward and backward run; these two must be copied
at once, or a resumed run would differ from one never interrupted. (A
discarded round undoes its own changes to both, so that runs with and without
failures take the same committed steps.)

    ckpt_worker.py STEPS OUT [--width W] [--depth D] [--optim adam|adamw|sgd] [--bucket-cap-mb MB]
                   [--step-sleep S] [--die-once FILE:STEP]

--depth adds D hidden layers of W x W, and a small --bucket-cap-mb splits the model into several
DDP buckets (the layout round must reduce them as DDP does). --die-once: the replica at index 1
at step STEP SIGKILLs itself there, as a kill from outside would, if its process began past step
0 (it resumed from a checkpoint), once in the run (FILE marks it done).

Writes OUT.rankN.pt: parameters and buffers, optimizer state, the sampler's
position and the global step.
"""

import argparse
import os
import signal
import time
from pathlib import Path

import torch
import torch.nn as nn

import ftrun.ft as ft


class Sampler:
    """Yields batch seeds; its position is registered state."""

    def __init__(self) -> None:
        self.position = 0
        self.drawn = []

    def next_seed(self) -> int:
        self.position += 1
        self.drawn.append(self.position % 7)  # a list that changes in place
        return self.position * 7919

    def state_dict(self) -> dict:
        return {"position": self.position, "drawn": self.drawn}

    def load_state_dict(self, sd: dict) -> None:
        self.position = int(sd["position"])
        self.drawn = list(sd["drawn"])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("steps", type=int)
    p.add_argument("out")
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--depth", type=int, default=0)
    p.add_argument("--optim", default="adam")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--die-once", default="")
    args = p.parse_args()
    marker, _, die_at = args.die_once.rpartition(":")
    began = None
    torch.manual_seed(0)
    hidden = [m for _ in range(args.depth) for m in (nn.Linear(args.width, args.width), nn.ReLU())]
    model = nn.Sequential(nn.Linear(8, args.width), nn.BatchNorm1d(args.width), nn.ReLU(), *hidden,
                          nn.Linear(args.width, 1))
    ddp = ft.DistributedDataParallel(model, bucket_cap_mb=args.bucket_cap_mb)
    inner = {"adam": lambda ps: torch.optim.Adam(ps, lr=0.01), "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01),
             "sgd": lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9)}[args.optim](ddp.parameters())
    opt = ft.Optimizer(inner)
    sampler = Sampler()
    ft.register_state("sampler", sampler)
    for step in ft.steps(args.steps):
        began = step if began is None else began
        if marker and began > 0 and step == int(die_at) and ft.replica_index() == 1 and not Path(marker).exists():
            Path(marker).touch()
            os.kill(os.getpid(), signal.SIGKILL)
        seed = sampler.next_seed()  # moves on before the forward, committed or not
        before = [b.clone() for b in model.buffers()]
        x = torch.randn(24, 8, generator=torch.Generator().manual_seed(seed))
        x = x.chunk(ft.num_replicas())[ft.replica_index()]
        loss = ddp(x).pow(2).mean()  # BatchNorm's statistics move on here
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if not opt.step():
            # A discarded round leaves nothing behind (here, as ftrun does for parameters and the
            # optimizer): its batch is taken again, its statistics undone.
            sampler.position -= 1
            sampler.drawn.pop()
            with torch.no_grad():
                for b, old in zip(model.buffers(), before):
                    b.copy_(old)
        if args.step_sleep:
            time.sleep(args.step_sleep)
    torch.save({"model": {k: v.clone() for k, v in model.state_dict().items()}, "optim": inner.state_dict(),
                "sampler": sampler.state_dict(), "step": ft.global_step()},
               f"{args.out}.rank{os.environ['RANK']}.pt")


if __name__ == "__main__":
    main()
