"""Benchmark of what `--hook diloco` does to a model's quality: the held-out loss of a small GPT after
the same samples under plain DDP, DiLoCo (H=20, H=100, streaming, int8) and --hook localsgd, on one
machine.

    .venv/bin/python scripts/bench_diloco_quality.py                 # the table, about 10 minutes on 2 cores
    .venv/bin/python scripts/bench_diloco_quality.py --md docs/benchmarks/diloco-quality.md

Per configuration and run, the real CLI (`python -m ftrun --nproc N ...`, default N=2) trains the
unmodified scripts/train_tiny_gpt.py (a GPT on a synthetic language with a known loss floor) for the
same steps, batch and seed; run i uses --seed i in every configuration, so the rows differ by the
flags alone. Per configuration the table gives the medians over --runs of the held-out loss (the
mean over the ranks' models) at a few points and at the end, its ratio to plain DDP's at the end,
whether every rank ended with bitwise the same parameters, and steps/s (evaluation excluded).

It must leave nothing behind: each run's ftrun is started in a session of its own and stopped
with everything it started on success, on failure, on Ctrl-C and on SIGTERM (a try/finally with
signals turned into exits, and held off while it cleans up); its files live in one temporary
folder removed at the end. Never imports torch (the workers do) and never imports ftrun (it runs
the command line, as a user does).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from bench_pages import write_between  # scripts/, beside this one
from bench_undo import Cleanup, guarded

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "scripts" / "train_tiny_gpt.py"
BEGIN, END = "<!-- bench_diloco_quality:begin -->", "<!-- bench_diloco_quality:end -->"

# (key for --only, label in the table, ftrun flags)
CONFIGS: List[Tuple[str, str, List[str]]] = [
    ("ddp", "plain DDP (no hook)", []),
    ("diloco20", "`--hook diloco --period 20`", ["--hook", "diloco", "--period", "20"]),
    ("diloco100", "`--hook diloco --period 100`", ["--hook", "diloco", "--period", "100"]),
    ("streaming20-f4", "`--hook diloco --period 20 --fragments 4 --sync-delay 4`",
     ["--hook", "diloco", "--period", "20", "--fragments", "4", "--sync-delay", "4"]),
    ("diloco20-int8", "`--hook diloco --period 20 --wrap int8`",
     ["--hook", "diloco", "--period", "20", "--wrap", "int8"]),
    ("localsgd20", "`--hook localsgd --period 20`", ["--hook", "localsgd", "--period", "20"]),
]
KEYS = [k for k, _, _ in CONFIGS]
FLAGS = {k: f for k, _, f in CONFIGS}


def period_of(flags: Sequence[str]) -> int:
    """The --period a configuration syncs at (1: plain DDP, which syncs every step)."""
    flags = list(flags)
    return int(flags[flags.index("--period") + 1]) if "--period" in flags else 1


# --------------------------------------------------------------------------- leaving nothing behind


def stop_group(proc: subprocess.Popen) -> None:
    """One run's ftrun and everything it started (its own session): SIGTERM, which ftrun passes on
    to its workers and waits for, then SIGKILL to whatever is left of the group."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # a worker ftrun left behind would still be in the group
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)


# --------------------------------------------------------------------------- the runs


def train_args(args: argparse.Namespace, seed: int) -> List[str]:
    return ["--steps", str(args.steps), "--batch", str(args.batch), "--seq", str(args.seq),
            "--layers", str(args.layers), "--dim", str(args.dim), "--lr", str(args.lr), "--seed", str(seed),
            "--eval-every", str(args.eval_every)]


def run_cmd(args: argparse.Namespace, flags: Sequence[str], seed: int, out: Path) -> List[str]:
    return [sys.executable, "-m", "ftrun", "--nproc", str(args.nproc), "--quiet", *flags, str(TRAIN),
            *train_args(args, seed), "--out", str(out)]


def collect(ranks: List[Dict]) -> Dict:
    """One run's figures from its ranks' JSON: losses are the mean over the ranks' models."""
    evals = {}
    for i, e in enumerate(ranks[0]["evals"]):
        evals[e["step"]] = statistics.mean(r["evals"][i]["heldout_loss"] for r in ranks)
    first = ranks[0]
    return {"heldout_loss": statistics.mean(r["heldout_loss"] for r in ranks), "evals": evals,
            "steps_per_s": statistics.mean(r["steps_per_s"] for r in ranks),
            "wall_s": max(r["wall_s"] for r in ranks),
            "same_model": len({r["sha256"] for r in ranks}) == 1,
            **{k: first[k] for k in ("params", "samples", "tokens", "floor_loss", "no_topic_loss",
                                      "unigram_loss", "bigram_loss", "torch", "device")}}


def run_once(args: argparse.Namespace, flags: Sequence[str], seed: int, out: Path,
             cleanup: Cleanup) -> Dict:
    """One run of one configuration to its end (ranks' reports at OUT.rankR.json): the figures, or an error."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), FTRUN_HOME=str(out.parent / "home"))
    proc = subprocess.Popen(run_cmd(args, flags, seed, out), cwd=ROOT, text=True, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)

    def stop() -> None:
        stop_group(proc)

    cleanup.add(f"run {out.name} (pid {proc.pid})", stop)  # a signal from here on: the cleanup stops it
    try:
        _, err = proc.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        err = None
    stop()  # whatever the run left in its session, now, while its group is known to be its own
    cleanup.forget(stop)
    if err is None:
        return {"error": f"no end within {args.timeout:.0f} s"}
    if proc.returncode != 0:
        last = err.strip().splitlines()[-1:] or ["(nothing on stderr)"]
        return {"error": f"exit {proc.returncode}: {last[0][:200]}"}
    try:
        ranks = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(args.nproc)]
    except (OSError, ValueError) as e:
        return {"error": f"no report: {e}"}
    return collect(ranks)


def summarize(runs: List[Dict]) -> Dict:
    """Medians over the runs that finished; an error when none did."""
    good = [r for r in runs if "error" not in r]
    if not good:
        return {"error": runs[-1]["error"] if runs else "not run"}
    out = {k: statistics.median(r[k] for r in good) for k in ("heldout_loss", "steps_per_s", "wall_s")}
    steps = [s for s in good[0]["evals"] if all(s in r["evals"] for r in good)]
    out["evals"] = {s: statistics.median(r["evals"][s] for r in good) for s in steps}
    out["same_model"] = all(r["same_model"] for r in good)
    out.update({k: good[0][k] for k in ("params", "samples", "tokens", "floor_loss", "no_topic_loss",
                                         "unigram_loss", "bigram_loss", "torch", "device")})
    out.update(runs=len(good), failed=len(runs) - len(good))
    return out


# --------------------------------------------------------------------------- the table


def points(steps: Sequence[int]) -> List[int]:
    """The evaluation steps the table shows: all of five or fewer, else those about a quarter, half and
    three quarters in, and the end."""
    steps = sorted(steps)
    if len(steps) <= 5:
        return steps
    end = steps[-1]
    chosen = [min(steps, key=lambda s: abs(s - end * f)) for f in (0.25, 0.5, 0.75)] + [end]
    return sorted(set(chosen))


def table(rows: Dict[str, Dict], meta: Dict) -> str:
    """The markdown table, one row per configuration in CONFIGS' order, with its text above."""
    good = [r for r in rows.values() if "error" not in r]
    first = good[0] if good else {}
    ddp = rows.get("ddp", {}).get("heldout_loss")
    shown = points(first.get("evals", {}))
    lines = [
        f"{meta['machine']}; torch {first.get('torch', '?')} on {first.get('device', '?')} (gloo), "
        f"{meta['nproc']} workers, one thread each. A {first.get('params', 0) / 1e6:.2f}M-parameter GPT "
        f"({meta['layers']} layer{'s' if meta['layers'] != 1 else ''}, width {meta['dim']}, context {meta['seq']}), "
        f"AdamW at {meta['lr']:g}, "
        f"{meta['steps']} steps of {meta['batch']} sequences per worker: {first.get('samples', 0):,} sequences "
        f"({first.get('tokens', 0) / 1e6:.2f}M tokens) in every row. Held-out loss in nats per token, the mean "
        f"over the workers' models, " + (f"median of {meta['runs']} runs (seeds 0-{meta['runs'] - 1}, the same "
                                         f"in every row)" if meta["runs"] > 1 else "one run (seed 0)") +
        f"; steps/s without the evaluations. On this language the best possible loss is "
        f"{first.get('floor_loss', float('nan')):.3f} (Bayes-optimal), "
        f"{first.get('no_topic_loss', float('nan')):.3f} without inferring the topic, "
        f"{first.get('bigram_loss', float('nan')):.3f} for a bigram model and "
        f"{first.get('unigram_loss', float('nan')):.3f} for a unigram one. Load average {meta['load']} at the start.",
        "",
        "| configuration | " + " | ".join(f"held-out @ step {s}" for s in shown) + " | x DDP's (end) "
        "| same model on every rank | steps/s |",
        "|---|" + "---:|" * len(shown) + "---:|:---:|---:|",
    ]
    for key, label, _ in CONFIGS:
        if key not in rows:
            continue
        r = rows[key]
        if "error" in r:
            lines.append(f"| {label} | failed: {r['error']} |" + " |" * (len(shown) + 2))
            continue
        ratio = f"{r['heldout_loss'] / ddp:.3f}x" if ddp else "-"
        note = f" ({r['failed']} of {r['runs'] + r['failed']} runs failed)" if r.get("failed") else ""
        losses = " | ".join(f"{r['evals'][s]:.4f}" if s in r["evals"] else "-" for s in shown)
        lines.append(f"| {label}{note} | {losses} | {ratio} | {'yes' if r['same_model'] else 'no'} | "
                     f"{r['steps_per_s']:.2f} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- the command


def parse(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=2,
                   help="runs per configuration (seeds 0..RUNS-1); the table gives medians")
    p.add_argument("--nproc", type=int, default=2, help="workers (replicas) per run")
    p.add_argument("--steps", type=int, default=500, help="training steps per run (a multiple of every period run)")
    p.add_argument("--batch", type=int, default=16, help="sequences per worker per step")
    p.add_argument("--seq", type=int, default=64, help="context length")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks")
    p.add_argument("--dim", type=int, default=128, help="model width")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW's peak learning rate (the inner optimizer's)")
    p.add_argument("--eval-every", type=int, default=100, help="held-out loss every this many steps (a multiple of "
                                                               "every period run)")
    p.add_argument("--only", default=None, help=f"comma-separated configurations: {','.join(KEYS)}")
    p.add_argument("--md", default=None, help="also write the table between this page's markers")
    p.add_argument("--timeout", type=float, default=600, help="seconds one run may take")
    args = p.parse_args(argv)
    for name in ("runs", "steps", "batch", "seq", "layers", "dim", "eval_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.nproc < 2:
        p.error("--nproc must be at least 2: with one replica every configuration trains the same model")
    args.keys = KEYS if args.only is None else [k.strip() for k in args.only.split(",") if k.strip()]
    unknown = [k for k in args.keys if k not in KEYS]
    if unknown or not args.keys:
        p.error(f"--only: unknown configuration {', '.join(unknown) or '(none given)'}; known: {', '.join(KEYS)}")
    # Evaluations and the end at a sync of every configuration: a DiLoCo replica's model between two
    # syncs is its own, not the global one.
    for key in args.keys:
        period = period_of(FLAGS[key])
        for name in ("steps", "eval_every"):
            if getattr(args, name) % period:
                p.error(f"--{name.replace('_', '-')} {getattr(args, name)} is no multiple of {key}'s period "
                        f"{period}: its evaluations would fall between two syncs")
    return args


def bench(args: argparse.Namespace, cleanup: Cleanup) -> int:
    work = Path(tempfile.mkdtemp(prefix="ftrun-bench-diloco-quality-"))
    cleanup.add(f"folder {work}", lambda: shutil.rmtree(work, ignore_errors=True))
    load = "{:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
    machine = f"{platform.machine()}, {os.cpu_count()} CPU cores"
    rows = {}
    for key, label, flags in CONFIGS:
        if key not in args.keys:
            continue
        runs = []
        for seed in range(args.runs):
            t0 = time.monotonic()
            r = run_once(args, flags, seed, work / f"{key}-seed{seed}", cleanup)
            runs.append(r)
            print(f"  {key} run {seed + 1} (seed {seed}): " + (r["error"] if "error" in r else
                  f"held-out {r['heldout_loss']:.4f}, {r['steps_per_s']:.2f} steps/s") +
                  f", {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
        rows[key] = summarize(runs)
    text = table(rows, {"machine": machine, "nproc": args.nproc, "layers": args.layers, "dim": args.dim,
                        "seq": args.seq, "lr": args.lr, "steps": args.steps, "batch": args.batch,
                        "runs": args.runs, "load": load})
    print(text)
    if args.md:
        write_between(Path(args.md), text, BEGIN, END)
    return 0 if all("error" not in r for r in rows.values()) else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    return guarded(lambda cleanup: bench(parse(argv), cleanup))


if __name__ == "__main__":
    sys.exit(main())
