"""Benchmark of ftrun's comm hooks: 2 CPU workers, a ~10M-parameter MLP, gloo.

    .venv/bin/python scripts/bench_hooks.py                 # the table, a few minutes
    .venv/bin/python scripts/bench_hooks.py --md docs/bench_hooks.md

One run per row through the real CLI (`ftrun --nproc 2 --hook ...`). Per hook:
median step time (forward+backward+optimizer step, after warm-up), bytes
this rank hands to collectives per step (ftrun's own figures), and the loss
after the last step. Then each "by hand" row registers the same torch hook in
the script itself, with no --hook, and the ratio of step times shows what
ftrun's injection costs (target 1.00 within noise).

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

ROOT = Path(__file__).resolve().parent.parent

# (label, ftrun hook flags, by-hand mode for the script or None)
RUNS = [
    ("no hook (DDP default)", [], None),
    ("allreduce", ["--hook", "allreduce"], None),
    ("fp16", ["--hook", "fp16"], None),
    ("bf16", ["--hook", "bf16"], None),
    ("powersgd rank 1", ["--hook", "powersgd", "--rank", "1", "--start-iter", "2"], None),
    ("powersgd rank 4 --wrap fp16", ["--hook", "powersgd", "--rank", "4", "--start-iter", "2", "--wrap", "fp16"], None),
    ("batched-powersgd rank 1", ["--hook", "batched-powersgd", "--rank", "1", "--start-iter", "2"], None),
    ("localsgd period 4", ["--hook", "localsgd", "--period", "4", "--start-iter", "2"], None),
    ("noop (compute-only bound)", ["--hook", "noop"], None),
    ("allreduce, by hand", [], "allreduce"),
    ("fp16, by hand", [], "fp16"),
    ("powersgd rank 1, by hand", [], "powersgd"),
]
# Which injected row each by-hand row is compared with.
PAIRS = {"allreduce, by hand": "allreduce", "fp16, by hand": "fp16", "powersgd rank 1, by hand": "powersgd rank 1"}


# --------------------------------------------------------------------------- worker (one rank)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    dims = [1024, 2048, 2048, 1024, 1024, 512]  # 2.1M + 4.2M + 2.1M + 1.05M + 0.5M = ~10M parameters
    layers = []
    for a, b in zip(dims[:-1], dims[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    model = nn.Sequential(*layers[:-1])
    ddp = DDP(model)
    hand_state = None
    if args.hand:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        if args.hand == "allreduce":
            ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        elif args.hand == "fp16":
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif args.hand == "powersgd":
            hand_state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2,
                                                     compression_stats_logging_frequency=10 ** 9)

            def powersgd_in_order(state, bucket):
                # torch's hook unchanged, but finished before returning: on gloo its
                # chained allreduces otherwise race the next bucket's (see docs/hooks.md).
                chained = state.iter >= state.start_powerSGD_iter
                fut = powerSGD_hook.powerSGD_hook(state, bucket)
                if chained:
                    fut.wait()
                return fut

            ddp.register_comm_hook(hand_state, powersgd_in_order)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    teacher = torch.randn(dims[0], dims[-1], generator=torch.Generator().manual_seed(1)) / dims[0] ** 0.5
    times, losses = [], []
    for step in range(args.warmup + args.steps):
        g = torch.Generator().manual_seed(step * world + rank)
        x = torch.randn(args.batch, dims[0], generator=g)
        y = torch.tanh(x @ teacher)
        t0 = time.perf_counter()
        loss = nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        dt = time.perf_counter() - t0
        losses.append(loss.item())
        if step >= args.warmup:
            times.append(dt)
    out = {"median_step_s": statistics.median(times), "loss": sum(losses[-5:]) / 5, "loss0": losses[0],
           "params": sum(p.numel() for p in model.parameters()), "steps": args.warmup + args.steps}
    dense = 4.0 * out["params"]
    try:
        from ftrun.worker.hooks import current_stats

        st = current_stats()
    except ImportError:
        st = {"models": []}
    if st["models"]:
        m = st["models"][0]
        out["bytes_per_step"] = m["last_step_bytes"] + _avg_averaging(m, args)
    elif args.hand == "fp16":
        out["bytes_per_step"] = dense / 2
    elif args.hand == "powersgd":
        _, before, after = hand_state.compression_stats()
        out["bytes_per_step"] = 4.0 * after / max(hand_state.iter - hand_state.start_powerSGD_iter, 1)
    else:
        out["bytes_per_step"] = dense
    if rank == 0 and args.out:
        Path(args.out).write_text(json.dumps(out))
    dist.destroy_process_group()


def _avg_averaging(m: dict, args: argparse.Namespace) -> float:
    # localsgd: parameter averaging happens every `period` steps, not every step
    lsgd = m.get("localsgd")
    return lsgd["averaging_bytes"] / max(m["steps"] - 2, 1) if lsgd else 0.0


# --------------------------------------------------------------------------- driver


def run_one(label: str, flags: list, hand, args: argparse.Namespace, tmp: Path) -> dict:
    out = tmp / (label.replace(" ", "_").replace(",", "").replace("(", "").replace(")", "") + ".json")
    cmd = [sys.executable, "-m", "ftrun", "--nproc", "2", "--quiet"] + flags + [
        __file__, "--worker", "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch),
        "--out", str(out)]
    if hand:
        cmd += ["--hand", hand]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=args.timeout)
    if proc.returncode != 0 or not out.exists():
        return {"error": f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:] }"}
    res = json.loads(out.read_text())
    res["wall_s"] = time.time() - t0
    return res


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


def table(results: dict, args: argparse.Namespace) -> str:
    base = results.get("allreduce", {}).get("bytes_per_step")
    lines = [
        f"2 workers x 1 CPU thread, gloo, {max(r.get('params', 0) for r in results.values()) / 1e6:.1f}M-parameter MLP, "
        f"batch {args.batch} per worker; median of {args.steps} steps after {args.warmup} warm-up steps; "
        f"loss: first step -> mean of the last 5 of {args.warmup + args.steps} steps; "
        "bytes: what one rank hands to collectives per step, once the hook is compressing.",
        "",
        "| run | median step (ms) | bytes sent / step | vs allreduce | loss |",
        "|---|---:|---:|---:|---:|",
    ]
    for label, *_ in RUNS:
        r = results[label]
        if "error" in r:
            lines.append(f"| {label} | failed: {r['error']} | | | |")
            continue
        ratio = f"{base / r['bytes_per_step']:.1f}x less" if base and r["bytes_per_step"] else ("none" if base else "")
        lines.append(f"| {label} | {1000 * r['median_step_s']:.1f} | {_mb(r['bytes_per_step'])} | {ratio} | "
                     f"{r['loss0']:.4f} -> {r['loss']:.4f} |")
    lines += ["", "Injected by ftrun vs the same torch hook registered by hand in the script:", "",
              "| hook | ftrun (ms) | by hand (ms) | ratio |", "|---|---:|---:|---:|"]
    for hand_label, inj_label in PAIRS.items():
        a, b = results.get(inj_label, {}), results.get(hand_label, {})
        if "median_step_s" in a and "median_step_s" in b:
            lines.append(f"| {inj_label} | {1000 * a['median_step_s']:.1f} | {1000 * b['median_step_s']:.1f} | "
                         f"{a['median_step_s'] / b['median_step_s']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--hand", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=25, help="measured steps per run")
    p.add_argument("--warmup", type=int, default=5, help="unmeasured steps first (PowerSGD starts at step 2)")
    p.add_argument("--batch", type=int, default=32, help="batch per worker")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--only", default=None, help="';'-separated row labels to run (default: all)")
    p.add_argument("--md", default=None, help="also write the table to this markdown file")
    p.add_argument("--timeout", type=float, default=300)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    os.environ.setdefault("FTRUN_HOME", tempfile.mkdtemp(prefix="ftrun-bench-"))
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, flags, hand in RUNS:
            if args.only and label not in args.only.split(";"):
                results[label] = {"error": "skipped"}
                continue
            results[label] = run_one(label, flags, hand, args, Path(tmp))
            r = results[label]
            print(f"  {label}: " + (r["error"] if "error" in r else
                  f"{1000 * r['median_step_s']:.1f} ms/step, {_mb(r['bytes_per_step'])}/step, loss {r['loss']:.4f}, "
                  f"{r['wall_s']:.0f} s"), file=sys.stderr, flush=True)
    text = table(results, args)
    print(text)
    if args.md:
        Path(args.md).write_text("# Comm hook benchmark\n\nReproduce: `.venv/bin/python scripts/bench_hooks.py "
                                 f"--md {args.md}`\n\n{text}\n")


if __name__ == "__main__":
    main()
