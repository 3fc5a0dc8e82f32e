"""What scripts/bench_frameworks.py's two workers (bench_frameworks_lightning.py and
bench_frameworks_hf.py) share: their arguments, the line that dates a process's first step, and the
step times they write. Imported from the workers' own folder; never imports torch or ftrun."""

import argparse
import json
import os
import time


def announce(step: int) -> None:
    """The worker's first step in this process, on the wall clock (the bench reads it)."""
    if not getattr(announce, "done", False):
        announce.done = True
        print(f"[announce] rank {os.environ.get('RANK')} pid {os.getpid()} first step {step} t {time.time():.6f}",
              flush=True)


def clocks() -> list:
    """A step's end: [the wall clock, this process's CPU seconds] (process_time: the CPU a step
    costs, which the machine's other load disturbs less than the wall time)."""
    return [time.perf_counter(), time.process_time()]


def report(out: str, times: list) -> None:
    with open(f"{out}.rank{os.environ.get('RANK', '0')}.json", "w") as f:
        json.dump({"times": times}, f)


def arguments() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--params", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--step-sleep", type=float, default=0.0, help="pretend each step does more work")
    return p.parse_args()
