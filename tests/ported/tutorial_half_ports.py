"""Half-way ports of the DDP tutorial (tests/ported/ddp_tutorial.py): what a user gets on the
way to tests/ported/ddp_tutorial_ft.py, each a defect ftrun must handle plainly.

--mode picks how far it is ported to ftrun.ft:
  plain    the tutorial as it is (run it under torchrun or ftrun without --ft)
  half     ft.DistributedDataParallel and ft.Optimizer, but the tutorial's own epoch loop
  steps    ported: the loop over ft.steps(), each step mapped to (epoch, batch), the data split
           over the live replicas; the script's init/destroy_process_group() pair is kept
  sampler  as steps, but the batches still come from a DistributedSampler given the default
           group's size and rank (dist.get_world_size()): a restarted replica has no default group
Writes OUT.rankN.json (steps taken, last epoch) when --out is given.
"""

import argparse
import json
import os

import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class Synthetic(Dataset):
    """The tutorial's MyTrainDataset: random (input, target) pairs, drawn once."""

    def __init__(self, size: int) -> None:
        g = torch.Generator().manual_seed(7)
        self.data = [(torch.rand(20, generator=g), torch.rand(1, generator=g)) for _ in range(size)]

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("total_epochs", type=int)
    p.add_argument("save_every", type=int)
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--mode", choices=["plain", "half", "steps", "sampler"], default="plain")
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    init_process_group(backend="gloo")
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    dataset = Synthetic(2048)
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    taken, last_epoch = 0, -1
    if args.mode == "plain":
        loader = DataLoader(dataset, batch_size=args.batch_size, sampler=DistributedSampler(dataset))
        ddp = DDP(model)
        for epoch in range(args.total_epochs):
            loader.sampler.set_epoch(epoch)
            for x, y in loader:
                optimizer.zero_grad()
                F.mse_loss(ddp(x), y).backward()
                optimizer.step()
                taken += 1
            last_epoch = epoch
            if local_rank == 0 and epoch % args.save_every == 0:
                print(f"Epoch {epoch} | snapshot", flush=True)
    else:
        import ftrun.ft as ft

        ddp = ft.DistributedDataParallel(model)
        opt = ft.Optimizer(optimizer)
        if args.mode == "half":
            loader = DataLoader(dataset, batch_size=args.batch_size, sampler=DistributedSampler(dataset))
            for epoch in range(args.total_epochs):
                for x, y in loader:
                    opt.zero_grad()
                    F.mse_loss(ddp(x), y).backward()
                    taken += bool(opt.step())
                last_epoch = epoch
        else:
            sampler = DistributedSampler(dataset, num_replicas=torch.distributed.get_world_size(),
                                         rank=torch.distributed.get_rank()) if args.mode == "sampler" else None
            per_epoch = len(dataset) // (args.batch_size * int(os.environ["WORLD_SIZE"]))
            for step in ft.steps(args.total_epochs * per_epoch):
                epoch, b = divmod(step, per_epoch)
                if sampler is not None:
                    sampler.set_epoch(epoch)
                    idx = list(sampler)[b * args.batch_size:(b + 1) * args.batch_size]
                else:
                    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(epoch))
                    glob = order[b * args.batch_size * ft.num_replicas():][:args.batch_size * ft.num_replicas()]
                    idx = glob.chunk(ft.num_replicas())[ft.replica_index()].tolist()
                x = torch.stack([dataset[i][0] for i in idx])
                y = torch.stack([dataset[i][1] for i in idx])
                opt.zero_grad()
                F.mse_loss(ddp(x), y).backward()
                taken += bool(opt.step())
                last_epoch = epoch
                if args.step_sleep:
                    import time

                    time.sleep(args.step_sleep)
    if args.out:
        with open(f"{args.out}.rank{rank}.json", "w") as f:
            json.dump({"taken": taken, "epoch": last_epoch}, f)
    destroy_process_group()
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main()
