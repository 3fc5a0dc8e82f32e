"""Failure-free cost of --ft: plain torch DDP and ftrun.ft on the same model, in the same workers.

    .venv/bin/python scripts/bench_ft_overhead.py              # tiny and 2.1M-parameter AdamW models, 3 runs each
    .venv/bin/python scripts/bench_ft_overhead.py --runs 1

Each run is `ftrun --nproc 3 --ft scripts/train_ft_vs_ddp.py`: every worker
builds the model three times: under torch's DDP on a gloo group of its own,
the same with torch's own Python allreduce comm hook (the cost of any hook
written in Python, against DDP's built-in one), and under ftrun.ft (DDP on
ftrun's epoch group, store-voted commit), and steps each once a step in a
random order, so all see the same machine at the same moments. A run's figure is the mean step
time over the three workers; the ratio is plain DDP's time over ftrun.ft's
(1.0 = --ft costs nothing), and the Python-hook DDP's over ftrun.ft's. Medians over
--runs runs are printed as a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS = {
    "tiny (0.26M params, the chaos model)": ["--dim", "256", "--hidden", "1024", "--steps", "600"],
    "2.1M params, AdamW (the issue's size)": ["--dim", "1024", "--hidden", "2048", "--depth", "1", "--optim", "adamw",
                                               "--steps", "200", "--warmup", "20"],
}


def one(args: list) -> dict:
    env = dict(os.environ, FTRUN_HOME=tempfile.mkdtemp(prefix="bench-ftov-"))
    out = subprocess.run([sys.executable, "-m", "ftrun", "--nproc", "3", "--ft",
                          str(ROOT / "scripts" / "train_ft_vs_ddp.py"), *args], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=900)
    rows = [json.loads(line.split("[result] ", 1)[1]) for line in (out.stdout + out.stderr).splitlines()
            if "[result] " in line]
    if out.returncode != 0 or len(rows) != 3:
        raise SystemExit(f"bench_ft_overhead: run failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    ddp = statistics.mean(r["ddp_mean_ms"] for r in rows)
    py = statistics.mean(r["pyhook_mean_ms"] for r in rows)
    ft = statistics.mean(r["ft_mean_ms"] for r in rows)
    return {"ddp_ms": ddp, "pyhook_ms": py, "ft_ms": ft, "ratio": ddp / ft, "py_ratio": py / ft}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    table = []
    for name, margs in MODELS.items():
        runs = [one(margs) for _ in range(args.runs)]
        for r in runs:
            print(f"{name}: {json.dumps({k: round(v, 3) for k, v in r.items()})}", flush=True)
        table.append((name, {k: statistics.median(r[k] for r in runs) for k in runs[0]},
                      min(r["ratio"] for r in runs), max(r["ratio"] for r in runs)))
    print("\n| model | plain DDP step | DDP + Python hook step | ftrun --ft step | DDP / --ft (median) | min - max "
          "| Python-hook DDP / --ft (median) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, m, lo, hi in table:
        print(f"| {name} | {m['ddp_ms']:.2f} ms | {m['pyhook_ms']:.2f} ms | {m['ft_ms']:.2f} ms | {m['ratio']:.3f} "
              f"| {lo:.3f} - {hi:.3f} | {m['py_ratio']:.3f} |")
    print(f"\n{args.runs} runs each, 3 workers, gloo on CPU; load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
