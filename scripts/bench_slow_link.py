"""Benchmark over a slow link: plain DDP against --hook localsgd and --hook diloco, two nodes in two
network namespaces joined by a shaped veth pair. Needs root and iproute2 (`ip`, `tc`).

    sudo .venv/bin/python scripts/bench_slow_link.py                    # the table, about 15 minutes
    sudo .venv/bin/python scripts/bench_slow_link.py --md docs/benchmarks/slow-link.md --torchft-python V/bin/python

It makes two namespaces, one veth pair between them (10.233.57.1 and .2), and limits both ends
with `tc` (netem: --rate and --delay; where the kernel has no sch_netem, tbf at --rate only, with
no added delay, and the table says so). Per configuration and run, one ftrun node per namespace
(`ip netns exec NS ftrun --nnodes 2 --node-rank R --nproc 1 ...`) trains
scripts/train_slow_link.py for the same steps; per configuration the table gives the medians over
--runs of the bytes a node sent on the link per step (its veth's tx_bytes counter, read by the
script inside its namespace), steps/s after warm-up, the ratio to DDP's steps/s, and the
held-out loss at the end (the same samples seen in every configuration).

Beside ftrun's rows, torchft 0.2's DiLoCo on the same model, data and link
(scripts/train_slow_link_torchft.py: one replica group per namespace, torchft's lighthouse on
node 0), with `--torchft-python` naming a scratch venv's python that has torchft installed
(`python3 -m venv V && V/bin/pip install torch==2.13.0 torchft==0.2.0`); without it that row says
it was not run.

It must leave nothing behind: every namespace, veth and process it makes is recorded as it is
made and removed on success, on failure, on Ctrl-C and on SIGTERM (a try/finally with signals
turned into exits, and held off while it cleans up). Never touches a namespace or link it did not
make, and never imports torch (the nodes' workers do).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from bench_pages import write_between  # scripts/, beside this one
from bench_undo import Cleanup, guarded

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "scripts" / "train_slow_link.py"
TRAIN_TORCHFT = ROOT / "scripts" / "train_slow_link_torchft.py"
ADDRS = ("10.233.57.1", "10.233.57.2")
BEGIN, END = "<!-- bench_slow_link:begin -->", "<!-- bench_slow_link:end -->"

TORCHFT = "torchft"  # a configuration's first flag: torchft's own loop, run by --torchft-python
LIGHTHOUSE_PORT = 29590

# (key for --only, label in the table, ftrun flags)
CONFIGS: List[Tuple[str, str, List[str]]] = [
    ("ddp", "plain DDP (no hook)", []),
    ("localsgd20", "`--hook localsgd --period 20`", ["--hook", "localsgd", "--period", "20"]),
    ("diloco20", "`--hook diloco --period 20`", ["--hook", "diloco", "--period", "20"]),
    ("diloco100", "`--hook diloco --period 100`", ["--hook", "diloco", "--period", "100"]),
    ("diloco20-bf16", "`--hook diloco --period 20 --wrap bf16`",
     ["--hook", "diloco", "--period", "20", "--wrap", "bf16"]),
    ("diloco20-int8", "`--hook diloco --period 20 --wrap int8`",
     ["--hook", "diloco", "--period", "20", "--wrap", "int8"]),
    ("streaming20-f4", "`--hook diloco --period 20 --fragments 4 --sync-delay 4`",
     ["--hook", "diloco", "--period", "20", "--fragments", "4", "--sync-delay", "4"]),
    # Not ftrun: torchft 0.2's DiLoCo on the same model and link (scripts/train_slow_link_torchft.py).
    ("torchft-diloco20", "torchft 0.2 `DiLoCo`, sync every 20 (no ftrun)", [TORCHFT, "--sync-every", "20"]),
]
KEYS = [k for k, _, _ in CONFIGS]
CONFIG_FLAGS = {k: flags for k, _, flags in CONFIGS}


# --------------------------------------------------------------------------- leaving nothing behind


def preflight(euid: int, which: Callable[[str], Optional[str]] = shutil.which) -> Optional[str]:
    """Why this benchmark cannot run here (one line), or None."""
    if euid != 0:
        return "bench_slow_link: needs root (it makes network namespaces and shapes a veth pair with tc)"
    missing = [tool for tool in ("ip", "tc") if which(tool) is None]
    if missing:
        return f"bench_slow_link: needs iproute2: {' and '.join(missing)} not found on PATH"
    return None


# --------------------------------------------------------------------------- the link


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=30)


def _must(*args: str) -> None:
    r = _ip(*args)
    if r.returncode != 0:
        raise RuntimeError(f"`{' '.join(args)}` failed: {r.stderr.strip()}")


def _undo_cmd(*args: str) -> Callable[[], None]:
    def undo() -> None:
        r = _ip(*args)
        # Already gone (a veth goes with its namespace) is not a failure.
        if r.returncode != 0 and "Cannot find" not in r.stderr and "No such" not in r.stderr:
            raise RuntimeError(r.stderr.strip())
    return undo


@dataclass
class Link:
    namespaces: Tuple[str, str]
    devices: Tuple[str, str]
    shaping: str          # what tc applied, as the table's text says it
    netem: bool           # False: no added delay (the kernel has no sch_netem)


def shape_args(dev: str, rate: str, delay: str, netem: bool) -> List[str]:
    """The `tc qdisc add` arguments for one end: netem with delay and rate, or tbf at the rate."""
    if netem:
        return ["qdisc", "add", "dev", dev, "root", "netem", "delay", delay, "rate", rate]
    # burst: a few ms at the rate; latency bounds the queue (packets wait, none added delay).
    return ["qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", "256kb", "latency", "100ms"]


def make_link(tag: str, rate: str, delay: str, cleanup: Cleanup) -> Link:
    """Two namespaces, a veth pair between them with an address on each end, both ends shaped."""
    ns = (f"ftlink{tag}a", f"ftlink{tag}b")
    dev = (f"vlk{tag}a", f"vlk{tag}b")
    for n in ns:
        _must("ip", "netns", "add", n)
        cleanup.add(f"namespace {n}", _undo_cmd("ip", "netns", "del", n))
    _must("ip", "link", "add", dev[0], "type", "veth", "peer", "name", dev[1])
    # Until it is moved into a namespace the pair lives here; deleting one end deletes both.
    cleanup.add(f"veth {dev[0]}", _undo_cmd("ip", "link", "del", dev[0]))
    for n, d, a in zip(ns, dev, ADDRS):
        _must("ip", "link", "set", d, "netns", n)
        _must("ip", "-n", n, "addr", "add", f"{a}/24", "dev", d)
        _must("ip", "-n", n, "link", "set", d, "up")
        _must("ip", "-n", n, "link", "set", "lo", "up")
    probe = _ip("tc", "-n", ns[0], *shape_args(dev[0], rate, delay, True))
    netem = probe.returncode == 0
    if not netem and "unknown" not in probe.stderr.lower():  # netem is there; the values are wrong
        raise RuntimeError(f"tc netem delay {delay} rate {rate} failed: {probe.stderr.strip()}")
    if netem:
        _must("tc", "-n", ns[1], *shape_args(dev[1], rate, delay, True))
        shaping = f"netem delay {delay} rate {rate} on both ends"
    else:
        for n, d in zip(ns, dev):
            _must("tc", "-n", n, *shape_args(d, rate, delay, False))
        shaping = (f"tbf rate {rate} on both ends, no added delay (this kernel has no sch_netem, "
                   f"so the {delay} asked for could not be added)")
    return Link(ns, dev, shaping, netem)


# --------------------------------------------------------------------------- the runs


def _stop_group(proc: subprocess.Popen) -> Callable[[], None]:
    """Undo for one node: its ftrun and everything it started (its own session)."""
    def undo() -> None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)  # ftrun passes it on and waits for its workers
        except ProcessLookupError:
            return  # the whole group is gone
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of the group
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)
    return undo


def node_cmd(link: Link, rank: int, port: int, flags: Sequence[str], train_args: Sequence[str],
             out: Path) -> List[str]:
    return ["ip", "netns", "exec", link.namespaces[rank], sys.executable, "-m", "ftrun",
            "--nnodes", "2", "--node-rank", str(rank), "--nproc", "1", "--master-addr", ADDRS[0],
            "--master-port", str(port), "--run-id", f"link{port}", "--quiet", *flags,
            str(TRAIN), *train_args, "--iface", link.devices[rank], "--out", str(out)]


def lighthouse_cmd(link: Link, torchft_python: str) -> List[str]:
    """torchft's lighthouse (its quorum server), on node 0: the replica groups ask it for each quorum."""
    return ["ip", "netns", "exec", link.namespaces[0], str(Path(torchft_python).parent / "torchft_lighthouse"),
            "--min_replicas", "2", "--join_timeout_ms", "60000", "--bind", f"{ADDRS[0]}:{LIGHTHOUSE_PORT}"]


def torchft_cmd(link: Link, rank: int, port: int, flags: Sequence[str], train_args: Sequence[str], out: Path,
                torchft_python: str) -> List[str]:
    """One torchft replica group of one process in its node's namespace (flags: after TORCHFT)."""
    return ["ip", "netns", "exec", link.namespaces[rank], torchft_python, str(TRAIN_TORCHFT), "--group", str(rank),
            "--addr", ADDRS[rank], "--store-port", str(port), "--lighthouse", f"http://{ADDRS[0]}:{LIGHTHOUSE_PORT}",
            *flags[1:], *train_args, "--iface", link.devices[rank], "--out", str(out)]


def run_once(link: Link, flags: Sequence[str], args: argparse.Namespace, port: int, work: Path,
             cleanup: Cleanup) -> Dict:
    """One run of one configuration: both nodes to the end; the figures, or an error."""
    out = work / f"r{port}"
    train_args = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch)]
    env = dict(os.environ, PYTHONPATH=str(ROOT), FTRUN_HOME=str(work / "home"))
    if flags[:1] == [TORCHFT]:
        if not args.torchft_python:
            return {"error": "not run: give --torchft-python (a venv's python with torchft 0.2)"}
        lh = subprocess.Popen(lighthouse_cmd(link, args.torchft_python), cwd=ROOT, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
        stop_lighthouse = _stop_group(lh)
        cleanup.add(f"torchft lighthouse (pid {lh.pid})", stop_lighthouse)
        try:
            return _run_nodes(link, flags, args, port, out, train_args, env, cleanup)
        finally:
            stop_lighthouse()  # the next run's lighthouse binds its port again
    return _run_nodes(link, flags, args, port, out, train_args, env, cleanup)


def _run_nodes(link: Link, flags: Sequence[str], args: argparse.Namespace, port: int, out: Path,
               train_args: List[str], env: Dict[str, str], cleanup: Cleanup) -> Dict:
    procs = {}
    peer = flags[:1] == [TORCHFT]
    for rank in (1, 0):  # node 1 first: it waits for node 0's store
        cmd = (torchft_cmd(link, rank, port, flags, train_args, out, args.torchft_python) if peer
               else node_cmd(link, rank, port, flags, train_args, out))
        p = subprocess.Popen(cmd, cwd=ROOT, text=True,
                             env=dict(env, GLOO_SOCKET_IFNAME=link.devices[rank]),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        procs[rank] = p
        cleanup.add(f"node {rank} (pid {p.pid})", _stop_group(p))
    deadline = time.monotonic() + args.timeout
    errs = {}
    for rank, p in procs.items():
        try:
            _, errs[rank] = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return {"error": f"no end within {args.timeout:.0f} s"}  # the cleanup stops both nodes
    for rank, p in procs.items():
        if p.returncode != 0:
            last = (errs[rank] or "").strip().splitlines()[-1:] or ["(nothing on stderr)"]
            return {"error": f"node {rank} exit {p.returncode}: {last[0][:200]}"}
    ranks = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in (0, 1)]
    return {"mb_per_step": statistics.mean(r["tx_bytes_per_step"] for r in ranks) / 1e6,
            "steps_per_s": statistics.mean(r["steps_per_s"] for r in ranks),
            "heldout_loss": statistics.mean(r["heldout_loss"] for r in ranks),
            "chance_loss": ranks[0]["chance_loss"], "params": ranks[0]["params"]}


def summarize(runs: List[Dict]) -> Dict:
    """Medians over the runs that finished; an error when none did."""
    good = [r for r in runs if "error" not in r]
    if not good:
        return {"error": runs[-1]["error"] if runs else "not run"}
    out = {k: statistics.median(r[k] for r in good) for k in ("mb_per_step", "steps_per_s", "heldout_loss")}
    out.update(params=good[0]["params"], chance_loss=good[0]["chance_loss"], runs=len(good),
               failed=len(runs) - len(good))
    return out


# --------------------------------------------------------------------------- the table


def table(rows: Dict[str, Dict], meta: Dict) -> str:
    """The markdown table, one row per configuration in CONFIGS' order, with its text above."""
    params = next((r["params"] for r in rows.values() if "params" in r), 0)
    chance = next((r["chance_loss"] for r in rows.values() if "chance_loss" in r), None)
    ddp = rows.get("ddp", {}).get("steps_per_s")
    lines = [
        f"2 nodes x 1 CPU worker (gloo), each node in its own network namespace, joined by one veth pair: "
        f"{meta['shaping']}. A {params / 1e6:.2f}M-parameter MLP, AdamW, batch {meta['batch']} per replica, "
        f"{meta['steps']} steps (the same samples in every row); steps/s and MB/step over steps "
        f"{meta['warmup'] + 1}-{meta['steps']}; MB/step: the node's veth tx_bytes counter (everything one node sent "
        f"on the link: (pseudo-)gradients, TCP/IP headers, the store's traffic); held-out loss at the end"
        + (f" (chance: {chance:.3f})" if chance else "") + f"; median of {meta['runs']} runs; "
        f"load average {meta['load']} at the start.",
        "",
        "| configuration | MB/step | steps/s | x DDP | held-out loss |",
        "|---|---:|---:|---:|---:|",
    ]
    for key, label, _ in CONFIGS:
        if key not in rows:
            continue
        r = rows[key]
        if "error" in r:
            said = r["error"] if r["error"].startswith("not run") else f"failed: {r['error']}"
            lines.append(f"| {label} | {said} | | | |")
            continue
        ratio = f"{r['steps_per_s'] / ddp:.2f}x" if ddp else "-"
        note = f" ({r['failed']} of {r['runs'] + r['failed']} runs failed)" if r.get("failed") else ""
        lines.append(f"| {label}{note} | {r['mb_per_step']:.2f} | {r['steps_per_s']:.2f} | {ratio} | "
                     f"{r['heldout_loss']:.4f} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- the command


def parse(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=2, help="runs per configuration; the table gives medians")
    p.add_argument("--steps", type=int, default=100, help="training steps per run")
    p.add_argument("--warmup", type=int, default=10, help="steps before the measured window")
    p.add_argument("--batch", type=int, default=64, help="samples per replica per step")
    p.add_argument("--rate", default="100mbit", help="the link's rate each way (tc's units)")
    p.add_argument("--delay", default="20ms", help="delay added each way (needs sch_netem)")
    p.add_argument("--only", default=None, help=f"comma-separated configurations: {','.join(KEYS)}")
    p.add_argument("--md", default=None, help="also write the table between this page's markers")
    p.add_argument("--timeout", type=float, default=600, help="seconds one run may take")
    p.add_argument("--torchft-python", default=None,
                   help="the python of a scratch venv with torchft 0.2 (its torchft_lighthouse beside it): "
                        "runs the torchft-diloco20 row; without it that row says it was not run")
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error("--runs must be at least 1")
    if not 0 <= args.warmup < args.steps:
        p.error("--warmup must be at least 0 and below --steps")
    args.keys = KEYS if args.only is None else [k.strip() for k in args.only.split(",") if k.strip()]
    unknown = [k for k in args.keys if k not in KEYS]
    if unknown or not args.keys:
        p.error(f"--only: unknown configuration {', '.join(unknown) or '(none given)'}; known: {', '.join(KEYS)}")
    return args


def bench(args: argparse.Namespace, cleanup: Cleanup) -> int:
    work = Path(tempfile.mkdtemp(prefix="ftrun-bench-slow-link-"))
    cleanup.add(f"folder {work}", lambda: shutil.rmtree(work, ignore_errors=True))
    load = "{:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
    link = make_link(f"{os.getpid() % 10000:04d}", args.rate, args.delay, cleanup)
    print(f"link: {link.shaping}", file=sys.stderr, flush=True)
    rows, port = {}, 29600
    for key, label, flags in CONFIGS:
        if key not in args.keys:
            continue
        runs = []
        for i in range(args.runs):
            port += 1  # a fresh store port per run: no wait on the last run's closing sockets
            t0 = time.monotonic()
            r = run_once(link, flags, args, port, work, cleanup)
            runs.append(r)
            print(f"  {key} run {i + 1}: " + (r["error"] if "error" in r else
                  f"{r['mb_per_step']:.2f} MB/step, {r['steps_per_s']:.2f} steps/s, "
                  f"held-out {r['heldout_loss']:.4f}") + f", {time.monotonic() - t0:.0f} s",
                  file=sys.stderr, flush=True)
        rows[key] = summarize(runs)
    text = table(rows, {"shaping": link.shaping, "steps": args.steps, "warmup": args.warmup, "batch": args.batch,
                        "runs": args.runs, "load": load})
    print(text)
    if args.md:
        write_between(Path(args.md), text, BEGIN, END)
    return 0 if all("error" not in r for r in rows.values()) else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse(argv)
    why = preflight(os.geteuid())
    if why:
        print(why, file=sys.stderr)
        return 2
    return guarded(lambda cleanup: bench(args, cleanup))


if __name__ == "__main__":
    sys.exit(main())
