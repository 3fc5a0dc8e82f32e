"""Failure-free cost of --ft: the same model trained by plain torch DDP and by ftrun.ft, in turn.

Run under `ftrun --nproc N --ft` (scripts/bench_ft_overhead.py does). Each
worker builds three identical models: one wrapped in torch's DDP over the
default gloo group (init_process_group), one the same with torch's own
Python allreduce comm hook (default_hooks.allreduce_hook: what any hook
written in Python costs against DDP's built-in C++ one), one wrapped with
ftrun.ft, and steps them in turn (ABCABC...), so all see the same machine at
the same moments. Prints one JSON line per worker: the median and mean step
times of each.
"""

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import ftrun.ft as ft


def build(dim: int, hidden: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(dim, hidden), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(hidden, hidden), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(hidden, 1))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--depth", type=int, default=1)
    p.add_argument("--batch", type=int, default=96)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    plain = nn.parallel.DistributedDataParallel(build(args.dim, args.hidden, args.depth))
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.01, momentum=0.9)
    pyhook = nn.parallel.DistributedDataParallel(build(args.dim, args.hidden, args.depth))
    pyhook.register_comm_hook(None, default_hooks.allreduce_hook)
    pyhook_opt = torch.optim.SGD(pyhook.parameters(), lr=0.01, momentum=0.9)
    ftm = ft.DistributedDataParallel(build(args.dim, args.hidden, args.depth))
    ft_opt = ft.Optimizer(torch.optim.SGD(ftm.parameters(), lr=0.01, momentum=0.9))
    true_w = torch.randn(args.dim, 1, generator=torch.Generator().manual_seed(1)) / args.dim ** 0.5

    def batch(step: int, i: int, n: int):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(args.batch, args.dim, generator=g)
        y = x @ true_w
        return x.chunk(n)[i], y.chunk(n)[i]

    times = {"ddp": [], "pyhook": [], "ft": []}
    it = iter(ft.steps(args.steps))
    for k in range(args.steps):
        x, y = batch(k, rank, world)
        t0 = time.perf_counter()
        loss = nn.functional.mse_loss(plain(x), y)
        plain_opt.zero_grad(set_to_none=True)
        loss.backward()
        plain_opt.step()
        tp = time.perf_counter()
        loss = nn.functional.mse_loss(pyhook(x), y)
        pyhook_opt.zero_grad(set_to_none=True)
        loss.backward()
        pyhook_opt.step()
        t1 = time.perf_counter()
        step = next(it, None)
        if step is None:
            break
        where = (ft.replica_index(), ft.num_replicas())
        # Making the batch is the script's work, not ftrun's: left out, as for the DDP arms.
        tb = time.perf_counter()
        x, y = batch(step, *where)
        made = time.perf_counter() - tb
        loss = nn.functional.mse_loss(ftm(x), y)
        ft_opt.zero_grad(set_to_none=True)
        loss.backward()
        ft_opt.step()
        t2 = time.perf_counter()
        if k >= args.warmup:
            times["ddp"].append(tp - t0)
            times["pyhook"].append(t1 - tp)
            times["ft"].append(t2 - t1 - made)
    out = {"rank": rank, **{f"{k}_median_ms": 1e3 * statistics.median(v) for k, v in times.items()},
           **{f"{k}_mean_ms": 1e3 * statistics.mean(v) for k, v in times.items()}, "steps": len(times["ft"])}
    print("[result] " + json.dumps(out), flush=True)
    next(it, None)  # leave ftrun's loop (it records that the run is finished)


if __name__ == "__main__":
    main()
