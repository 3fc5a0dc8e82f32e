"""Stress the --ft protocol: the chaos test's kill schedule, many times, several runs at once.

    .venv/bin/python scripts/stress_chaos.py                 # 50 runs, 2 at a time
    .venv/bin/python scripts/stress_chaos.py --runs 20 --parallel 3 --busy 1

Each run is `ftrun --nproc 3 --ft scripts/train_ft.py --steps 240` with the seeded
schedule of tests/test_ft.py::test_chaos_kills_keep_replicas_identical: 6 SIGKILLs of
random replicas at random moments, one of them while the replica rejoins. A run whose
replicas show no change of state for --stall seconds is a deadlock: its workers' stacks
are dumped into their logs (ftrun's dump signal), the run's --ft keys (each replica's
report, every quorum and its start round) are printed, and its folder is kept. A run that
completes must end with its three replicas bitwise identical (step, parameters, optimizer
state); a folder of one that does not is kept too. `--busy N` adds N busy-looping
processes for load. Prints one line per run, then the counts; exits 1 if any run
deadlocked or diverged.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
import scratch

ROOT = Path(__file__).resolve().parent.parent
DUMP_STACKS = signal.SIGRTMIN + 7  # ftrun.exits.DUMP_STACKS_SIGNAL


class Stalled(Exception):
    pass


def _state(home: Path) -> dict:
    try:
        return json.loads((home / "chaos" / "state.json").read_text())
    except (OSError, ValueError):
        return {}


def _store_dump(state: dict) -> str:
    """The run's --ft keys, read from the supervisor's store (found among its listening ports)."""
    import psutil
    import torch.distributed as dist

    lines = []
    for conn in psutil.Process(state["pid"]).net_connections(kind="tcp"):
        if conn.status != "LISTEN":
            continue
        try:
            store = dist.TCPStore("127.0.0.1", conn.laddr.port, None, False, datetime.timedelta(seconds=2))
            if not store.check(["ftrun/ft/latest"]):
                continue
        except Exception:  # noqa: BLE001 - another listening socket (a worker group's)
            continue
        latest = int(store.get("ftrun/ft/latest"))
        for r in range(3):
            lines.append(f"  info {r}: {store.get(f'ftrun/ft/info/{r}').decode()[:200]}")
        for e in range(1, latest + 1):
            key, start = f"ftrun/ft/quorum/{e}", f"ftrun/ft/start/{e}"
            lines.append(f"  quorum {e}: {store.get(key).decode() if store.check([key]) else '(deleted)'}, "
                         f"start round {store.get(start).decode() if store.check([start]) else '-'}")
        break
    return "\n".join(lines)


def _identical(out: Path) -> str:
    """'identical' when the three replicas ended with the same step, parameters and optimizer
    state, bit for bit; else 'DIVERGED (what)'."""
    import torch

    try:
        ref = [torch.load(f"{out}.rank{r}.pt", weights_only=True) for r in range(3)]
        opt = [torch.load(f"{out}.rank{r}.opt.pt", weights_only=True) for r in range(3)]
        steps = {json.loads(Path(f"{out}.rank{r}.json").read_text())["step"] for r in range(3)}
    except (OSError, ValueError, RuntimeError) as e:
        return f"DIVERGED (unreadable results: {e})"
    if len(steps) != 1:
        return f"DIVERGED (steps {sorted(steps)})"
    for r in (1, 2):
        if any(not torch.equal(ref[0][k], ref[r][k]) for k in ref[0]):
            return f"DIVERGED (rank {r}'s parameters)"
        for idx, st in opt[0]["state"].items():
            if any(not torch.equal(v, opt[r]["state"][idx][n]) for n, v in st.items() if isinstance(v, torch.Tensor)):
                return f"DIVERGED (rank {r}'s optimizer state)"
    return "identical"


def one(i: int, stall_s: float, keep: Path, step_sleep: float) -> str:
    home = Path(tempfile.mkdtemp(prefix=f"ftrun-stress-{i}-"))
    err = open(home / "ftrun.err", "w")
    proc = subprocess.Popen([sys.executable, "-m", "ftrun", "--nproc", "3", "--ft", "--max-restarts", "10",
                             "--run-id", "chaos", str(ROOT / "scripts" / "train_ft.py"), "--steps", "240",
                             "--step-sleep", str(step_sleep), "--out", str(home / "p")],
                            stdout=subprocess.DEVNULL, stderr=err, env=dict(os.environ, FTRUN_HOME=str(home)),
                            cwd=ROOT)

    def wait(rank: int, pred) -> dict:
        deadline = time.monotonic() + stall_s
        while time.monotonic() < deadline:
            for r in _state(home).get("replicas", []):
                if r["rank"] == rank and r.get("pid") and pred(r):
                    return r
            if proc.poll() is not None:
                raise Stalled(f"ftrun exited {proc.returncode} early")
            time.sleep(0.02)
        raise Stalled("no change for %g s" % stall_s)

    def kill(pid: int) -> None:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    rng = random.Random(1234)
    try:
        wait(0, lambda r: r["step"] >= 10)
        for k in range(6):
            victim = rng.randrange(3)
            time.sleep(rng.uniform(0.05, 0.4))
            kill(wait(victim, lambda r: r["state"] == "running")["pid"])
            if k == 2:
                kill(wait(victim, lambda r: r["restarts"] >= 1 and r["state"] in ("recovering", "running"))["pid"])
        code = proc.wait(timeout=stall_s * 3)
        same = _identical(home / "p") if code == 0 else ""
        if same == "identical":
            shutil.rmtree(home, ignore_errors=True)
        return f"run {i}: exit {code}" + (f", replicas {same}" if same else "")
    except (Stalled, subprocess.TimeoutExpired) as e:
        state = _state(home)
        phases = [(r["rank"], r["state"], r.get("ft_phase"), r["step"]) for r in state.get("replicas", [])]
        dump = _store_dump(state) if state else ""
        for r in state.get("replicas", []):
            if r.get("pid"):
                try:
                    os.kill(r["pid"], DUMP_STACKS)
                except OSError:
                    pass
        time.sleep(2)  # the dump handler writes into the rank logs
        proc.kill()
        target = keep / f"stalled-{i}"
        shutil.move(str(home), target)
        return f"run {i}: DEADLOCK ({e}); replicas {phases}; logs in {target}\n{dump}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--busy", type=int, default=0, help="busy-looping processes for load")
    ap.add_argument("--step-sleep", type=float, default=0.02,
                    help="seconds added to each step (0.1: slow steps, so rounds of one or two steps after the "
                         "first failure)")
    ap.add_argument("--stall", type=float, default=60.0, help="seconds without a change that make a deadlock")
    ap.add_argument("--keep", default=tempfile.gettempdir(), help="where stalled runs' folders are moved")
    args = ap.parse_args()
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        with ThreadPoolExecutor(args.parallel) as pool:
            results = []
            for line in pool.map(lambda i: one(i, args.stall, Path(args.keep), args.step_sleep),
                                 range(1, args.runs + 1)):
                print(f"{line} (load average {os.getloadavg()[0]:.1f})", flush=True)
                results.append(line)
    finally:
        for b in busy:
            b.kill()
    stalled = sum("DEADLOCK" in r for r in results)
    diverged = sum("DIVERGED" in r for r in results)
    done = sum(": exit 0, replicas identical" in r for r in results)
    print(f"{done} of {len(results)} runs completed with exit 0 and bitwise identical replicas; {stalled} deadlocked; "
          f"{diverged} diverged")
    sys.exit(1 if stalled or diverged else 0)


if __name__ == "__main__":
    scratch.run(main)
