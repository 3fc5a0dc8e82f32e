"""Heal benchmark: what a SIGKILLed replica costs under `ftrun --ft`, by model size.

    .venv/bin/python scripts/bench_heal.py                       # 1M, 10M, 100M parameters, 3 runs each
    .venv/bin/python scripts/bench_heal.py --sizes 1M,10M --runs 1   # quicker
    .venv/bin/python scripts/bench_heal.py --sizes 25M --spares both  # with a hot spare against without

For each size: `ftrun --nproc 3 --ft scripts/train_ft.py --optim adamw` (an MLP
of that many parameters; state = parameters + two AdamW moments = 12 bytes a
parameter), rank 1 SIGKILLed once the run has committed a few steps; ftrun
restarts it and it receives the state from a peer over a process group.
Measured per run:

- back: from the kill to the restarted replica's first committed step (the
  worker prints `[announce] ... t TIME` on its first committed step).
- transfer: the transfer's own time and bandwidth, as the healer reports it.
- survivors' longest step: the longest gap between two committed steps of
  the surviving replicas while the healer was away (kill -> back), against
  their median step.
- supervisor RSS: the ftrun process's peak resident memory (psutil, every
  20 ms), against its RSS before the first kill.
- floor: in the same session, one plain `broadcast` of the same number of
  bytes between two processes over gloo (a fresh receive buffer each time,
  as the healer's optimizer state is fresh), median of 3.

With `--spares 1` the run is `--nproc 4 --ft --spares 1` (3 training replicas and replica 3
waiting as a warm spare, docs/guides/spares.md): the spare takes rank 1's place, and "back" is
from the kill to the spare's first committed step. `--spares both` runs each size both ways.

Medians over --runs runs; a markdown table is printed at the end.
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
import threading
import time
from pathlib import Path

import psutil
import scratch

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "scripts" / "train_ft.py"

# name -> (dim, hidden, depth, batch, steps before the kill, steps in all)
SIZES = {
    "1M": (1024, 1000, 1, 96, 20, 60),
    "10M": (1024, 2048, 3, 96, 10, 35),
    "25M": (1024, 2700, 4, 24, 6, 25),
    "100M": (1024, 4096, 7, 12, 3, 12),
}

# One plain gloo broadcast of NBYTES per pair of processes, PAIRS pairs at once (sharded
# replicas heal every shard at once); prints the receiver's median of 3.
FLOOR = r"""
import datetime, sys, time, torch, torch.distributed as dist
rank, port, nbytes, pairs = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
pair, me = divmod(rank, 2)
store = dist.PrefixStore(f"pair{pair}/", dist.TCPStore("127.0.0.1", port, 2 * pairs, rank == 0,
                                                       datetime.timedelta(seconds=60)))
pg = dist.ProcessGroupGloo(store, me, 2, datetime.timedelta(seconds=600))
src = torch.ones(nbytes, dtype=torch.uint8) if me == 0 else None
pg.broadcast(torch.zeros(1), 0).wait()
times = []
for _ in range(3):
    t = src if me == 0 else torch.empty(nbytes, dtype=torch.uint8)
    pg.barrier().wait()
    t0 = time.perf_counter()
    pg.broadcast(t, 0).wait()
    times.append(time.perf_counter() - t0)
    del t
if me == 1:
    print(sorted(times)[1])
"""


def params_of(dim: int, hidden: int, depth: int) -> int:
    return dim * hidden + hidden + (depth - 1) * (hidden * hidden + hidden) + hidden + 1


def floor_seconds(nbytes: int, pairs: int = 1) -> float:
    """The slowest pair's broadcast of `nbytes`, `pairs` pairs at once."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, "-c", FLOOR, str(r), str(port), str(nbytes), str(pairs)],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for r in range(2 * pairs)]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    return max(float(o) for o in outs if o.strip())


class RssWatch(threading.Thread):
    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.proc = psutil.Process(pid)
        self.peak = 0
        self.samples = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                rss = self.proc.memory_info().rss
            except psutil.Error:
                return
            self.peak = max(self.peak, rss)
            self.samples.append((time.time(), rss))
            self.stop.wait(0.02)

    def before(self, t: float) -> int:
        return max((r for when, r in self.samples if when < t), default=0)


def kill_when_running(state: Path, rank: int, min_step: int, proc: subprocess.Popen, deadline: float,
                      into: float = 0.0):
    """SIGKILL `rank` once `ftrun status`'s state file shows it running at `min_step` or later (as it
    takes that step: its optimizer step is then in flight), or `into` of a step later (the step's
    length from the state file's last step change: 0.6 lands in a forward or backward); the time of
    the kill, or None if the run ended or the deadline passed first."""
    changes = []  # (time, step) each time the rank's step changed
    while time.time() < deadline and proc.poll() is None:
        try:
            st = json.loads(state.read_text())
        except (OSError, ValueError):
            time.sleep(0.02)
            continue
        r = next(r for r in st["replicas"] if r["rank"] == rank)
        if not changes or changes[-1][1] != r["step"]:
            changes.append((time.time(), r["step"]))
        if r["step"] >= min_step and r["state"] == "running" and r.get("pid"):
            if into and len(changes) >= 3:  # two whole steps seen: wait into the next one
                step_s = changes[-1][0] - changes[-2][0]
                time.sleep(into * step_s)
            os.kill(r["pid"], signal.SIGKILL)
            return time.time()
        time.sleep(0.02)
    return None


class EndedFirst(Exception):
    """The run committed its last step before the replacement took one: nothing to measure."""


def one_run(size: str, home: Path, spares: int = 0, restart_delay: float = 0.0, steps: int = 0,
            into: float = 0.0) -> dict:
    dim, hidden, depth, batch, kill_after, default_steps = SIZES[size]
    steps = steps or default_steps
    # The replica that replaces rank 1: the spare (replica 3) when there is one, else rank 1 restarted.
    back_rank, nproc = (3, 4) if spares else (1, 3)
    out = Path(tempfile.mkdtemp(prefix=f"heal-{size}-"))
    run_id = f"heal-{size}-{int(time.time() * 1000)}"
    env = dict(os.environ, FTRUN_HOME=str(home))
    # --verbose: the heal's own line (MB received, seconds) is read from the console below.
    cmd = [sys.executable, "-m", "ftrun", "--nproc", str(nproc), "--ft", "--spares", str(spares), "--verbose",
           "--run-id", run_id, str(TRAIN),
           "--dim", str(dim), "--hidden", str(hidden), "--depth", str(depth), "--batch", str(batch),
           "--optim", "adamw", "--lr", "0.0005", "--steps", str(steps), "--print-every", "1000", "--announce",
           "--out", str(out / "p"), "--restart-delay", str(restart_delay)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    lines, seen = [], []  # the console's lines, and when each arrived (the phases are dated by them)

    def read() -> None:
        for line in iter(proc.stdout.readline, ""):
            lines.append(line)
            seen.append((time.time(), line))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    watch = RssWatch(proc.pid)
    watch.start()
    deadline = time.time() + 900
    killed_at = kill_when_running(home / run_id / "state.json", 1, kill_after, proc, deadline, into)
    proc.wait(timeout=max(1.0, deadline - time.time()))
    reader.join(5)
    watch.stop.set()
    text = "".join(lines)
    if proc.returncode != 0 or killed_at is None:
        raise SystemExit(f"bench_heal: run {size} failed (exit {proc.returncode}):\n{text[-3000:]}")
    back = [float(m.group(1)) for m in re.finditer(rf"\[announce\] rank {back_rank} pid \d+ first step \d+ t ([\d.]+)",
                                                   text)]
    back_t = [t for t in back if t > killed_at]
    if not back_t:  # a quiet machine's steps outran the restart (--restart-delay): longer, below
        raise EndedFirst(f"run {size} ended after {steps} steps before rank {back_rank} took a step")
    heal = [m for m in re.finditer(rf"\[rank {back_rank}\] ftrun\.ft: detail: rank {back_rank}: received ([\d.]+) MB "
                                   r"of state from rank \d+ in "
                                   r"([\d.]+) s \(([\d.]+) GB/s", text)]
    mb, secs, gbps = (float(x) for x in heal[-1].groups())
    back_at = back_t[0]
    # Full strength: the replacement begins its first step (train_ft.py --announce), the quorum whole again.
    begins = [float(m.group(1)) for m in re.finditer(rf"\[announce\] rank {back_rank} pid \d+ begins step \d+ t "
                                                     r"([\d.]+)", text)]
    full_at = next((t for t in begins if t > killed_at), float("nan"))
    gaps, all_gaps = [], []
    for r in (0, 2):
        commits = json.loads((out / f"p.rank{r}.json").read_text())["commits"]
        times = [t for _, t in commits]
        for a, b in zip(times, times[1:]):
            all_gaps.append(b - a)
            if b >= killed_at and a <= back_at:
                gaps.append(b - a)
    phases = phases_of(seen, killed_at, back_at, back_rank, spares, secs)
    return {
        **phases,
        "size": size, "spares": spares, "params": params_of(dim, hidden, depth), "state_mb": mb,
        "back_s": back_at - killed_at, "full_s": full_at - killed_at,
        "transfer_s": secs, "gbps": gbps, "survivor_max_step_s": max(gaps) if gaps else 0.0,
        "survivor_median_step_s": statistics.median(all_gaps), "sup_rss_mb": watch.peak / 1e6,
        "sup_rss_before_mb": watch.before(killed_at) / 1e6,
    }


# The phases from a kill to full strength, each ending at a line of the console (--verbose) as it
# arrives here: the supervisor sees the exit; the replacement is ready to join (a restart: its
# process started, the script built its model and asked; a spare: already waiting); the keeper
# publishes the quorum that lists it; the survivors reach the round's top and the quorum's groups
# form (until the transfer starts); the state transfer (its own measured time); the layout round
# and first batch, to the replacement's first committed step.
PHASES = ("detect_s", "restart_s", "decide_s", "groups_s", "transfer_phase_s", "first_batch_s")


def phases_of(seen, killed_at: float, back_at: float, back_rank: int, spares: int, transfer_s: float) -> dict:
    def first(pattern: str, after: float) -> float:
        return next((t for t, line in seen if t >= after and re.search(pattern, line)), float("nan"))

    detected = first(r"ftrun: rank 1 \(pid \d+\) killed by SIGKILL", killed_at)
    decided = first(r"ftrun: quorum \d+: .*(spare replica \d+ takes its place|rank 1 joined"
                    r"|ranks [\d, ]*1[\d, ]* joined)", killed_at)
    healed = first(rf"\[rank {back_rank}\] ftrun\.ft: detail: rank {back_rank}: received", killed_at)
    # A spare is ready when the quorum is decided (it waited all along); a restarted replica when it
    # asked to join, which the keeper answers at its next poll: the decision is then a poll away.
    ready = decided if not spares else detected
    out = dict(zip(PHASES, (detected - killed_at, ready - detected, decided - ready,
                            healed - transfer_s - decided, transfer_s, back_at - healed)))
    return {k: round(v, 4) for k, v in out.items()}


def one_run_long_enough(size: str, home: Path, spares: int, restart_delay: float, steps: int,
                        into: float = 0.0) -> dict:
    """one_run, again with twice the steps while the run ends before the replacement is back (the
    steps it needs depend on the machine's speed and --restart-delay); a clear error after 4 tries."""
    steps = steps or SIZES[size][5]
    tries = 4
    while True:
        try:
            return one_run(size, home, spares, restart_delay, steps, into)
        except EndedFirst as e:
            tries -= 1
            if not tries:
                raise SystemExit(f"bench_heal: {e}: give more with --steps") from None
            print(f"bench_heal: {e}; again with {2 * steps} steps", flush=True)
            steps *= 2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1M,10M,100M")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--spares", default="0", choices=("0", "1", "both"),
                    help="1: a hot spare takes the killed replica's place; both: each size both ways")
    ap.add_argument("--restart-delay", type=float, default=0.0,
                    help="a restarted process sleeps this long before its script starts: what a restart costs "
                         "beyond ftrun's fork (CUDA init, imports, opening a data set) on a real job")
    ap.add_argument("--steps", type=int, default=0, help="steps in all (default: the size's own)")
    ap.add_argument("--kill-into", type=float, default=0.0,
                    help="kill this fraction of a step after rank 1 takes a step (0: as it takes it, its "
                         "optimizer step in flight; 0.6: in the next step's forward or backward)")
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="bench-heal-home-"))
    rows = []
    ways = [0, 1] if args.spares == "both" else [int(args.spares)]
    for size, spares in [(size, n) for size in args.sizes.split(",") for n in ways]:
        runs = []
        for i in range(args.runs):
            r = one_run_long_enough(size, home, spares, args.restart_delay, args.steps, args.kill_into)
            print(f"{size} run {i + 1}: {json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()})}",
                  flush=True)
            runs.append(r)
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0] if k != "size"}
        med["size"] = size + (" + spare" if spares else "")
        med["floor_s"] = statistics.median(floor_seconds(int(med["state_mb"] * 1e6)) for _ in range(1))
        med["rss_max_mb"] = max(r["sup_rss_mb"] for r in runs)
        med["runs"] = len(runs)
        rows.append(med)
        print(f"{size}: floor {med['floor_s']:.3f} s for {med['state_mb']:.1f} MB", flush=True)
    load = os.getloadavg()[0]
    print()
    print("| model | kill -> detected | restart to join | quorum decided | groups formed | state transfer | "
          "first batch (layout round) | kill -> training again | kill -> full strength (its first step begins) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for m in rows:
        print(f"| {m['size']} | " + " | ".join(f"{m[k]:.2f} s" for k in PHASES) + f" | {m['back_s']:.2f} s | "
              f"{m['full_s']:.2f} s |")
    print()
    print("| model | params | state sent | kill -> training again | transfer | bandwidth | floor (plain broadcast) "
          "| transfer / floor | survivors' longest step during heal (median step) | supervisor RSS peak (before kill) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for m in rows:
        print(f"| {m['size']} | {m['params'] / 1e6:.1f}M | {m['state_mb']:.0f} MB | {m['back_s']:.2f} s | "
              f"{m['transfer_s']:.2f} s | {m['gbps']:.2f} GB/s | {m['floor_s']:.2f} s | "
              f"{m['transfer_s'] / m['floor_s']:.2f} | {m['survivor_max_step_s']:.2f} s ({m['survivor_median_step_s']:.2f} s) | "
              f"{m['rss_max_mb']:.0f} MB ({m['sup_rss_before_mb']:.0f} MB) |")
    delay = f"; a restart sleeps {args.restart_delay:g} s first" if args.restart_delay else ""
    delay += f"; killed {args.kill_into:g} of a step after a step" if args.kill_into else ""
    print(f"\nmedians of {args.runs} run(s) per size; AdamW, 3 training replicas{delay}, gloo on CPU; "
          f"load average {load:.1f}; "
          f"torch {__import__('torch').__version__}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    scratch.run(main)
