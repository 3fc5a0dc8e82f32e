"""Launch-overhead benchmark: ftrun against torchrun, in one run, medians of several.

(a) wall time from start to exit of `ftrun --nproc 2` on a script that imports
    torch, joins the gloo group and exits, against `torchrun --nproc-per-node 2`
    on the same script and against the floor of two bare `python -c 'import torch'`
    in parallel;
(b) time from SIGKILL of a worker to the supervisor noticing it (ftrun prints
    `rank N (pid P) killed by SIGKILL` the moment its event loop sees the exit;
    the line's arrival time on the pipe is taken);
(c) `ftrun --help` wall time against `torchrun --help`;
(d) as (a), with torchrun's most common line: `--standalone --nproc-per-node 2`;
(e) a two-node c10d run on loopback: two launchers with the same line
    (`--nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint localhost:PORT`),
    wall time from starting both to both having exited.

Usage: .venv/bin/python scripts/bench_launch.py [--repeats 7] [--markdown]
Runs are interleaved (ftrun, torchrun, floor, ftrun, ...) so that load from
anything else on the machine hits all of them alike.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
import scratch

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
BIN = Path(PY).parent
INIT = str(ROOT / "scripts" / "init_only.py")


def timed(cmd, env=None) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, check=True)
    return time.perf_counter() - t0


def two_nodes(launcher, env) -> float:
    """Two identical c10d lines on loopback, started together; seconds until both have exited."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    line = launcher + ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                       "--rdzv-endpoint", f"localhost:{port}", INIT]
    t0 = time.perf_counter()
    procs = [subprocess.Popen(line, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env) for _ in range(2)]
    for p in procs:
        if p.wait() != 0:
            raise SystemExit(f"{' '.join(line)} exited {p.returncode}")
    return time.perf_counter() - t0


def floor_two_imports() -> float:
    t0 = time.perf_counter()
    procs = [subprocess.Popen([PY, "-c", "import torch"]) for _ in range(2)]
    for p in procs:
        p.wait()
    return time.perf_counter() - t0


def detection_latency(env) -> float:
    """Seconds from SIGKILL of a worker to ftrun's line saying so."""
    with tempfile.TemporaryDirectory() as d:
        script = Path(d) / "sleeper.py"
        script.write_text("import os, time\nprint('ready', os.getpid(), flush=True)\ntime.sleep(120)\n")
        proc = subprocess.Popen([PY, "-m", "ftrun", "--nproc", "2", "--max-restarts", "1",
                                 "--shutdown-timeout", "1", str(script)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        pids = []
        for line in proc.stdout:
            if "ready" in line:
                pids.append(int(line.split()[-1]))
                if len(pids) == 2:
                    break
        seen = threading.Event()
        stamp = [0.0]

        def watch():
            for line in proc.stderr:
                if "killed by SIGKILL" in line:
                    stamp[0] = time.perf_counter()
                    seen.set()
                    return

        t = threading.Thread(target=watch, daemon=True)
        t.start()
        time.sleep(0.2)
        t0 = time.perf_counter()
        os.kill(pids[1], signal.SIGKILL)
        seen.wait(10)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        return stamp[0] - t0 if seen.is_set() else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--markdown", action="store_true", help="print a markdown table instead of a rich one")
    args = ap.parse_args()

    home = tempfile.mkdtemp(prefix="ftrun-bench-")
    env = dict(os.environ, FTRUN_HOME=home)
    env.pop("OMP_NUM_THREADS", None)
    ftrun = [PY, "-m", "ftrun", "--quiet", "--nproc", "2", INIT]
    torchrun = [str(BIN / "torchrun"), "--nproc-per-node", "2", INIT]
    a = {"ftrun": [], "torchrun": [], "floor": []}
    c = {"ftrun": [], "torchrun": []}
    d = {"ftrun": [], "torchrun": []}
    e = {"ftrun": [], "torchrun": []}
    standalone = {"ftrun": [PY, "-m", "ftrun", "--quiet", "--standalone", "--nproc-per-node", "2", INIT],
                  "torchrun": [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", INIT]}
    nodes = {"ftrun": [PY, "-m", "ftrun", "--quiet"], "torchrun": [str(BIN / "torchrun")]}
    b = []
    timed(ftrun, env)  # warm the page cache for everyone
    for _ in range(args.repeats):
        a["ftrun"].append(timed(ftrun, env))
        a["torchrun"].append(timed(torchrun, env))
        a["floor"].append(floor_two_imports())
        c["ftrun"].append(timed([PY, "-m", "ftrun", "--help"], env))
        c["torchrun"].append(timed([str(BIN / "torchrun"), "--help"], env))
        b.append(detection_latency(env))
        for k in ("ftrun", "torchrun"):
            d[k].append(timed(standalone[k], env))
            e[k].append(two_nodes(nodes[k], env))

    med = {k: statistics.median(v) for k, v in a.items()}
    medc = {k: statistics.median(v) for k, v in c.items()}
    medb = statistics.median([x for x in b if x == x])
    medd = {k: statistics.median(v) for k, v in d.items()}
    mede = {k: statistics.median(v) for k, v in e.items()}
    rows = [
        ("(a) start to exit, 2 workers, import torch + gloo init", f"{med['ftrun']:.2f} s", f"{med['torchrun']:.2f} s",
         f"{med['ftrun'] / med['torchrun']:.2f}", "<= 0.70", f"floor (2 x import torch in parallel): {med['floor']:.2f} s"),
        ("(b) SIGKILL of a worker to detection", f"{medb * 1000:.1f} ms", "-", "-", "< 50 ms",
         f"min {min(b) * 1000:.1f} ms, max {max(b) * 1000:.1f} ms"),
        ("(c) --help", f"{medc['ftrun']:.3f} s", f"{medc['torchrun']:.3f} s",
         f"{medc['ftrun'] / medc['torchrun']:.2f}", "< 0.33", ""),
        ("(d) --standalone, 2 workers, import torch + gloo init", f"{medd['ftrun']:.2f} s",
         f"{medd['torchrun']:.2f} s", f"{medd['ftrun'] / medd['torchrun']:.2f}", "<= 0.42", ""),
        ("(e) two c10d nodes on loopback, 1 worker each, formation to exit", f"{mede['ftrun']:.2f} s",
         f"{mede['torchrun']:.2f} s", f"{mede['ftrun'] / mede['torchrun']:.2f}", "<= 0.42",
         "same line on both nodes, no --node-rank"),
    ]
    head = ("measure", "ftrun", "torchrun", "ratio", "target", "notes")
    load = os.getloadavg()[0]
    if args.markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for r in rows:
            print("| " + " | ".join(r) + " |")
        print(f"\nmedians of {args.repeats} interleaved runs; load average at the end {load:.2f}; "
              f"torch {subprocess.run([PY, '-c', 'import torch;print(torch.__version__)'], capture_output=True, text=True).stdout.strip()}")
    else:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"ftrun vs torchrun launch overhead (medians of {args.repeats}, load {load:.2f})")
        for h in head:
            table.add_column(h)
        for r in rows:
            table.add_row(*r)
        Console().print(table)


if __name__ == "__main__":
    scratch.run(main)
