"""A --ft training loop whose state changes before the optimizer step: for tests/test_checkpoint.py.

The model has BatchNorm (its running statistics change in every forward), and
a registered sampler moves on at the top of every iteration, before the
forward (its position picks the batch). A checkpoint copies the parameters in
the background while the forward and backward run; these two must be copied
at once, or a resumed run would differ from one never interrupted. (A
discarded round undoes its own changes to both, so that runs with and without
failures take the same committed steps.)

    ckpt_worker.py STEPS OUT [--width W] [--optim adam|sgd] [--step-sleep S]

Writes OUT.rankN.pt: parameters and buffers, optimizer state, the sampler's
position and the global step.
"""

import argparse
import os
import time

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
    p.add_argument("--optim", default="adam")
    p.add_argument("--step-sleep", type=float, default=0.0)
    args = p.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, args.width), nn.BatchNorm1d(args.width), nn.ReLU(), nn.Linear(args.width, 1))
    ddp = ft.DistributedDataParallel(model)
    inner = (torch.optim.Adam(ddp.parameters(), lr=0.01) if args.optim == "adam"
             else torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9))
    opt = ft.Optimizer(inner)
    sampler = Sampler()
    ft.register_state("sampler", sampler)
    for step in ft.steps(args.steps):
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
