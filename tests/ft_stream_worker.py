"""The counter model over a stream: is every sample of every replica's shard trained exactly once
among committed steps under --ft, whatever fails?

Samples 0..SIZE-1; the stream is sharded by replica: replica r of R reads r, r + R, ... (an
IterableDataset that shards itself by its replica id and count, as a script under torchrun shards
by RANK and WORLD_SIZE). One weight per sample, SGD with lr 1, each worker's loss the sum of its
batch's weights times the live replicas: each committed step lowers each trained sample's weight
by exactly 1, so after E passes every weight is -E iff every sample was trained once a pass.

argv: PASSES OUT [--loader iterable|stateful] [--shards own|list] [--size N] [--batch B]
[--step-sleep S]. `list` gives ft.DataLoader every shard (a list), so any replica can read any.
`stateful` gives ft.DataLoader a loader with state_dict()/load_state_dict() (torchdata's
StatefulDataLoader protocol, written here: torchdata is not a test dependency). Writes
OUT.rankN.json: the weights, the loader's state and the step.
"""

import argparse
import json
import os
import time

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, IterableDataset

import ftrun.ft as ft


class Shard(IterableDataset):
    """Replica `shard` of `shards`' samples of 0..n-1, from the `skip`-th of them on."""

    def __init__(self, n: int, shard: int, shards: int) -> None:
        self.n, self.shard, self.shards, self.skip = n, shard, shards, 0

    def __iter__(self):
        for i in range(self.shard + self.skip * self.shards, self.n, self.shards):
            yield torch.tensor(i)


class StatefulLoader(DataLoader):
    """A DataLoader that says where it is, as torchdata's StatefulDataLoader does: the samples of
    its pass it has given (a fresh pass after the last), resumed by load_state_dict()."""

    def __init__(self, dataset: Shard, batch_size: int) -> None:
        super().__init__(dataset, batch_size=batch_size)
        self.given, self.resume = 0, None

    def __iter__(self):
        ds = self.dataset
        ds.skip, self.given = (self.resume, self.resume) if self.resume is not None else (0, 0)
        self.resume = None
        for batch in super().__iter__():
            self.given += len(batch)
            yield batch

    def state_dict(self):
        return {"samples_yielded": self.given}

    def load_state_dict(self, sd):
        self.resume = int(sd["samples_yielded"])


class Counter(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(n))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.w[idx]


p = argparse.ArgumentParser()
p.add_argument("passes", type=int)
p.add_argument("out")
p.add_argument("--loader", choices=["iterable", "stateful", "datasets"], default="iterable",
               help="datasets: a Hugging Face streaming dataset that ftrun splits (needs datasets installed)")
p.add_argument("--shards", choices=["own", "list"], default="own",
               help="own: each replica's dataset reads its own shard; list: ft.DataLoader gets every shard")
p.add_argument("--size", type=int, default=300)
p.add_argument("--batch", type=int, default=4)
p.add_argument("--step-sleep", type=float, default=0.0)
args = p.parse_args()

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
model = Counter(args.size)
ddp = ft.DistributedDataParallel(model)
opt = ft.Optimizer(torch.optim.SGD(ddp.parameters(), lr=1.0))
shards = [Shard(args.size, s, world) for s in range(world)]
if args.shards == "own":
    shards = shards[ft.replica_id()]
if args.loader == "datasets":
    import datasets

    def records(shards):
        for s in shards:
            for i in range(s, args.size, 2 * world):
                yield {"idx": i}

    hf = datasets.IterableDataset.from_generator(records, gen_kwargs={"shards": list(range(2 * world))})
    loader = ft.DataLoader(hf, batch_size=args.batch)
elif args.loader == "stateful":
    stateful = [StatefulLoader(s, args.batch) for s in shards] if args.shards == "list" else \
        StatefulLoader(shards, args.batch)
    loader = ft.DataLoader(stateful)
else:
    loader = ft.DataLoader(shards, batch_size=args.batch)
redone = 0  # batches handed out again after a step that was voted down (the same batches)
for epoch in ft.epochs(args.passes):
    for idx in loader:
        idx = idx["idx"] if isinstance(idx, dict) else idx
        redone += ft.redo()
        (ddp(idx).sum() * ft.num_replicas()).backward()
        if args.step_sleep:  # inside the step: a kill now is mid-step (its peers' exchange fails)
            time.sleep(args.step_sleep)
        opt.step()
        opt.zero_grad(set_to_none=True)

with open(f"{args.out}.rank{rank}.json", "w") as f:
    json.dump({"weights": model.w.detach().tolist(), "step": ft.global_step(), "redone": redone,
               "state": loader.state_dict()["stream"].hex()}, f)
print(f"done rank {rank} step {ft.global_step()}", flush=True)
