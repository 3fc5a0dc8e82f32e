"""What a hot spare costs the training replicas' failure-free step (docs/guides/spares.md).

    .venv/bin/python scripts/bench_spares.py                   # 25M parameters, 3 runs each way
    .venv/bin/python scripts/bench_spares.py --sizes 1M,25M --runs 5
    .venv/bin/python scripts/bench_spares.py --training 1 --pin     # each on a core of its own

For each size, in turn (so that the machine's load hits both ways alike): `ftrun --nproc 3 --ft`
(3 training replicas) and `ftrun --nproc 4 --ft --spares 1` (the same 3 and a spare, fed each step
by rank 0: ft/heal/feed.py), `scripts/train_ft.py --optim adamw` on an MLP of that size. Per run,
the training replicas' median step (from their committed steps' times, the first 5 steps left
out) and the feeder's (rank 0) alone, and the time feeding took in the feeder's training thread
(its `feeding ... took X ms a step` lines). The ratio with/without, per pair and its median, is the
cost. On this machine the spare shares the training replicas' 2 cores (its optimizer step takes
CPU they would use); on GPUs it has its own device, and what remains is the feeder's sending.
`--pin` gives each its own: training replica r runs on CPU core r, the spare and the launcher on
the cores left (both runs alike), so what is left of the cost is the feeder's sending and what the
two share anyway (memory bandwidth); `--training N` sets the training replicas (N + 1 cores).
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
import threading
import time
from pathlib import Path

import scratch
from bench_heal import SIZES, params_of

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "scripts" / "train_ft.py"
SKIP = 5  # warm-up steps left out of the medians


def _nice_spares(home: Path, run_id: str, proc: subprocess.Popen, nice: int) -> None:
    """Every thread of every waiting spare's process at `nice` (threads start later too: again
    every 0.2 s), until the run ends."""
    state = home / run_id / "state.json"
    while proc.poll() is None:
        try:
            spares = [r["pid"] for r in json.loads(state.read_text())["replicas"] if r.get("spare") and r.get("pid")]
        except (OSError, ValueError, KeyError):
            spares = []
        for pid in spares:
            for task in Path(f"/proc/{pid}/task").glob("*"):
                try:
                    os.setpriority(os.PRIO_PROCESS, int(task.name), nice)
                except OSError:
                    pass
        time.sleep(0.2)


def _pin(home: Path, run_id: str, proc: subprocess.Popen, training: int) -> None:
    """Every thread of training replica r on core r, every other process of the run (the spare,
    the launcher) on the cores left (threads start later too: again every 0.2 s), until the run ends."""
    state, rest = home / run_id / "state.json", set(range(training, os.cpu_count() or 1))
    while proc.poll() is None:
        try:
            replicas = json.loads(state.read_text())["replicas"]
        except (OSError, ValueError, KeyError):
            replicas = []
        cores = {r["pid"]: ({r["rank"]} if r["rank"] < training else rest) for r in replicas if r.get("pid")}
        cores[proc.pid] = rest
        for pid, want in cores.items():
            for task in Path(f"/proc/{pid}/task").glob("*"):
                try:
                    os.sched_setaffinity(int(task.name), want)
                except OSError:
                    pass
        time.sleep(0.2)


def one_run(size: str, spares: int, steps: int, home: Path, nice: int = 0, training: int = 3,
            pin: bool = False) -> dict:
    dim, hidden, depth, batch, _kill_after, _steps = SIZES[size]
    out = Path(tempfile.mkdtemp(prefix=f"spares-{size}-"))
    run_id = f"spares-{size}-{spares}-{int(time.time() * 1000)}"
    cmd = [sys.executable, "-m", "ftrun", "--nproc", str(training + spares), "--ft", "--spares", str(spares),
           "--verbose", "--run-id", run_id, str(TRAIN), "--dim", str(dim), "--hidden", str(hidden), "--depth",
           str(depth), "--batch", str(batch), "--optim", "adamw", "--lr", "0.0005", "--data", "step", "--steps",
           str(steps), "--print-every", "100000", "--out", str(out / "p")]
    t0 = time.time()
    env = dict(os.environ, FTRUN_HOME=str(home))
    if pin:  # one thread per worker on its core, with or without a spare (alone, a worker gets torch's default)
        env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    if nice and spares:
        threading.Thread(target=_nice_spares, args=(home, run_id, proc, nice), daemon=True).start()
    if pin:
        threading.Thread(target=_pin, args=(home, run_id, proc, training), daemon=True).start()
    _, err = proc.communicate(timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"bench_spares: {size} spares={spares} failed ({proc.returncode}):\n{err[-3000:]}")
    gaps = {}
    for r in range(training):
        commits = json.loads((out / f"p.rank{r}.json").read_text())["commits"]
        times = [t for _, t in commits][SKIP:]
        gaps[r] = [b - a for a, b in zip(times, times[1:])]
    fed = "feeds hot spare" in err
    costs = [float(x) for x in re.findall(r"feeding \d+ hot spare\(s\) took ([\d.]+) ms a step", err)]
    return {"size": size, "spares": spares, "wall_s": time.time() - t0, "fed": fed,
            "feed_ms": statistics.median(costs) if costs else float("nan"),
            "step_s": statistics.median(g for r in gaps for g in gaps[r]),
            "feeder_step_s": statistics.median(gaps[0])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="25M")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--nice-spare", type=int, default=0,
                    help="run the waiting spare's threads at this nice value (19: only what the training "
                         "replicas leave idle), as a shared CPU host might")
    ap.add_argument("--training", type=int, default=3, help="training replicas (3)")
    ap.add_argument("--pin", action="store_true",
                    help="training replica r on CPU core r, the spare and the launcher on the cores left")
    args = ap.parse_args()
    if args.training < 1:
        raise SystemExit("bench_spares: --training must be at least 1")
    if args.pin and args.training >= (os.cpu_count() or 1):
        raise SystemExit(f"bench_spares: --pin needs a core beyond the {args.training} training replicas' "
                         f"({os.cpu_count()} here): lower --training")
    home = Path(tempfile.mkdtemp(prefix="bench-spares-home-"))
    print("| model | without a spare: step | with a fed spare: step | ratio (pairs) | feeder's step ratio | "
          "feeding, in the feeder's training thread | load |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for size in args.sizes.split(","):
        pairs = []
        for i in range(args.runs):
            a = one_run(size, 0, args.steps, home, training=args.training, pin=args.pin)
            b = one_run(size, 1, args.steps, home, args.nice_spare, args.training, args.pin)
            if not b["fed"]:
                raise SystemExit(f"bench_spares: the spare was never fed in run {i + 1} at {size}")
            pairs.append((a, b))
            print(f"{size} run {i + 1}: without {a['step_s']:.4f} s, with {b['step_s']:.4f} s "
                  f"({b['step_s'] / a['step_s']:.3f}x; feeder {b['feeder_step_s'] / a['feeder_step_s']:.3f}x)",
                  file=sys.stderr, flush=True)
        ratios = [b["step_s"] / a["step_s"] for a, b in pairs]
        feeder = [b["feeder_step_s"] / a["feeder_step_s"] for a, b in pairs]
        print(f"| {size} ({params_of(*SIZES[size][:3]) / 1e6:.1f}M) | "
              f"{statistics.median(a['step_s'] for a, _ in pairs):.3f} s | "
              f"{statistics.median(b['step_s'] for _, b in pairs):.3f} s | {statistics.median(ratios):.3f}x "
              f"({', '.join(f'{r:.2f}' for r in ratios)}) | {statistics.median(feeder):.3f}x | "
              f"{statistics.median(b['feed_ms'] for _, b in pairs):.1f} ms a step | {os.getloadavg()[0]:.1f} |",
              flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    scratch.run(main)
