"""A plain DDP training script whose all-reduce dominates the step (scripts/bench_slow_link.py runs it).

torchrun-style: it reads RANK, WORLD_SIZE, MASTER_ADDR... from its environment (gloo on CPU, nccl
with the GPU of LOCAL_RANK when CUDA is there) and knows nothing of ftrun, so `ftrun --hook ...`
changes what crosses the link without a line changed here. The model is an MLP of a few million
parameters whose compute is small next to its gradient's all-reduce over a slow link; the data is
synthetic with a learnable structure (a fixed random teacher network labels Gaussian inputs), each
rank drawing its own seeded batches, and a held-out set of the same teacher scores the result.

It trains a fixed number of steps and writes one JSON per rank (--out PREFIX: PREFIX.rankR.json):
steps/s after warm-up, the held-out loss at the end, and the bytes this rank's node sent per step
over the warm-up-free window, read from /sys/class/net/IFACE/statistics/tx_bytes (--iface, default
$GLOO_SOCKET_IFNAME): in a network namespace of its own that counter is this replica's traffic on
the link, TCP/IP headers included. Without an interface it reports no bytes (null).

Must never import ftrun: it is the unmodified user script the benchmark measures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def parse(argv: Optional[list] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=100, help="optimizer steps in all")
    p.add_argument("--warmup", type=int, default=10, help="steps before the timed and counted window")
    p.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    p.add_argument("--dim", type=int, default=1024, help="input width")
    p.add_argument("--hidden", type=int, default=1024, help="width of the hidden layers")
    p.add_argument("--depth", type=int, default=2, help="hidden layers")
    p.add_argument("--classes", type=int, default=64, help="labels the teacher gives")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW's learning rate")
    p.add_argument("--heldout", type=int, default=2048, help="held-out samples")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--iface", default=os.environ.get("GLOO_SOCKET_IFNAME"),
                   help="network interface whose tx_bytes counter is this node's traffic")
    p.add_argument("--out", default=None, help="write PREFIX.rankR.json")
    args = p.parse_args(argv)
    if not 0 <= args.warmup < args.steps:
        p.error("--warmup must be at least 0 and below --steps")
    return args


def tx_bytes(iface: Optional[str]) -> Optional[int]:
    """The interface's sent-bytes counter, or None without an interface (or without sysfs)."""
    if not iface:
        return None
    try:
        return int(Path(f"/sys/class/net/{iface}/statistics/tx_bytes").read_text())
    except (OSError, ValueError):
        return None


def mlp(inp: int, hidden: int, depth: int, out: int) -> nn.Sequential:
    layers, width = [], inp
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    return nn.Sequential(*layers, nn.Linear(width, out))


class Teacher:
    """A fixed random two-layer network labelling Gaussian inputs: a structure a student can learn,
    the same on every rank (seeded), so the held-out loss means something."""

    def __init__(self, dim: int, classes: int, seed: int, device: torch.device) -> None:
        g = torch.Generator().manual_seed(10_000 + seed)
        self.w1 = (torch.randn(dim, 128, generator=g) / math.sqrt(dim)).to(device)
        self.w2 = (torch.randn(128, classes, generator=g) * 3 / math.sqrt(128)).to(device)
        self.dim, self.device = dim, device

    def batch(self, n: int, g: torch.Generator):
        x = torch.randn(n, self.dim, generator=g).to(self.device)
        return x, (torch.tanh(x @ self.w1) @ self.w2).argmax(dim=1)


def main() -> None:
    args = parse()
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)  # one node's worker per core: the benchmark's machine has few

    torch.manual_seed(args.seed)
    model = DDP(mlp(args.dim, args.hidden, args.depth, args.classes).to(device),
                device_ids=[device.index] if use_cuda else None)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    loss_fn = nn.CrossEntropyLoss()
    teacher = Teacher(args.dim, args.classes, args.seed, device)
    # Each rank its own stream of samples; the held-out set from a seed no rank trains on.
    train_g = torch.Generator().manual_seed(1 + args.seed * 1000 + rank)
    hx, hy = teacher.batch(args.heldout, torch.Generator().manual_seed(999_999 + args.seed))

    def sync() -> None:
        if use_cuda:
            torch.cuda.synchronize(device)

    for step in range(1, args.steps + 1):
        if step == args.warmup + 1:  # the window: steps warmup+1 .. steps
            sync()
            t0, b0 = time.perf_counter(), tx_bytes(args.iface)
        x, y = teacher.batch(args.batch, train_g)
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()
    sync()
    elapsed, b1 = time.perf_counter() - t0, tx_bytes(args.iface)
    timed = args.steps - args.warmup
    with torch.no_grad():
        heldout = loss_fn(model.module(hx), hy).item()
    n_params = sum(p.numel() for p in model.parameters())
    result = {"rank": rank, "world": world, "params": n_params, "steps": args.steps, "timed_steps": timed,
              "steps_per_s": timed / elapsed, "heldout_loss": heldout, "chance_loss": math.log(args.classes),
              "tx_bytes_per_step": (b1 - b0) / timed if b0 is not None and b1 is not None else None,
              "iface": args.iface, "device": str(device)}
    print(json.dumps(result), flush=True)
    if args.out:
        Path(f"{args.out}.rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
