"""Benchmark of ftrun's comm hooks: 2 CPU workers, a ~10M-parameter MLP, gloo.

    .venv/bin/python scripts/bench_hooks.py                 # the table, a few minutes
    .venv/bin/python scripts/bench_hooks.py --md docs/benchmarks/hooks.md   # rewrites its tables there

One run per row through the real CLI (`ftrun --nproc 2 --hook ...`). Per hook:
median step time (forward+backward+optimizer step, after warm-up), bytes
this rank hands to collectives per step (ftrun's own figures), and the loss
after the last step. Then, per pair, the workers build two identical models:
ftrun injects its hook into one, the script registers the same torch hook on
the other by hand, and the two are stepped alternately; the ratio of their
median step times is what injection costs (target 1.00 within noise).

With --worker this file is the training script itself (what each rank runs).
Never changes anything outside its own output.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
import scratch

from bench_pages import write_between  # scripts/, beside this one

ROOT = Path(__file__).resolve().parent.parent

# (label, ftrun hook flags)
RUNS = [
    ("no hook (DDP default)", []),
    ("allreduce", ["--hook", "allreduce"]),
    ("fp16", ["--hook", "fp16"]),
    ("bf16", ["--hook", "bf16"]),
    ("powersgd rank 1", ["--hook", "powersgd", "--rank", "1", "--start-iter", "2"]),
    ("powersgd rank 4 --wrap fp16", ["--hook", "powersgd", "--rank", "4", "--start-iter", "2", "--wrap", "fp16"]),
    ("batched-powersgd rank 1", ["--hook", "batched-powersgd", "--rank", "1", "--start-iter", "2"]),
    ("localsgd period 4", ["--hook", "localsgd", "--period", "4", "--start-iter", "2"]),
    ("noop (compute-only bound)", ["--hook", "noop"]),
]
# Injected vs by hand: one run per hook with two identical models in the same
# processes, stepped alternately, so load on a shared machine hits both alike.
PAIRS = [("allreduce", ["--hook", "allreduce"]), ("fp16", ["--hook", "fp16"]),
         ("powersgd", ["--hook", "powersgd", "--rank", "1", "--start-iter", "2"])]


# --------------------------------------------------------------------------- worker (one rank)


def _build(dims):
    import torch.nn as nn

    layers = []
    for a, b in zip(dims[:-1], dims[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


def _register_by_hand(ddp, name: str):
    """What a script would write itself: torch's hook, registered on its DDP."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if name == "allreduce":
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    elif name == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif name == "powersgd":
        state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2,
                                            compression_stats_logging_frequency=10 ** 9)

        def powersgd_in_order(state, bucket):
            # torch's hook unchanged, but finished before returning: on gloo its
            # chained allreduces otherwise race the next bucket's (docs/guides/hooks.md).
            chained = state.iter >= state.start_powerSGD_iter
            fut = powerSGD_hook.powerSGD_hook(state, bucket)
            if chained:
                fut.wait()
            return fut

        ddp.register_comm_hook(state, powersgd_in_order)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dims = [1024, 2048, 2048, 1024, 1024, 512]  # 2.1M + 4.2M + 2.1M + 1.05M + 0.5M = ~10M parameters
    models = []
    for k in range(2 if args.hand else 1):
        torch.manual_seed(0)
        model = _build(dims)
        ddp = DDP(model)  # under --hook, ftrun puts its hook on this at the first forward
        if k == 1:
            _register_by_hand(ddp, args.hand)  # the script's own hook wins on this one
        models.append((model, ddp, torch.optim.Adam(ddp.parameters(), lr=args.lr), [], []))
    teacher = torch.randn(dims[0], dims[-1], generator=torch.Generator().manual_seed(1)) / dims[0] ** 0.5
    for step in range(args.warmup + args.steps):
        # 4 batches per rank, cycled: a task the model can learn in a few dozen steps
        g = torch.Generator().manual_seed((step % 4) * world + rank)
        x = torch.randn(args.batch, dims[0], generator=g)
        y = torch.tanh(x @ teacher)
        order = models if step % 2 == 0 else models[::-1]  # alternate who goes first
        for model, ddp, opt, times, losses in order:
            t0 = time.perf_counter()
            loss = nn.functional.mse_loss(ddp(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            dt = time.perf_counter() - t0
            losses.append(loss.item())
            if step >= args.warmup:
                times.append(dt)
    model, ddp, opt, times, losses = models[0]
    out = {"median_step_s": statistics.median(times), "loss": sum(losses[-5:]) / 5, "loss0": losses[0],
           "params": sum(p.numel() for p in model.parameters()), "steps": args.warmup + args.steps}
    if args.hand:
        out["hand_median_step_s"] = statistics.median(models[1][3])
        out["hand_loss"] = sum(models[1][4][-5:]) / 5
    out["bytes_per_step"] = 4.0 * out["params"]  # DDP's own allreduce
    try:
        from ftrun.worker.hooks import current_stats

        st = current_stats()
    except ImportError:
        st = {"models": []}
    if st["models"]:
        m = st["models"][0]
        lsgd = m.get("localsgd")
        # localsgd averages parameters every `period` steps: spread that over the steps since start_iter
        avg = lsgd["averaging_bytes"] / max(m["steps"] - 2, 1) if lsgd else 0.0
        out["bytes_per_step"] = m["last_step_bytes"] + avg
    if rank == 0 and args.out:
        Path(args.out).write_text(json.dumps(out))
    dist.destroy_process_group()


# --------------------------------------------------------------------------- driver


def run_one(label: str, flags: list, hand, args: argparse.Namespace, tmp: Path) -> dict:
    out = tmp / (label.replace(" ", "_").replace(",", "").replace("(", "").replace(")", "") + f"{hand}.json")
    cmd = [sys.executable, "-m", "ftrun", "--nproc", "2", "--quiet"] + flags + [
        __file__, "--worker", "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch),
        "--out", str(out)]
    if hand:
        cmd += ["--hand", hand]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=args.timeout)
    if proc.returncode != 0 or not out.exists():
        return {"error": f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}"}
    res = json.loads(out.read_text())
    res["wall_s"] = time.time() - t0
    return res


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


def table(results: dict, pairs: dict, args: argparse.Namespace) -> str:
    base = results.get("allreduce", {}).get("bytes_per_step")
    params = max([r.get("params", 0) for r in results.values()] + [0])
    lines = [
        f"2 workers x 1 CPU thread, gloo, {params / 1e6:.1f}M-parameter MLP, Adam, batch {args.batch} per worker; "
        f"median of {args.steps} steps after {args.warmup} warm-up steps; "
        f"loss: first step -> mean of the last 5 of {args.warmup + args.steps} steps; "
        "bytes: what one rank hands to collectives per step, once the hook is compressing.",
        "",
        "| run | median step (ms) | bytes sent / step | vs allreduce | loss |",
        "|---|---:|---:|---:|---:|",
    ]
    for label, _ in RUNS:
        r = results.get(label, {"error": "not run"})
        if "error" in r:
            lines.append(f"| {label} | failed: {r['error']} | | | |")
            continue
        b = r["bytes_per_step"]
        ratio = f"{base / b:.1f}x less" if base and b else ("nothing sent" if base else "")
        lines.append(f"| {label} | {1000 * r['median_step_s']:.1f} | {_mb(b)} | {ratio} | "
                     f"{r['loss0']:.4f} -> {r['loss']:.4f} |")
    lines += ["", "Injected by ftrun vs the same torch hook registered by hand in the script (two identical "
              "models in the same workers, stepped alternately; same losses expected):", "",
              "| hook | ftrun (ms) | by hand (ms) | ratio | loss ftrun / by hand |", "|---|---:|---:|---:|---:|"]
    for label, r in pairs.items():
        if "error" in r:
            lines.append(f"| {label} | failed: {r['error']} | | | |")
            continue
        a, b = r["median_step_s"], r["hand_median_step_s"]
        lines.append(f"| {label} | {1000 * a:.1f} | {1000 * b:.1f} | {a / b:.2f} | "
                     f"{r['loss']:.4f} / {r['hand_loss']:.4f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--hand", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=25, help="measured steps per run")
    p.add_argument("--warmup", type=int, default=5, help="unmeasured steps first (PowerSGD starts at step 2)")
    p.add_argument("--batch", type=int, default=32, help="batch per worker")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate")
    p.add_argument("--only", default=None, help="';'-separated labels of rows/pairs to run (default: all)")
    p.add_argument("--md", default=None, help="also write the table to this markdown file")
    p.add_argument("--timeout", type=float, default=300)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    os.environ.setdefault("FTRUN_HOME", tempfile.mkdtemp(prefix="ftrun-bench-"))
    wanted = set(args.only.split(";")) if args.only else None
    results, pairs = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, flags in RUNS:
            if wanted is None or label in wanted:
                results[label] = r = run_one(label, flags, None, args, Path(tmp))
                print(f"  {label}: " + (r["error"] if "error" in r else
                      f"{1000 * r['median_step_s']:.1f} ms/step, {_mb(r['bytes_per_step'])}/step, "
                      f"loss {r['loss']:.4f}, {r['wall_s']:.0f} s"), file=sys.stderr, flush=True)
        for label, flags in PAIRS:
            if wanted is None or label + " pair" in wanted:
                pairs[label] = r = run_one(label, flags, label, args, Path(tmp))
                print(f"  {label} ftrun vs by hand: " + (r["error"] if "error" in r else
                      f"{1000 * r['median_step_s']:.1f} / {1000 * r['hand_median_step_s']:.1f} ms/step, "
                      f"{r['wall_s']:.0f} s"), file=sys.stderr, flush=True)
    text = table(results, pairs, args)
    print(text)
    if args.md:
        write_between(Path(args.md), text, BEGIN, END, "# Comm hook benchmark\n\nReproduce: `.venv/bin/python "
                      f"scripts/bench_hooks.py --md {args.md}`\n\n")


BEGIN, END = "<!-- bench_hooks:begin -->", "<!-- bench_hooks:end -->"



if __name__ == "__main__":
    scratch.run(main)
