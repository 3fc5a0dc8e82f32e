"""Streaming benchmark: ft.DataLoader over a sharded IterableDataset against torch's DataLoader
over the same shard, as a torchrun DDP script reads it.

    .venv/bin/python scripts/bench_stream.py               # 5 runs
    .venv/bin/python scripts/bench_stream.py --runs 3 --steps 208

Each run is `ftrun --nproc 2 --ft scripts/bench_stream.py --worker`: two replicas, each reading
its own shard of one stream (an IterableDataset split by replica id, as a torchrun script splits
by RANK; every sample a small image made from its index, blurred and flipped with torch ops:
CPU-bound), batch --batch a replica, --workers DataLoader workers each (the dataset splits its
shard between them by get_worker_info()). One ft.steps() loop takes its batches from one loader
or the other in blocks of --block steps, ABBA... or BAAB... (alternate runs), so both arms see the
same machine; every step trains a small linear model on the batch (DDP over the live replicas,
ft.Optimizer). The torch arm is what the same loop reads under torchrun: a DataLoader over the
shard, nothing exchanged; the ft arm adds what ft.DataLoader does per step (the all-gather of the
shards' positions before the vote, and the bookkeeping of the batches a step drew).
Reported: samples/s per arm (both replicas' samples over the arm's steps; medians over runs, the
ratio ft / torch per run, then its median), and the bytes a replica holds for every shard's
position (the ft.DataLoader's registered state) and sends per step in the exchange.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import scratch

ROOT = Path(__file__).resolve().parent.parent
RESULT = re.compile(r"\[result\] (\{.*\})")


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, IterableDataset, get_worker_info

    import ftrun.ft as ft

    side = args.side

    class Shard(IterableDataset):
        """Samples shard, shard + shards, ... of the stream; split between the loader's workers."""

        def __init__(self, shard: int, shards: int) -> None:
            self.shard, self.shards = shard, shards

        def __iter__(self):
            info = get_worker_info()
            w, nw = (info.id, info.num_workers) if info else (0, 1)
            for n, i in enumerate(range(self.shard, args.size, self.shards)):
                if n % nw != w:
                    continue
                g = torch.Generator().manual_seed(i)
                img = torch.rand(3, side, side, generator=g)
                img = F.avg_pool2d(img[None], 3, 1, 1)[0].flip(-1)
                yield img.mean(0).flatten()[:64], i % 10

    shards = int(os.environ["WORLD_SIZE"])
    me = ft.replica_id()
    model = ft.DistributedDataParallel(torch.nn.Linear(64, 10))
    opt = ft.Optimizer(torch.optim.SGD(model.parameters(), lr=0.01))
    kw = dict(batch_size=args.batch, num_workers=args.workers)
    loaders = {"torch": DataLoader(Shard(me, shards), **kw), "ft": ft.DataLoader(Shard(me, shards), **kw)}
    its = {a: iter(l) for a, l in loaders.items()}
    order = ["torch", "ft", "ft", "torch"] if args.first == "torch" else ["ft", "torch", "torch", "ft"]
    took = {a: 0.0 for a in loaders}
    samples = {a: 0 for a in loaders}
    for step in ft.steps(args.warmup + args.steps):
        k = max(0, step - args.warmup)
        arm = order[(k // args.block) % 4] if step >= args.warmup else order[step % 2]
        t = time.perf_counter()
        try:
            x, y = next(its[arm])
        except StopIteration:
            its[arm] = iter(loaders[arm])
            x, y = next(its[arm])
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        if step >= args.warmup:
            took[arm] += time.perf_counter() - t
            samples[arm] += len(y) * ft.num_replicas()
    stream = loaders["ft"].stream
    held = len(loaders["ft"].state_dict()["stream"])
    sent = 8 + stream.table.capacity()
    if ft.replica_id() == 0:
        print("[result] " + json.dumps({"samples_per_s": {a: samples[a] / took[a] for a in loaders},
                                        "held_bytes": held, "sent_bytes_per_step": sent,
                                        "positions": len(stream.table.shards)}), flush=True)


def _ftrun(args: list) -> str:
    home = tempfile.mkdtemp(prefix="bench-stream-")
    env = dict(os.environ, FTRUN_HOME=home)
    proc = subprocess.run([sys.executable, "-m", "ftrun", "--nproc", "2", "--ft", "--run-id",
                           f"stream-{int(time.time() * 1000)}", str(Path(__file__).resolve()), "--worker",
                           *map(str, args)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=1200)
    text = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise SystemExit(f"bench_stream: run failed (exit {proc.returncode}):\n{text[-3000:]}")
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--size", type=int, default=100000, help="samples in the stream (a pass)")
    ap.add_argument("--side", type=int, default=64, help="the made image's side, in pixels")
    ap.add_argument("--batch", type=int, default=32, help="samples per replica and step")
    ap.add_argument("--workers", type=int, default=2, help="DataLoader workers per replica and loader")
    ap.add_argument("--block", type=int, default=25, help="steps in a row from one loader")
    ap.add_argument("--steps", type=int, default=400, help="timed steps in a run (after the warm-up)")
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--first", choices=["torch", "ft"], default="torch", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    shape = ["--size", args.size, "--side", args.side, "--batch", args.batch, "--workers", args.workers,
             "--block", args.block, "--steps", args.steps, "--warmup", args.warmup]
    runs = []
    for i in range(args.runs):
        first = ("torch", "ft")[i % 2]
        rows = [json.loads(m[1]) for m in RESULT.finditer(_ftrun([*shape, "--first", first]))]
        if not rows:
            raise SystemExit("bench_stream: the run reported nothing")
        run = dict(rows[0]["samples_per_s"], first=first, held=rows[0]["held_bytes"],
                   sent=rows[0]["sent_bytes_per_step"], positions=rows[0]["positions"])
        run["ratio"] = run["ft"] / run["torch"]
        runs.append(run)
        print(f"run {i + 1}: {json.dumps(run)}", flush=True)
    med = {k: statistics.median(r[k] for r in runs) for k in ("torch", "ft", "ratio")}
    print(f"\n| loader | samples/s (median of {len(runs)}) |\n|---|---:|")
    print(f"| DataLoader over the shard (torchrun) | {med['torch']:.0f} |")
    print(f"| ft.DataLoader over the shard | {med['ft']:.0f} |")
    each = ", ".join(f"{r['ratio']:.3f}" for r in runs)
    print(f"\nft / torch: median {med['ratio']:.3f} (per run: {each})")
    print(f"a replica holds {runs[0]['held']} B for the {runs[0]['positions']} shards' positions and sends "
          f"{runs[0]['sent']} B a step in their exchange")


if __name__ == "__main__":
    scratch.run(main)
