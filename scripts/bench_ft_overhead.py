"""Failure-free cost of --ft: plain torch DDP and ftrun.ft on the same model, in the same workers.

    .venv/bin/python scripts/bench_ft_overhead.py              # tiny and 2.1M-parameter AdamW models, 3 runs each
    .venv/bin/python scripts/bench_ft_overhead.py --runs 1
    .venv/bin/python scripts/bench_ft_overhead.py --metrics --runs 5   # what --metrics-port costs the step
    .venv/bin/python scripts/bench_ft_overhead.py --guard --runs 5     # what the guard costs the step (23M AdamW)

Each run is `ftrun --nproc 3 --ft scripts/train_ft_vs_ddp.py`: every worker
builds the model three times: under torch's DDP on a gloo group of its own,
the same with torch's own Python allreduce comm hook (the cost of any hook
written in Python, against DDP's built-in one), and under ftrun.ft (DDP on
ftrun's quorum group, store-voted commit), and steps each once a step in a
random order, so all see the same machine at the same moments. A run's figure is the mean step
time over the three workers; the ratio is plain DDP's time over ftrun.ft's
(1.0 = --ft costs nothing), and the Python-hook DDP's over ftrun.ft's. Medians over
--runs runs are printed as a markdown table.

--guard: what the guard (replicas comparing their states' fingerprints) costs the failure-free
step of a 23M-parameter AdamW model: in random order, runs with the guard off (FTRUN_FT_CHECK_S=0),
as it runs by default (a check after the first quorum's first step, then about every 300 s: none
more in a run this short), and checking every 20 steps (FTRUN_FT_CHECK_STEPS=20), whose cost per
check, spread over the default period at the run's pace, is the guard's cost in a long run.

--metrics: what goodput accounting and --metrics-port cost the failure-free step.
Each run is a pair of the same runs, one without and one with --metrics-port while
a scraper reads /metrics every second (Prometheus's default is every 15 s), in a
random order; the figure is ftrun.ft's step time with over without, per pair, and
its median. The accounting itself runs in both (it cannot be turned off): its cost
is the supervisor's CPU time per second of run, measured in-process on the same
stream of events the supervisor sees (3 lanes, a report every 0.25 s, a state write
every 0.2 s).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
import scratch

ROOT = Path(__file__).resolve().parent.parent
MODELS = {
    "tiny (0.26M params, the chaos model)": ["--dim", "256", "--hidden", "1024", "--steps", "600"],
    "2.1M params, AdamW (the issue's size)": ["--dim", "1024", "--hidden", "2048", "--depth", "1", "--optim", "adamw",
                                               "--steps", "200", "--warmup", "20"],
}


def _scrape(port: int, stop: threading.Event, seen: list) -> None:
    """Read http://127.0.0.1:PORT/metrics every second until `stop` (the run's metrics server)."""
    while not stop.wait(1.0):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                seen.append(len(r.read()))
        except OSError:
            pass


GUARD_MODEL = ["--dim", "1024", "--hidden", "2048", "--depth", "6", "--optim", "adamw", "--steps", "40",
               "--warmup", "5"]
GUARD_VARIANTS = {"off": {"FTRUN_FT_CHECK_S": "0"}, "default": {}, "every 20 steps": {"FTRUN_FT_CHECK_STEPS": "20"}}


def one(args: list, metrics: bool = False, env_extra: dict = None) -> dict:
    env = dict(os.environ, FTRUN_HOME=tempfile.mkdtemp(prefix="bench-ftov-"), **(env_extra or {}))
    extra, stop, seen = [], threading.Event(), []
    if metrics:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        extra = ["--metrics-port", str(port)]
        threading.Thread(target=_scrape, args=(port, stop, seen), daemon=True).start()
    import psutil

    proc = subprocess.Popen([sys.executable, "-m", "ftrun", "--nproc", "3", "--ft", *extra,
                             str(ROOT / "scripts" / "train_ft_vs_ddp.py"), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    sup = psutil.Process(proc.pid)
    cpu = (0.0, 0.0, time.monotonic())  # the supervisor's own CPU seconds, sampled while it runs
    out_parts: list = []
    reader = threading.Thread(target=lambda: out_parts.append(proc.communicate(timeout=900)), daemon=True)
    reader.start()
    try:
        t_first = None
        while reader.is_alive():
            try:
                times = sup.cpu_times()
                now = time.monotonic()
                t_first = t_first or (times.user + times.system, now)
                cpu = (t_first[0], times.user + times.system, now - t_first[1])
            except psutil.Error:
                pass
            reader.join(0.5)
    finally:
        stop.set()
    stdout, stderr = out_parts[0]
    out = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    if metrics and not seen:
        raise SystemExit("bench_ft_overhead: --metrics-port served nothing to the scraper")
    rows = [json.loads(line.split("[result] ", 1)[1]) for line in (out.stdout + out.stderr).splitlines()
            if "[result] " in line]
    if out.returncode != 0 or len(rows) != 3:
        raise SystemExit(f"bench_ft_overhead: run failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    ddp = statistics.mean(r["ddp_mean_ms"] for r in rows)
    py = statistics.mean(r["pyhook_mean_ms"] for r in rows)
    ft = statistics.mean(r["ft_mean_ms"] for r in rows)
    sup_cpu = (cpu[1] - cpu[0]) / cpu[2] if cpu[2] > 0 else 0.0
    return {"ddp_ms": ddp, "pyhook_ms": py, "ft_ms": ft, "ratio": ddp / ft, "py_ratio": py / ft, "sup_cpu": sup_cpu,
            "checks_s": _checks(Path(env["FTRUN_HOME"]))}


def _checks(home: Path) -> list:
    """Seconds each of the guard's checks took, from every rank's log (the driver's detail line)."""
    import re

    found = []
    for log in home.glob("*/logs/rank*/stderr.log"):
        found += [float(m) for m in re.findall(r"the guard compared \d+ states at step \d+ in ([\d.]+) s", log.read_text())]
    return found


def accounting_cost(seconds: float = 20.0) -> float:
    """The supervisor's CPU seconds per second of run spent on goodput accounting: the events
    of `seconds` of a 3-replica run at 50 steps/s (a report per replica every 0.25 s, a state
    write every 0.2 s), fed to the accountant as the supervisor feeds them."""
    from ftrun.supervisor.accounting.goodput import Accountant

    acc = Accountant(3, started=0.0, ft=True)
    for r in range(3):
        acc.spawned(r, 0.0)
    t, step, writes = 1.0, 0, 0
    c0 = time.process_time()
    while t < seconds:
        step += 12
        for r in range(3):
            acc.progress(r, t + 0.01, step, t, 1.0)
        for _ in range(round(0.25 / 0.2)):
            acc.snapshot(t)
            writes += 1
        t += 0.25
    return (time.process_time() - c0) / seconds


def metrics_main(runs: int) -> None:
    table = []
    for name, margs in MODELS.items():
        pairs = []
        for _ in range(runs):
            order = [False, True]
            random.shuffle(order)
            got = {m: one(margs, metrics=m) for m in order}
            pairs.append((got[False]["ft_ms"], got[True]["ft_ms"], got[False]["sup_cpu"], got[True]["sup_cpu"]))
            print(f"{name}: without {pairs[-1][0]:.3f} ms (supervisor {100 * pairs[-1][2]:.2f}% of a core), "
                  f"with --metrics-port {pairs[-1][1]:.3f} ms ({100 * pairs[-1][3]:.2f}%)", flush=True)
        ratios = [p[1] / p[0] for p in pairs]
        table.append((name, statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs),
                      statistics.median(ratios), min(ratios), max(ratios),
                      statistics.median(p[2] for p in pairs), statistics.median(p[3] for p in pairs)))
    print("\n| model | --ft step | --ft step, --metrics-port scraped every 1 s | with / without (median of pairs) "
          "| min - max | supervisor CPU without | with |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, wo, w, med, lo, hi, cwo, cw in table:
        print(f"| {name} | {wo:.3f} ms | {w:.3f} ms | {med:.4f} | {lo:.4f} - {hi:.4f} | {100 * cwo:.2f}% "
              f"| {100 * cw:.2f}% |")
    cost = accounting_cost()
    print(f"\n{runs} pairs each, 3 workers, gloo on CPU; load average {os.getloadavg()[0]:.1f}; goodput accounting "
          f"(on in both): {1e6 * cost:.0f} us of the supervisor's CPU per second of run ({100 * cost:.3f}% of a core)")


def guard_main(runs: int) -> None:
    from ftrun import pacing

    got: dict = {v: [] for v in GUARD_VARIANTS}
    checks: list = []
    for _ in range(runs):
        order = list(GUARD_VARIANTS)
        random.shuffle(order)
        for v in order:
            r = one(GUARD_MODEL, env_extra=GUARD_VARIANTS[v])
            got[v].append(r["ft_ms"])
            if v == "every 20 steps":
                checks += r["checks_s"]
            print(f"guard {v}: --ft step {got[v][-1]:.2f} ms; checks {len(r['checks_s'])}", flush=True)
    off = statistics.median(got["off"])
    print("\n| the guard | --ft step (median) | min - max | / off |")
    print("|---|---:|---:|---:|")
    for v, times in got.items():
        print(f"| {v} | {statistics.median(times):.1f} ms | {min(times):.1f} - {max(times):.1f} ms "
              f"| {statistics.median(times) / off:.4f} |")
    per_check = 1000 * statistics.median(checks) if checks else float("nan")  # as each rank's log says
    # What a check costs the loop, the settling of the round before it included: the every-20 arm's
    # extra time over its checks (each rank logs each of its checks: 3 ranks).
    steps = int(GUARD_MODEL[GUARD_MODEL.index("--steps") + 1])
    per_check_loop = (statistics.median(got["every 20 steps"]) - off) * steps / max(1, len(checks) / (3 * runs))
    print(f"\none check: {per_check:.0f} ms in the check itself (median of {len(checks)}, every rank's), "
          f"{per_check_loop:.0f} ms of the loop's time; at the default period ({pacing.CHECK_S:g} s) that is "
          f"{100 * per_check_loop / (pacing.CHECK_S * 1000):.3f}% of the run. {runs} runs each, 3 workers, "
          f"gloo on CPU; load average {os.getloadavg()[0]:.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--metrics", action="store_true", help="with and without --metrics-port, in pairs")
    ap.add_argument("--guard", action="store_true", help="the guard off, as by default, and every 20 steps")
    args = ap.parse_args()
    if args.guard:
        guard_main(args.runs)
        return
    if args.metrics:
        metrics_main(args.runs)
        return
    table = []
    for name, margs in MODELS.items():
        # (a run's figures; its guard checks, a list each rank logged, are the --guard arm's to read)
        runs = [{k: v for k, v in one(margs).items() if isinstance(v, (int, float))} for _ in range(args.runs)]
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
    scratch.run(main)
