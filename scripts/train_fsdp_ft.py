"""A sharded training script with ftrun's fault-tolerance API: FSDP2 inside each replica.

    ftrun --nproc 4 --ft --replica-size 2 scripts/train_fsdp_ft.py

Each replica is --replica-size workers that shard the model between them
(`fully_shard` over `ft.device_mesh()`); gradients are averaged across the
live replicas shard by shard, and a replica that dies restarts as a whole
and receives its shards from worker j of a live replica. Five lines differ
from a plain FSDP2 script, marked FT. No init_process_group, no checkpoint.

Data: a dataset of --data-size synthetic samples read by ft.DataLoader: every
worker of every live replica gets a batch of its own (FSDP is data parallel
inside a replica too), --batch / workers samples each, and every sample is
trained once an epoch whatever fails. With --hsdp-reference the same script
trains with plain torch HSDP (no ftrun.ft, a 2-D replicate x shard mesh over
every worker, run it under ftrun without --ft or torchrun) on the same batches,
from DistributedSampler and a DataLoader, for comparison: with no failure
ft.DataLoader gives each worker exactly those.
"""

import argparse
import json
import os
import time

import torch
import torch.nn as nn
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch", type=int, default=32, help="global batch with every worker alive: --batch / workers each")
    p.add_argument("--data-size", type=int, default=8192, help="samples in the dataset")
    p.add_argument("--dim", type=int, default=128, help="width of the residual stream")
    p.add_argument("--hidden", type=int, default=512, help="width inside each block")
    p.add_argument("--blocks", type=int, default=4, help="MLP blocks, each sharded on its own")
    p.add_argument("--out", default=None,
                   help="write this worker's shards (parameters, optimizer state) to OUT.rankN.pt and its "
                        "losses and commits to OUT.rankN.json")
    p.add_argument("--print-every", type=int, default=20)
    p.add_argument("--announce", action="store_true",
                   help="print one line when this process completes its first committed step")
    p.add_argument("--hsdp-reference", type=int, default=0, metavar="K",
                   help="plain torch HSDP instead of ftrun.ft: replicas of K workers, no fault tolerance")
    return p.parse_args()


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, dim: int, hidden: int, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim, hidden) for _ in range(blocks))
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class Synthetic(torch.utils.data.Dataset):
    """Samples (x, f(x) + noise), each drawn from its own index: no file to read."""

    def __init__(self, size: int, dim: int) -> None:
        self.size, self.dim = size, dim

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(1_000_003 + i)
        x = torch.randn(self.dim, generator=g)
        return x, x[:1] * 0.5 + x[1:2].sin() + 0.01 * torch.randn(1, generator=g)


def batches(loader, set_epoch=None):
    """The loader's batches pass after pass (an epoch each), for a loop over steps."""
    epoch = 0
    while True:
        if set_epoch is not None:
            set_epoch(epoch)
        yield from loader
        epoch += 1


def main() -> None:
    args = parse()
    torch.manual_seed(0)
    model = Net(args.dim, args.hidden, args.blocks)
    data = Synthetic(args.data_size, args.dim)
    per_worker = max(1, args.batch // int(os.environ["WORLD_SIZE"]))
    if args.hsdp_reference:
        import itertools

        from torch.distributed.device_mesh import init_device_mesh

        k = args.hsdp_reference
        dist.init_process_group("gloo")
        mesh = init_device_mesh("cpu", (dist.get_world_size() // k, k), mesh_dim_names=("replicate", "shard"))
        for b in model.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
        loop = itertools.takewhile(lambda s: s < args.steps, itertools.count())
        replicas = mesh.size(0)
        sampler = torch.utils.data.DistributedSampler(data, num_replicas=dist.get_world_size(),
                                                      rank=dist.get_rank(), shuffle=True, seed=0)
        feed = batches(torch.utils.data.DataLoader(data, batch_size=per_worker, sampler=sampler), sampler.set_epoch)
        ft = None
    else:
        import ftrun.ft as ft

        mesh = ft.device_mesh()                                                          # FT
        for b in model.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model = ft.replicate(model)                                                      # FT
        opt = ft.Optimizer(torch.optim.AdamW(model.parameters(), lr=args.lr))           # FT
        loop = ft.steps(args.steps)                                                      # FT
        feed = batches(ft.DataLoader(data, batch_size=per_worker, shuffle=True, seed=0))  # FT

    # The mesh's device: LOCAL_RANK's GPU where there are GPUs (ft.device_mesh() made it current).
    device = torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device("cpu")
    losses, commits = [], []
    announced = not args.announce
    for step in loop:
        if ft is not None:
            replicas = ft.num_replicas()
        x, y = next(feed)
        x, y = x.to(device), y.to(device)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        committed = opt.step()
        if ft is None or committed:
            losses.append((step, loss.item()))
            commits.append((step, time.time()))
            if not announced:
                announced = True
                print(f"[announce] rank {os.environ['RANK']} pid {os.getpid()} first step {step} "
                      f"t {time.time():.6f}", flush=True)
        if step % args.print_every == 0:
            print(f"step {step} loss {loss.item():.5f} replicas {replicas}", flush=True)

    rank = int(os.environ["RANK"])
    if args.out:
        shards = {"model": {n: p.to_local().detach().clone() if hasattr(p, "to_local") else p.detach().clone()
                            for n, p in model.state_dict().items()},
                  "optim": {i: {n: (v.to_local() if hasattr(v, "to_local") else v).detach().clone()
                                for n, v in s.items()} for i, s in opt.state_dict()["state"].items()}}
        torch.save(shards, f"{args.out}.rank{rank}.pt")
        with open(f"{args.out}.rank{rank}.json", "w") as f:
            json.dump({"step": ft.global_step() if ft else args.steps, "losses": losses, "commits": commits}, f)
    print(f"done at step {ft.global_step() if ft else args.steps}", flush=True)
    if ft is None:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
