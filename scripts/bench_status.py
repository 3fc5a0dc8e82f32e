"""Benchmark: wall time of `ftrun status --json` (and the table view) with no run and with an
8-worker run alive, medians of several calls; prints a markdown table.

Starts a real `ftrun --nproc 8` run of a small training loop in a private FTRUN_HOME,
waits until every worker is stepping, times the status commands as a user would
run them (a fresh process each), then stops the run. Never touches the user's
own runs (FTRUN_HOME is a temporary folder).

    .venv/bin/python scripts/bench_status.py [--repeat 15] [--nproc 8] [--step-sleep 0.05]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Tuple
import scratch

LOOP = """\
import os, sys, time
import torch
stop, pause = sys.argv[1], float(sys.argv[2])
model = torch.nn.Linear(64, 64)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
while not os.path.exists(stop):
    opt.zero_grad()
    model(torch.ones(8, 64)).sum().backward()
    opt.step()
    time.sleep(pause)
"""


def time_command(argv: List[str], env: Dict[str, str], repeat: int) -> Tuple[List[float], List[float]]:
    """Wall and CPU (user + system) seconds of each call; CPU time hardly depends on other load."""
    walls, cpus = [], []
    for _ in range(repeat):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        r = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        walls.append(time.perf_counter() - t0)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append((after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime))
        if r.returncode != 0:
            raise SystemExit(f"{' '.join(argv)} exited {r.returncode}: {r.stderr}")
    return walls, cpus


def measure(label: str, env: Dict[str, str], repeat: int, rows: List[List[str]]) -> None:
    ftrun = [sys.executable, "-m", "ftrun"]
    # The same view entered without building the typer CLI (ftrun.status.command.fast_status),
    # as ftrun.cli.main does when it routes `status` there.
    fast = [sys.executable, "-c",
            "import sys; from ftrun.status.command import fast_status; sys.exit(fast_status(sys.argv[1:]))"]
    for what, argv in (("status --json", ftrun + ["status", "--json"]), ("status", ftrun + ["status"]),
                       ("status --json` (fast_status, no typer)", fast + ["--json"]),
                       ("status` (fast_status, no typer)", fast)):
        ts, cpu = time_command(argv, dict(env, COLUMNS="160"), repeat)
        shown = f"`ftrun {what}" + ("" if what.endswith(")") else "`")
        rows.append([label, shown, f"{statistics.median(ts) * 1000:.0f}",
                     f"{min(ts) * 1000:.0f}", f"{max(ts) * 1000:.0f}", f"{statistics.median(cpu) * 1000:.0f}",
                     str(repeat)])
        print(f"  {label:28s} ftrun {what:15s} median {statistics.median(ts) * 1000:6.0f} ms wall, "
              f"{statistics.median(cpu) * 1000:6.0f} ms CPU", file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--nproc", type=int, default=8)
    ap.add_argument("--step-sleep", type=float, default=0.05, help="pause per training step in the workers")
    args = ap.parse_args()

    rows: List[List[str]] = []
    with tempfile.TemporaryDirectory(prefix="ftrun-bench-") as tmp:
        tmp_path = Path(tmp)
        env = dict(os.environ, FTRUN_HOME=str(tmp_path / "home"))
        measure("no run", env, args.repeat, rows)

        script = tmp_path / "loop.py"
        script.write_text(LOOP)
        stop = tmp_path / "stop"
        sup = subprocess.Popen([sys.executable, "-m", "ftrun", "--nproc", str(args.nproc), "--quiet",
                                "--run-id", "bench-status", str(script), str(stop), str(args.step_sleep)],
                               env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp)
        try:
            t0 = time.time()
            while True:
                if sup.poll() is not None:
                    raise SystemExit(f"the {args.nproc}-worker run ended early (exit {sup.returncode})")
                out = subprocess.run([sys.executable, "-m", "ftrun", "status", "--json"], env=env,
                                     capture_output=True, text=True).stdout
                runs = json.loads(out or "[]")
                if runs and all(r["state"] == "running" and r["step"] > 0 for r in runs[0]["replicas"]):
                    break
                if time.time() - t0 > 300:
                    raise SystemExit("workers did not start stepping within 300 s")
                time.sleep(0.5)
            print(f"  {args.nproc} workers stepping after {time.time() - t0:.1f} s", file=sys.stderr)
            measure(f"{args.nproc}-worker run alive", env, args.repeat, rows)
            sample = subprocess.run([sys.executable, "-m", "ftrun", "status"], env=dict(env, COLUMNS="130"),
                                    capture_output=True, text=True).stdout
        finally:
            stop.write_text("")
            try:
                sup.wait(timeout=60)
            except subprocess.TimeoutExpired:
                sup.kill()
                sup.wait()

    print(f"Machine: {os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f} at the end, Python {sys.version.split()[0]}; wall time of a fresh "
          f"`ftrun` process per call (includes interpreter start), {args.repeat} calls each; "
          f"CPU = user + system time of that process.\n")
    print("| situation | command | median wall ms | min wall ms | max wall ms | median CPU ms | calls |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print("\nSample `ftrun status` output with the run alive:\n")
    print("```\n" + sample.rstrip() + "\n```")


if __name__ == "__main__":
    scratch.run(main)
