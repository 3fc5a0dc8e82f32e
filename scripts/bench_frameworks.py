"""Frameworks benchmark (issues 44 and 45): a Lightning script and a Hugging Face Trainer script,
unmodified, under `ftrun --ft` against the same script under plain ftrun (DDP), and what a
SIGKILLed replica costs them against an ftrun.ft script of the same size.

    .venv/bin/python scripts/bench_frameworks.py                     # the sizes of the issues
    .venv/bin/python scripts/bench_frameworks.py --params 2M --runs 1  # quicker, on a loaded box

Measured, with 2 replicas (`--nproc 2`) on CPU (gloo):
- failure-free: steps/s of the steady part of each run (the steps after the first WARM, from the
  workers' own clocks at each step's end), `--ft` against plain ftrun, the runs alternating; the
  ratio is of the medians.
- kill -> first step: replica 1 SIGKILLed once the run has committed KILL_AT steps; the time
  from the kill to its restarted process's first step (the worker prints it), median over runs;
  each step of a kill run sleeps --step-sleep s more, so that the run outlasts the restart.
  Lightning: an MLP of --params parameters with AdamW (`Trainer(strategy="ddp")`); the Trainer:
  a GPT-2 built from a config of about --params parameters (AdamW, the Trainer's default);
  ftrun.ft: scripts/train_ft.py with the same MLP and AdamW (the issue's yardstick).
A markdown table is printed at the end (docs/benchmarks/frameworks.md keeps one). The workers are
scripts/bench_frameworks_lightning.py and scripts/bench_frameworks_hf.py (one framework a file:
ftrun's zygote imports the framework a script's file imports, before its first fork).
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
import threading
from pathlib import Path

from bench_frameworks_lightning import mlp_dims
from bench_heal import kill_when_running  # the same kill: by the state file, once running at a step

ROOT = Path(__file__).resolve().parent.parent
WORKERS = {"lightning": ROOT / "scripts" / "bench_frameworks_lightning.py",
           "hf": ROOT / "scripts" / "bench_frameworks_hf.py"}
FTRUN = [sys.executable, "-m", "ftrun"]
TRAIN_FT = ROOT / "scripts" / "train_ft.py"
WARM = 5


def parse_size(text: str) -> int:
    return int(float(text[:-1]) * 1e6) if text.upper().endswith("M") else int(text)


# ------------------------------------------------------------------ the measurements
def steps_per_s(out: str) -> float:
    times = json.loads(Path(f"{out}.rank0.json").read_text())["times"][WARM:]
    return (len(times) - 1) / (times[-1] - times[0])


def failure_free(worker: str, ft: bool, args: argparse.Namespace, tmp: Path, i: int) -> float:
    out = str(tmp / f"{worker}-{'ft' if ft else 'plain'}-{i}")
    cmd = [*FTRUN, "--nproc", "2", *(["--ft"] if ft else []), WORKERS[worker], "--out", out,
           "--params", str(args.params), "--steps", str(args.steps), "--batch", str(args.batch)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return steps_per_s(out)


def kill_to_first_step(worker: str, args: argparse.Namespace, tmp: Path, i: int) -> float:
    home, run_id = tmp / "home", f"{worker}-kill-{i}"
    out = str(tmp / run_id)
    if worker == "ft":
        dim, hidden, depth = mlp_dims(args.params)
        script = [str(TRAIN_FT), "--dim", str(dim), "--hidden", str(hidden), "--depth", str(depth), "--optim",
                  "adamw", "--lr", "0.0001", "--batch", str(args.batch), "--steps", str(args.kill_steps),
                  "--print-every", "1000", "--announce", "--step-sleep", str(args.step_sleep)]
    else:
        script = [str(WORKERS[worker]), "--out", out, "--params", str(args.params), "--steps",
                  str(args.kill_steps), "--batch", str(args.batch), "--step-sleep", str(args.step_sleep)]
    env = {**os.environ, "FTRUN_HOME": str(home)}
    proc = subprocess.Popen([*FTRUN, "--nproc", "2", "--ft", "--run-id", run_id, *script], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    killed_at = kill_when_running(home / run_id / "state.json", 1, args.kill_at, proc, time.time() + 900)
    proc.wait(1800)
    reader.join(10)
    text = "".join(lines)
    back = [float(m.group(1)) for m in re.finditer(r"\[announce\] rank 1 pid \d+ first step \d+ t ([\d.]+)", text)]
    back = [t for t in back if killed_at is not None and t > killed_at]
    if proc.returncode != 0 or not back:
        raise SystemExit(f"{worker}: the kill run failed or the replica never came back:\n{text[-3000:]}")
    return back[0] - killed_at


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", type=parse_size, default=parse_size("25M"), help="model size (default 25M)")
    p.add_argument("--steps", type=int, default=40, help="steps of a failure-free run")
    p.add_argument("--batch", type=int, default=8, help="samples per worker and step")
    p.add_argument("--runs", type=int, default=3, help="runs of each measurement")
    p.add_argument("--kill-at", type=int, default=8, help="steps committed before the kill")
    p.add_argument("--kill-steps", type=int, default=60, help="steps of a kill run")
    p.add_argument("--step-sleep", type=float, default=0.3,
                   help="seconds each step of a kill run sleeps (the run outlasts the restart)")
    p.add_argument("--only", default="lightning,hf", help="which frameworks (lightning,hf)")
    p.add_argument("--no-kill", action="store_true", help="the failure-free runs only")
    args = p.parse_args()

    frameworks = [f for f in args.only.split(",") if f]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-frameworks-") as d:
        tmp = Path(d)
        kills = 0 if args.no_kill else args.runs
        backs = {"ft": [kill_to_first_step("ft", args, tmp, i) for i in range(kills)]}
        for fw in frameworks:
            plain, ft = [], []
            for i in range(args.runs):
                plain.append(failure_free(fw, False, args, tmp, i))
                ft.append(failure_free(fw, True, args, tmp, i))
            backs[fw] = [kill_to_first_step(fw, args, tmp, i) for i in range(kills)]
            rows.append((fw, statistics.median(plain), statistics.median(ft), backs[fw]))
            print(f"{fw}: plain {plain} steps/s, --ft {ft} steps/s, kill -> first step {backs[fw]} s", flush=True)
        print(f"ftrun.ft: kill -> first step {backs['ft']} s", flush=True)
    base = statistics.median(backs["ft"]) if backs["ft"] else float("nan")
    load = os.getloadavg()[0]
    print(f"\n{args.params / 1e6:.1f}M parameters, AdamW, 2 replicas on CPU, {args.runs} runs each, "
          f"load {load:.1f} at the end\n")
    print("| script | plain ftrun steps/s | --ft steps/s | --ft / plain | kill -> first step (s) | "
          "against ftrun.ft's |")
    print("|---|---|---|---|---|---|")
    names = {"lightning": "Lightning (`Trainer(strategy=\"ddp\")`, MLP)", "hf": "HF Trainer (GPT-2 from a config)"}
    for fw, plain, ft, back in rows:
        if not back:
            print(f"| {names[fw]} | {plain:.2f} | {ft:.2f} | {ft / plain:.3f} | | |")
            continue
        med = statistics.median(back)
        print(f"| {names[fw]} | {plain:.2f} | {ft:.2f} | {ft / plain:.3f} | {med:.2f} "
              f"({min(back):.2f}-{max(back):.2f}) | {med / base:.2f}x |")
    if backs["ft"]:
        print(f"| ftrun.ft (`scripts/train_ft.py`, MLP) | | | | {base:.2f} ({min(backs['ft']):.2f}-"
              f"{max(backs['ft']):.2f}) | 1x |")


if __name__ == "__main__":
    main()
