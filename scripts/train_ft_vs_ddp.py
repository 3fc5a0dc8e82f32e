"""Failure-free cost of --ft: the same model trained by plain torch DDP and by ftrun.ft, side by side.

Run under `ftrun --nproc N --ft` (scripts/bench_ft_overhead.py does). Each
worker builds three identical models: one wrapped in torch's DDP over a
gloo group of its own, one the same (on another group) with torch's own
Python allreduce comm hook (default_hooks.allreduce_hook: what any hook
written in Python costs against DDP's built-in C++ one), one wrapped with
ftrun.ft, and steps each once a step, in a random order (the same on every
worker), so all see the same machine at the same moments and background work
one arm leaves running (ftrun.ft's vote thread) is not always counted in the
arm after it. Prints one JSON line per worker: the median and mean step
times of each.
"""

import argparse
import json
import random
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
    p.add_argument("--optim", choices=["sgd", "adamw"], default="sgd", help="SGD with momentum 0.9, or AdamW")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    def optimizer(params):
        if args.optim == "adamw":
            return torch.optim.AdamW(params, lr=1e-3)
        return torch.optim.SGD(params, lr=0.01, momentum=0.9)

    # Every arm on a group of its own, as ftrun.ft is on its epoch's group: a group is used by
    # one arm in three, the same for all. With both DDP arms on the default group, it was used
    # twice as often as ftrun.ft's, and gloo's collectives on a group used less often are
    # slower: that alone made ftrun.ft look about 3% slower on the tiny model.
    plain = nn.parallel.DistributedDataParallel(build(args.dim, args.hidden, args.depth),
                                                process_group=dist.new_group(backend="gloo"))
    plain_opt = optimizer(plain.parameters())
    pyhook = nn.parallel.DistributedDataParallel(build(args.dim, args.hidden, args.depth),
                                                 process_group=dist.new_group(backend="gloo"))
    pyhook.register_comm_hook(None, default_hooks.allreduce_hook)
    pyhook_opt = optimizer(pyhook.parameters())
    ftm = ft.DistributedDataParallel(build(args.dim, args.hidden, args.depth))
    ft_opt = ft.Optimizer(optimizer(ftm.parameters()))
    # The comparison arms are torch's own, trained beside ftrun.ft's: registered as this replica's
    # own state, so the guard compares (and a check costs) ftrun.ft's model and optimizer only, as
    # in a script that trains one model.
    for name, obj in (("ddp", plain), ("ddp_opt", plain_opt), ("pyhook", pyhook), ("pyhook_opt", pyhook_opt)):
        ft.register_state(name, obj, compare=False)
    true_w = torch.randn(args.dim, 1, generator=torch.Generator().manual_seed(1)) / args.dim ** 0.5

    def batch(step: int, i: int, n: int):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(args.batch, args.dim, generator=g)
        y = x @ true_w
        return x.chunk(n)[i], y.chunk(n)[i]

    times = {"ddp": [], "pyhook": [], "ft": []}
    arms = {"ddp": (plain, plain_opt), "pyhook": (pyhook, pyhook_opt)}
    # The arms run in a new random order every step, the same on every worker (they must meet in
    # the same collectives): work an arm leaves running in the background (ftrun.ft's vote
    # thread) then lands in a random arm, not always in the arm after it, and no arm always
    # follows another.
    order = random.Random(0)
    it = iter(ft.steps(args.steps))
    for k in range(args.steps):
        x, y = batch(k, rank, world)
        for arm in order.sample(list(times), len(times)):
            t0 = time.perf_counter()
            if arm != "ft":
                model, opt = arms[arm]
                loss = nn.functional.mse_loss(model(x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                took = time.perf_counter() - t0
            else:
                step = next(it)
                if (step, ft.replica_index(), ft.num_replicas()) != (k, rank, world):
                    # Nothing fails here: the step's batch is the DDP arms' one, made before any arm
                    # is timed (making it is the script's work, not ftrun's).
                    raise SystemExit(f"train_ft_vs_ddp: ftrun.ft is at step {step} with {ft.num_replicas()} "
                                     f"replicas at step {k}: a round failed, and the timings mean nothing")
                loss = nn.functional.mse_loss(ftm(x), y)
                ft_opt.zero_grad(set_to_none=True)
                loss.backward()
                ft_opt.step()
                took = time.perf_counter() - t0
            if k >= args.warmup:
                times[arm].append(took)
    out = {"rank": rank, **{f"{k}_median_ms": 1e3 * statistics.median(v) for k, v in times.items()},
           **{f"{k}_mean_ms": 1e3 * statistics.mean(v) for k, v in times.items()}, "steps": len(times["ft"])}
    print("[result] " + json.dumps(out), flush=True)
    next(it, None)  # leave ftrun's loop (it records that the run is finished)


if __name__ == "__main__":
    main()
