"""Frameworks benchmark (issues 44 and 45): a Lightning script and a Hugging Face Trainer script,
unmodified, under `ftrun --ft` against the same script under plain ftrun (DDP), and what a
SIGKILLed replica costs them against an ftrun.ft script of the same size.

    .venv/bin/python scripts/bench_frameworks.py                     # the sizes of the issues
    .venv/bin/python scripts/bench_frameworks.py --params 2M --runs 1  # quicker, on a loaded box

Measured, with 2 replicas (`--nproc 2`) on CPU (gloo):
- failure-free: steps/s of the steady part of each run (the steps after the first WARM, from the
  workers' own clocks at each step's end), `--ft` against plain ftrun, the runs alternating; the
  ratio is of the medians, with each pair's ratio's range. Beside it the CPU seconds a worker
  spends a step (process_time over the same steps), which the machine's other load moves less.
- kill -> first step: replica 1 SIGKILLed once the run has committed KILL_AT steps; the time
  from the kill to its restarted process's first step (the worker prints it), median over runs,
  the kill runs alternating between the scripts; each step of a kill run sleeps --step-sleep s
  more (after the first step's line), so that the run outlasts the restart. Where the time goes:
  bench_heal.py's phases, from the dated lines of --verbose (the exit seen; the new process's
  start and the script's set-up to the quorum that lists it; the groups formed; the state
  transfer and the MB it moved; the first step with its layout round).
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
from typing import Tuple

from bench_frameworks_lightning import mlp_dims
# The same kill (by the state file, once running at a step) and the same phases of a heal.
from bench_heal import kill_when_running, phases_of

ROOT = Path(__file__).resolve().parent.parent
WORKERS = {"lightning": ROOT / "scripts" / "bench_frameworks_lightning.py",
           "hf": ROOT / "scripts" / "bench_frameworks_hf.py"}
FTRUN = [sys.executable, "-m", "ftrun"]
TRAIN_FT = ROOT / "scripts" / "train_ft.py"
WARM = 5


def parse_size(text: str) -> int:
    return int(float(text[:-1]) * 1e6) if text.upper().endswith("M") else int(text)


# ------------------------------------------------------------------ the measurements
def steps_per_s(out: str) -> Tuple[float, float]:
    """(rank 0's steps/s, the workers' mean CPU seconds a step) over the steps after the first WARM."""
    speed, cpu = 0.0, []
    for rank in (0, 1):
        clocks = json.loads(Path(f"{out}.rank{rank}.json").read_text())["times"][WARM:]
        (wall0, cpu0), (wall1, cpu1) = clocks[0], clocks[-1]
        speed = speed or (len(clocks) - 1) / (wall1 - wall0)
        cpu.append((cpu1 - cpu0) / (len(clocks) - 1))
    return speed, statistics.mean(cpu)


def failure_free(worker: str, ft: bool, args: argparse.Namespace, tmp: Path, i: int) -> Tuple[float, float]:
    out = str(tmp / f"{worker}-{'ft' if ft else 'plain'}-{i}")
    cmd = [*FTRUN, "--nproc", "2", *(["--ft"] if ft else []), WORKERS[worker], "--out", out,
           "--params", str(args.params), "--steps", str(args.steps), "--batch", str(args.batch)]
    LOADS.append(os.getloadavg()[0])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    LOADS.append(os.getloadavg()[0])
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return steps_per_s(out)


def kill_to_first_step(worker: str, args: argparse.Namespace, tmp: Path, i: int) -> dict:
    """One kill run: kill -> the restarted replica's first step ("back"), and its phases
    (bench_heal.py's, from the dated console lines of --verbose): the exit seen, the new
    process's start and the script's set-up to the quorum that lists it, the groups formed, the
    state transfer (MB, s) and the first step (its layout round and batch)."""
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
    LOADS.append(os.getloadavg()[0])
    proc = subprocess.Popen([*FTRUN, "--nproc", "2", "--ft", "--verbose", "--run-id", run_id, *script], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []  # (arrival time, line): the phases are dated by them

    def read() -> None:
        for line in iter(proc.stdout.readline, ""):
            seen.append((time.time(), line))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    killed_at = kill_when_running(home / run_id / "state.json", 1, args.kill_at, proc, time.time() + 900)
    proc.wait(1800)
    reader.join(10)
    LOADS.append(os.getloadavg()[0])
    text = "".join(line for _, line in seen)
    back = [float(m.group(1)) for m in re.finditer(r"\[announce\] rank 1 pid \d+ first step \d+ t ([\d.]+)", text)]
    back = [t for t in back if killed_at is not None and t > killed_at]
    heal = re.findall(r"\[rank 1\] ftrun\.ft: detail: rank 1: received ([\d.]+) MB of state from rank \d+ in "
                      r"([\d.]+) s", text)
    if proc.returncode != 0 or not back or not heal:
        raise SystemExit(f"{worker}: the kill run failed or the replica never came back:\n{text[-3000:]}")
    mb, secs = (float(x) for x in heal[-1])
    return {"back_s": back[0] - killed_at, "state_mb": mb,
            **phases_of(seen, killed_at, back[0], 1, 0, secs)}


LOADS: list = []  # the load average before and after each run


def spread(values: list) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


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
    p.add_argument("--no-failure-free", action="store_true", help="the kill runs only")
    args = p.parse_args()

    frameworks = [f for f in args.only.split(",") if f]
    names = {"lightning": "Lightning (`Trainer(strategy=\"ddp\")`, MLP)", "hf": "HF Trainer (GPT-2 from a config)",
             "ft": "ftrun.ft (`scripts/train_ft.py`, MLP)"}
    speeds, backs = {}, {}
    with tempfile.TemporaryDirectory(prefix="bench-frameworks-") as d:
        tmp = Path(d)
        kills = 0 if args.no_kill else args.runs
        for fw in frameworks:
            if not args.no_failure_free:
                plain, ft = [], []
                for i in range(args.runs):  # alternating, so that the machine's load hits both alike
                    plain.append(failure_free(fw, False, args, tmp, i))
                    ft.append(failure_free(fw, True, args, tmp, i))
                    print(f"{fw} run {i + 1}: plain {plain[-1][0]:.3f} steps/s {plain[-1][1]:.3f} CPU-s/step, "
                          f"--ft {ft[-1][0]:.3f} steps/s {ft[-1][1]:.3f} CPU-s/step", flush=True)
                speeds[fw] = (plain, ft)
        for i in range(kills):  # alternating too
            for who in ["ft"] + frameworks:
                backs.setdefault(who, []).append(kill_to_first_step(who, args, tmp, i))
                print(f"{who} kill {i + 1}: {json.dumps(backs[who][-1])}", flush=True)
    print(f"\n{args.params / 1e6:.1f}M parameters, AdamW, 2 replicas on CPU, {args.runs} runs each, load average "
          f"{min(LOADS):.1f}-{max(LOADS):.1f} at the runs' starts and ends\n")
    if speeds:
        print("| script | plain ftrun steps/s | --ft steps/s | --ft / plain (medians) | --ft / plain, run by run | "
              "CPU-s a step, plain | CPU-s a step, --ft | plain / --ft CPU (medians) |")
        print("|---|---|---|---|---|---|---|---|")
        for fw, (plain, ft) in speeds.items():
            pairs = [f[0] / q[0] for q, f in zip(plain, ft)]
            cpu_plain, cpu_ft = [q[1] for q in plain], [f[1] for f in ft]
            print(f"| {names[fw]} | {spread([q[0] for q in plain])} | {spread([f[0] for f in ft])} | "
                  f"{statistics.median(f[0] for f in ft) / statistics.median(q[0] for q in plain):.3f} | "
                  f"{min(pairs):.3f}-{max(pairs):.3f} | {spread(cpu_plain)} | {spread(cpu_ft)} | "
                  f"{statistics.median(cpu_plain) / statistics.median(cpu_ft):.3f} |")
    if backs:
        base = statistics.median(r["back_s"] for r in backs["ft"])
        print("\n| script | kill -> first step (s) | against ftrun.ft's | exit seen | start-up and set-up to the "
              "quorum | groups formed | state transfer | first step | state moved |")
        print("|---|---|---|---|---|---|---|---|---|")
        for who, runs in backs.items():
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            print(f"| {names[who]} | {spread([r['back_s'] for r in runs])} | {med['back_s'] / base:.2f}x | "
                  f"{med['detect_s']:.2f} | {med['restart_s'] + med['decide_s']:.2f} | {med['groups_s']:.2f} | "
                  f"{med['transfer_phase_s']:.2f} | {med['first_batch_s']:.2f} | {med['state_mb']:.1f} MB |")
        print("\n(medians of the runs; each phase's median apart, so they need not add up to the first column's)")


if __name__ == "__main__":
    main()
