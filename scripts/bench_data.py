"""Data loading benchmark: ft.DataLoader against torch's DataLoader + DistributedSampler.

    .venv/bin/python scripts/bench_data.py              # 5 runs, then 5 heals
    .venv/bin/python scripts/bench_data.py --runs 3 --heals 3

Throughput. Each run is `ftrun --nproc 2 --ft scripts/bench_data.py --worker`: two replicas,
each with both loaders over the same CPU-bound map-style dataset (every sample an image
"decoded" from its seed, blurred, randomly cropped and resized, flipped and colour-jittered
with torch ops: about 0.5 ms of CPU each), num_workers=2 and persistent workers each, batch
32 a replica, shuffled. One ft.steps() loop takes its batches from one loader or the other in
blocks of --block steps, in the order ABBA ABBA... or BAAB BAAB... (alternate runs), so that
both arms see the same machine and neither always goes first; every step trains a small
convolutional net on the batch (DDP over the live replicas, ft.Optimizer): ft.DataLoader's
position advances only in committed steps, as in a real loop, and the loader, not the
model, takes most of the CPU. Per run and arm, after 8 steps of warm-up that start both
loaders' workers:
- samples/s: the samples both replicas trained over the time of the arm's steps;
- CPU time per sample: the replica's main process in the arm's steps, plus the arm's loader
  workers, over the samples the replica took (what neighbours on a shared machine do not move);
- the main process's CPU in next() per batch, the loader workers' CPU per sample.
Ratios are ft.DataLoader's over DataLoader + DistributedSampler's; medians over --runs runs.
Also reported: a cold start (the first iter() to the first batch, its workers started) of the
arm that went first.

Heal. Each heal run trains with ft.DataLoader alone and SIGKILLs replica 1 after a few steps;
ftrun restarts it and it heals from its peer. The restarted replica reports the time from
the end of its heal (its training phase begins) to its first batch: its loader's workers
start and load the batch at the run's position. Medians over --heals runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
import scratch

ROOT = Path(__file__).resolve().parent.parent
RESULT = re.compile(r"\[(result|heal)\] (\{.*\})")


# ---------------------------------------------------------------- the worker (under ftrun --ft)
def worker(args: argparse.Namespace) -> None:
    t_start = time.time()
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, Dataset, DistributedSampler

    import ftrun.ft as ft
    from ftrun.worker.ft.manager import manager

    class SyntheticImages(Dataset):
        """CPU-bound samples: an image decoded from its seed, then augmented, all with torch ops."""

        def __init__(self, n: int, side: int) -> None:
            self.n, self.side = n, side
            k = torch.tensor([1.0, 4.0, 6.0, 4.0, 1.0])
            k = k[:, None] * k[None, :]
            self.kernel = (k / k.sum()).expand(3, 1, 5, 5).contiguous()

        def __len__(self) -> int:
            return self.n

        def __getitem__(self, i: int):
            side, g = self.side, torch.Generator().manual_seed(int(i))
            x = torch.randint(0, 256, (3, side, side), dtype=torch.uint8, generator=g).float().div_(255)
            s = int(torch.randint(side // 2, side + 1, (1,), generator=g))
            top, left = torch.randint(0, side - s + 1, (2,), generator=g).tolist()
            x = F.conv2d(x[None, :, top:top + s, left:left + s], self.kernel, padding=2, groups=3)
            x = F.interpolate(x, size=(32, 32), mode="bilinear", antialias=True)[0]
            if float(torch.rand(1, generator=g)) < 0.5:
                x = x.flip(-1)
            x = x * (0.8 + 0.4 * torch.rand(3, 1, 1, generator=g))
            return (x - 0.5) / 0.25, int(i) % 10

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.manual_seed(0)
    data = SyntheticImages(args.size, args.side)
    net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(16, 32, 3, padding=1),
                        nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(512, 10))
    model = ft.DistributedDataParallel(net)
    opt = ft.Optimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    common = dict(batch_size=args.batch, num_workers=args.workers, persistent_workers=args.workers > 0)
    ours = ft.DataLoader(data, shuffle=True, seed=0, **common)
    arms = {"ft": ours}
    if not args.heal:
        # The torchrun way: a fixed rank's shard (a restarted replica could not use it: see the docs).
        sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
        arms["torch"] = DataLoader(data, sampler=sampler, **common)

    epochs = {name: 0 for name in arms}
    iters = {}
    cold = {}

    def next_batch(name: str):
        """The arm's next batch: a new pass (the next epoch) when one ends."""
        loader = arms[name]
        while True:
            if name not in iters:
                if name == "torch":
                    loader.sampler.set_epoch(epochs[name])
                iters[name] = iter(loader)
            try:
                t0 = time.perf_counter()
                batch = next(iters[name])
                cold.setdefault(name, time.perf_counter() - t0)
                return batch
            except StopIteration:
                del iters[name]
                epochs[name] += 1

    other = {"ft": "torch", "torch": "ft"}[args.first]
    pattern = [args.first, other, other, args.first] if not args.heal else ["ft"]
    fetch_cpu = {name: 0.0 for name in arms}   # the main process's CPU in next(), after warm-up
    step_cpu = {name: 0.0 for name in arms}    # the main process's CPU in whole steps, after warm-up
    taken = {name: 0 for name in arms}         # samples this replica took, after warm-up
    workers_at = {}                            # the loader workers' CPU when warm-up ended

    def workers_cpu() -> dict:
        import psutil

        pids = {"ft": [w.pid for w in ours._inner._workers], "torch": [w.pid for w in iters["torch"]._workers]}
        return {a: sum(sum(psutil.Process(pid).cpu_times()[:2]) for pid in pids[a]) for a in arms}
    spent = {name: 0.0 for name in arms}
    samples = {name: 0 for name in arms}
    first = None
    t_prev, c_prev = time.perf_counter(), time.process_time()
    for step in ft.steps(args.steps):
        arm = pattern[(step // args.block) % len(pattern)]
        if step < args.warmup:
            arm = pattern[step % len(pattern)]  # both arms' workers started before anything is timed
        if step == args.warmup and not args.heal:
            workers_at = workers_cpu()
        c0 = time.process_time()
        x, y = next_batch(arm)
        if step >= args.warmup:
            fetch_cpu[arm] += time.process_time() - c0
        if first is None:
            first = time.time()
            mgr = manager()
            if mgr.heals:  # a restarted replica that healed: from its training phase to this batch
                print("[heal] " + json.dumps({"rank": rank, "heal_to_batch_s": first - mgr.phase_since,
                                              "transfer_s": mgr.last_heal_s, "start_to_batch_s": first - t_start}),
                      flush=True)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        end = time.perf_counter()
        c_end = time.process_time()
        if step >= args.warmup:  # the whole step (the loop's own top included), as the arm's
            spent[arm] += end - t_prev
            step_cpu[arm] += c_end - c_prev
            samples[arm] += len(y) * ft.num_replicas()
            taken[arm] += len(y)
        if args.step_sleep:
            time.sleep(args.step_sleep)
        t_prev, c_prev = time.perf_counter(), time.process_time()
    if not args.heal:
        # The CPU each arm's loader workers used after warm-up, per sample this replica took from
        # it (their prefetch at either end is the same few batches for both).
        now = workers_cpu()
        worker_cpu = {a: now[a] - workers_at[a] for a in arms}
        print("[result] " + json.dumps({
            "rank": rank, "samples_per_s": {a: samples[a] / spent[a] for a in arms}, "cold_first_batch_s": cold,
            "worker_cpu_ms_per_sample": {a: worker_cpu[a] * 1e3 / taken[a] for a in arms},
            "fetch_cpu_us_per_batch": {a: fetch_cpu[a] * 1e6 * args.batch / taken[a] for a in arms},
            "cpu_ms_per_sample": {a: (worker_cpu[a] + step_cpu[a]) * 1e3 / taken[a] for a in arms}}), flush=True)


# ---------------------------------------------------------------- the driver
def _ftrun(args: list, kill_after: int = 0) -> str:
    """One `ftrun --nproc 2 --ft` run of this script's worker; its console text. With kill_after,
    rank 1 is SIGKILLed once its status shows that many steps."""
    home = tempfile.mkdtemp(prefix="bench-data-")
    env = dict(os.environ, FTRUN_HOME=home)
    run_id = f"data-{int(time.time() * 1000)}"
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen([sys.executable, "-m", "ftrun", "--nproc", "2", "--ft", "--run-id", run_id,
                                 str(Path(__file__).resolve()), "--worker", *map(str, args)], stdout=out,
                                stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
        try:
            if kill_after:
                deadline = time.time() + 300
                while time.time() < deadline and proc.poll() is None:
                    try:
                        st = json.loads((Path(home) / run_id / "state.json").read_text())
                        r1 = [r for r in st["replicas"] if r["rank"] == 1 and r.get("pid")]
                        if r1 and r1[0]["step"] >= kill_after and r1[0]["state"] == "running":
                            os.kill(r1[0]["pid"], signal.SIGKILL)
                            break
                    except (OSError, ValueError, KeyError):
                        pass
                    time.sleep(0.02)
            proc.wait(timeout=1200)
        finally:
            proc.kill()
        out.seek(0)
        text = out.read()
    if proc.returncode != 0:
        raise SystemExit(f"bench_data: run failed (exit {proc.returncode}):\n{text[-3000:]}")
    return text


def _rows(text: str, kind: str) -> list:
    return [json.loads(m[2]) for m in RESULT.finditer(text) if m[1] == kind]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--heals", type=int, default=5)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--heal", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--size", type=int, default=3200, help="samples in the dataset")
    ap.add_argument("--side", type=int, default=96, help="the decoded image's side, in pixels")
    ap.add_argument("--batch", type=int, default=32, help="samples per replica and step")
    ap.add_argument("--workers", type=int, default=2, help="DataLoader workers per replica")
    ap.add_argument("--block", type=int, default=25, help="steps in a row from one loader")
    ap.add_argument("--steps", type=int, default=408, help="steps in a run (after 8 of warm-up: 16 blocks)")
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--first", choices=["torch", "ft"], default="torch", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    shape = ["--size", args.size, "--side", args.side, "--batch", args.batch, "--workers", args.workers]
    runs = []
    for i in range(args.runs):
        first = ("torch", "ft")[i % 2]  # which arm starts its workers, and its blocks, first: ABBA or BAAB
        rows = _rows(_ftrun([*shape, "--block", args.block, "--steps", args.steps, "--warmup", args.warmup,
                             "--first", first]), "result")
        run = {arm: statistics.mean(r["samples_per_s"][arm] for r in rows) for arm in ("torch", "ft")}
        run["ratio"] = run["ft"] / run["torch"]
        for key in ("worker_cpu_ms_per_sample", "fetch_cpu_us_per_batch", "cpu_ms_per_sample"):
            run[key] = {arm: statistics.mean(r[key][arm] for r in rows) for arm in ("torch", "ft")}
        run["cpu_ratio"] = run["cpu_ms_per_sample"]["torch"] / run["cpu_ms_per_sample"]["ft"]
        run["first"] = first
        run["cold_first"] = statistics.mean(r["cold_first_batch_s"][first] for r in rows)
        runs.append(run)
        print(f"run {i + 1}: {json.dumps(run)}", flush=True)
    heals = []
    for i in range(args.heals):
        # Slow steps while the replica is away, so that the run is still going when it is back.
        rows = _rows(_ftrun([*shape, "--heal", "--steps", 150, "--warmup", 0, "--step-sleep", 0.05], kill_after=10),
                     "heal")
        if not rows:
            raise SystemExit("bench_data: the restarted replica reported no heal")
        heals.append(rows[0])
        print(f"heal {i + 1}: {json.dumps(rows[0])}", flush=True)

    med = {k: statistics.median(r[k] for r in runs) for k in ("torch", "ft", "ratio")} if runs else {}
    if runs:
        print("\n| loader | samples/s (median) | loader workers' CPU per sample | main process's CPU per batch "
              "taken | cold start to first batch |")
        print("|---|---:|---:|---:|---:|")
        for arm, name in (("torch", "DataLoader + DistributedSampler"), ("ft", "ft.DataLoader")):
            cold = [r["cold_first"] for r in runs if r["first"] == arm]
            cold_ms = f"{statistics.median(cold) * 1e3:.0f} ms" if cold else "-"
            print(f"| {name} | {med[arm]:.0f} | "
                  f"{statistics.median(r['worker_cpu_ms_per_sample'][arm] for r in runs):.2f} ms | "
                  f"{statistics.median(r['fetch_cpu_us_per_batch'][arm] for r in runs):.0f} us | {cold_ms} |")
        ratios = sorted(r["ratio"] for r in runs)
        cpu = sorted(r["cpu_ratio"] for r in runs)
        print(f"\nft.DataLoader / DataLoader + DistributedSampler, samples/s: {med['ratio']:.3f} (median of "
              f"{len(runs)} runs; {', '.join(f'{x:.3f}' for x in ratios)}); by CPU time per sample (a replica's main "
              f"process and its loader's workers): {statistics.median(cpu):.3f} ({', '.join(f'{x:.3f}' for x in cpu)})")
    if heals:
        h = [r["heal_to_batch_s"] for r in heals]
        print(f"a restarted replica, end of its heal -> its first batch: {statistics.median(h) * 1e3:.0f} ms median "
              f"({min(h) * 1e3:.0f}-{max(h) * 1e3:.0f} ms, {len(h)} heals); its heal's transfer "
              f"{statistics.median(r['transfer_s'] for r in heals) * 1e3:.0f} ms, its process start -> first batch "
              f"{statistics.median(r['start_to_batch_s'] for r in heals):.2f} s")
    print(f"\n2 replicas, num_workers={args.workers}, batch {args.batch} per replica; load average "
          f"{os.getloadavg()[0]:.1f}; torch {_torch_version()}")


def _torch_version() -> str:
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"], capture_output=True,
                         text=True)
    return out.stdout.strip()


if __name__ == "__main__":
    scratch.run(main)
