"""Sharded replicas benchmark: `ftrun --ft --replica-size 2` against plain torch HSDP, and its heals.

    .venv/bin/python scripts/bench_fsdp_ft.py                    # the table of docs/benchmarks/sharded.md (about 10 minutes)
    .venv/bin/python scripts/bench_fsdp_ft.py --repeats 1 --heal-sizes 10M   # quicker
    .venv/bin/python scripts/bench_fsdp_ft.py --throughput-size none --heal-sizes 10M --spares both

Always 2 replicas x 2 workers (4 processes), gloo on CPU, scripts/train_fsdp_ft.py
(MLP blocks, AdamW; state = 12 bytes a parameter).

- throughput: failure-free committed steps per second of the same script,
  `ftrun --ft --replica-size 2` against plain torch HSDP (`fully_shard` on a
  2 x 2 replicate x shard mesh, the script's --hsdp-reference mode, started by
  torchrun), run in turn (A B A B ...), steps/s from the script's own commit
  times after a warm-up; the ratio is taken pair by pair, median quoted.
- heal: rank 1 (of replica 0) SIGKILLed after a few steps; ftrun kills rank 0
  too and restarts replica 0, whose two workers each receive their shard from
  the same shard of replica 1, in parallel. "back" is from the kill to the
  restarted replica's first committed step (both workers' `[announce]`
  lines); "transfer" the slower of the two shard transfers, as the healers
  report it in their logs; the floor is, in the same session, a plain gloo
  broadcast of the same bytes per shard, both shards' pairs at once
  (4 processes), median of 3.
- with `--spares 1` the heal runs have a third replica of 2 workers waiting as a hot spare
  (`--nproc 6 --spares 1`, docs/guides/spares.md): it takes replica 0's place, and "back" is
  from the kill to the spare's first committed step; `--spares both` runs each size both ways.
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

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "scripts" / "train_fsdp_ft.py"
sys.path.insert(0, str(ROOT / "scripts"))
from bench_heal import floor_seconds, kill_when_running  # noqa: E402  (the same floor: a pair per shard)
import scratch  # noqa: E402

# name -> (dim, hidden, blocks, batch, steps before the kill, steps in all)
SIZES = {
    "10M": (1024, 2560, 2, 16, 6, 16),
    "20M": (1024, 5120, 2, 16, 6, 16),
    "100M": (2048, 12288, 2, 8, 3, 7),
}



def params_of(dim: int, hidden: int, blocks: int) -> int:
    return blocks * (2 * dim + dim * hidden + hidden + hidden * dim + dim) + dim + 1


def _args(size: str, steps: int) -> list:
    dim, hidden, blocks, batch, _, _ = SIZES[size]
    return ["--dim", str(dim), "--hidden", str(hidden), "--blocks", str(blocks), "--batch", str(batch),
            "--steps", str(steps), "--print-every", "100000"]


def _run(cmd: list, env: dict, timeout: float = 1200) -> str:
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)
    if p.returncode != 0:
        raise SystemExit(f"bench_fsdp_ft: {' '.join(cmd[:8])}... exited {p.returncode}:\n{p.stderr[-3000:]}")
    return p.stdout + p.stderr


def steps_per_s(out: Path, warmup: int) -> float:
    commits = json.loads(Path(f"{out}.rank0.json").read_text())["commits"][warmup:]
    return (len(commits) - 1) / (commits[-1][1] - commits[0][1])


def throughput(size: str, steps: int, warmup: int, home: Path) -> tuple:
    env = dict(os.environ, FTRUN_HOME=str(home))
    d = Path(tempfile.mkdtemp(prefix="bench-fsdp-"))
    _run([sys.executable, "-m", "ftrun", "--nproc", "4", "--ft", "--replica-size", "2", str(TRAIN),
          *_args(size, steps), "--out", str(d / "ft")], env)
    ours = steps_per_s(d / "ft", warmup)
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", str(TRAIN),
          *_args(size, steps), "--hsdp-reference", "2", "--out", str(d / "hsdp")], env)
    return ours, steps_per_s(d / "hsdp", warmup)


def heal(size: str, home: Path, spares: int = 0) -> dict:
    _, _, _, _, kill_after, steps = SIZES[size]
    out = Path(tempfile.mkdtemp(prefix=f"bench-fsdp-heal-{size}-"))
    run_id = f"fsdp-heal-{size}-{int(time.time() * 1000)}"
    env = dict(os.environ, FTRUN_HOME=str(home))
    back_ranks = (4, 5) if spares else (0, 1)  # the replica that takes replica 0's place
    cmd = [sys.executable, "-m", "ftrun", "--nproc", str(4 + 2 * spares), "--ft", "--replica-size", "2",
           "--spares", str(spares), "--run-id", run_id,
           str(TRAIN), *_args(size, steps), "--announce", "--out", str(out / "p")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    deadline = time.time() + 1200
    killed_at = kill_when_running(home / run_id / "state.json", 1, kill_after, proc, deadline)
    text = proc.communicate(timeout=max(1.0, deadline - time.time()))[0]
    if proc.returncode != 0 or killed_at is None:
        raise SystemExit(f"bench_fsdp_ft: heal run {size} failed (exit {proc.returncode}):\n{text[-3000:]}")
    back = [float(t) for r, t in re.findall(r"\[announce\] rank (\d+) pid \d+ first step \d+ t ([\d.]+)", text)
            if float(t) > killed_at and int(r) in back_ranks]
    transfers = []
    for r in back_ranks:
        log = (home / run_id / "logs" / f"rank{r}" / "stderr.log").read_text()
        found = re.findall(r"received ([\d.]+) MB of state from rank \d+ in ([\d.]+) s", log)
        transfers.append(tuple(float(x) for x in found[-1]))
    mb = max(m for m, _ in transfers)
    return {"size": size + (" + spare" if spares else ""), "params": params_of(*SIZES[size][:3]), "shard_mb": mb,
            "back_s": max(back) - killed_at,
            "transfer_s": max(s for _, s in transfers)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--throughput-size", default="20M")
    ap.add_argument("--heal-sizes", default="10M,20M,100M")
    ap.add_argument("--spares", default="0", choices=("0", "1", "both"),
                    help="heal runs with a spare replica of 2 workers (1), or each size both ways")
    args = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="bench-fsdp-home-"))
    size = args.throughput_size
    pairs = []
    for i in range(args.repeats if size != "none" else 0):
        ours, ref = throughput(size, 24, 4, home)
        pairs.append((ours, ref))
        print(f"throughput {size} run {i + 1}: ft {ours:.2f} steps/s, plain HSDP {ref:.2f} steps/s, "
              f"ratio {ours / ref:.3f}", flush=True)
    heals = []
    ways = [0, 1] if args.spares == "both" else [int(args.spares)]
    for s, spares in [(s, n) for s in args.heal_sizes.split(",") for n in ways]:
        runs = [heal(s, home, spares) for _ in range(args.repeats)]
        for r in runs:
            print(f"heal {s}: {json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()})}",
                  flush=True)
        med = {k: statistics.median(r[k] for r in runs) for k in ("shard_mb", "back_s", "transfer_s", "params")}
        med["size"] = runs[0]["size"]
        med["floor_s"] = floor_seconds(int(med["shard_mb"] * 1e6), pairs=2)
        heals.append(med)
    print()
    print("| measure | ftrun --ft --replica-size 2 | reference | ratio | target |")
    print("|---|---:|---:|---:|---|")
    if pairs:
        ours = statistics.median(p[0] for p in pairs)
        ref = statistics.median(p[1] for p in pairs)
        ratio = statistics.median(p[0] / p[1] for p in pairs)
        print(f"| failure-free steps/s, {params_of(*SIZES[size][:3]) / 1e6:.0f}M params | {ours:.2f} | "
              f"{ref:.2f} (plain torch HSDP) | {ratio:.2f} | >= 0.90 |")
    for m in heals:
        p = f"{m['params'] / 1e6:.0f}M params" + (", a spare" if "spare" in m["size"] else "")
        print(f"| heal transfer, {p} ({m['shard_mb']:.0f} MB per shard, 2 shards at once) | {m['transfer_s']:.2f} s | "
              f"{m['floor_s']:.2f} s (plain broadcast) | {m['transfer_s'] / m['floor_s']:.2f} | "
              f"{'<= 2 at 100M' if m['size'] == '100M' else '-'} |")
        print(f"| kill -> replica's first step again, {p} | {m['back_s']:.2f} s | - | - | "
              f"{'<= 5 s at 20M' if m['size'] == '20M' else '-'} |")
    print(f"\nmedians of {args.repeats} run(s); 2 replicas x 2 workers, AdamW, gloo on CPU, {os.cpu_count()} cores; "
          f"load average {os.getloadavg()[0]:.1f}; torch {__import__('torch').__version__}")


if __name__ == "__main__":
    scratch.run(main)
