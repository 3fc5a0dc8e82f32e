"""Checkpoint benchmark: what `--checkpoint-dir` costs a training loop under `ftrun --ft`, by model size.

    .venv/bin/python scripts/bench_checkpoint.py                        # 25M and 100M parameters, 3 runs each
    .venv/bin/python scripts/bench_checkpoint.py --sizes 25M --runs 1   # quicker

For each size: `ftrun --nproc 1 --ft --checkpoint-dir DIR --checkpoint-every 100`
runs this file as its worker (an MLP of that many parameters, AdamW: state =
parameters + two moments = 12 bytes a parameter). After a warm-up of 100
steps the loop is cut into blocks of 50 steps: every other block begins with
a save (steps 100, 200, ...), the blocks between have none. So, in the same
run and under the same load, a block with a save is what "a save every 50
steps" costs, against a block without. Measured:

- pause: how long the training loop stops for each save, as ftrun measured
  it (staging the state into host memory; each checkpoint's ftrun.json has
  it), and the same as the loop sees it: the iteration that holds the save,
  against the median iteration. The first save of a run also allocates the
  staging buffers (later saves copy into them): shown apart.
- torch.save: in the same worker, after its loop, a synchronous
  `torch.save({"model": ..., "optim": ...})` of the same state to the same
  disk, median of 3 (without fsync, which DCP's write does: the comparison
  flatters torch.save).
- steps/s of blocks with a save against blocks without (the ratio is the
  throughput of saving every 50 steps against not saving), and the
  background write's own time.
- what the checksums cost the write, two ways, each a ratio within one run:
  ftrun's own saves alternate between with and without them
  (FTRUN_CHECKPOINT_VERIFY=alternate: the save of step 300 with, of step 200
  without; "with" is torch's CRC-32 of every record, which DCP's write
  computes by default and ftrun checks at load, and ftrun's CRC of
  .metadata; "without" turns torch's off); and, after the loop, away from
  the training's noise, the same worker writes the same state with DCP
  WRITE_PAIRS times each way, in the order with, without, without, with, ...
  (each write fsynced and then removed). On a machine shared with other work the
  wall-clock ratio swings with the neighbours' load, so the same ratio is also
  given by the worker process's CPU time per step (every thread of it:
  training, staging, writing; the kernel's own writeback threads are not in
  it): what the saves add to the work, whatever else runs.

Medians over blocks and runs (--runs runs per size); a markdown table at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
import scratch

ROOT = Path(__file__).resolve().parent.parent
BLOCK = 50
WARM = 100  # steps before the first block (and the first save)

# name -> (width, layers, batch)
SIZES = {
    "25M": (2048, 6, 64),
    "100M": (4096, 6, 32),
}
SAVE_EVERY = 2 * BLOCK  # a save every other block of BLOCK steps
PAIRS = 3  # (block with a save, block without) per run; the first one's save also allocates the staging buffers
WRITE_PAIRS = 4  # after the loop: DCP writes of the state with and without checksums, each


# ----------------------------------------------------------------------------- the worker (under ftrun --ft)

def worker(args: argparse.Namespace) -> None:
    import resource

    import torch
    import torch.nn as nn

    import ftrun.ft as ft

    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [nn.Linear(args.width, args.width), nn.ReLU()]
    model = nn.Sequential(*layers)
    ddp = ft.DistributedDataParallel(model)
    opt = ft.Optimizer(torch.optim.AdamW(ddp.parameters(), lr=1e-4))
    x = torch.randn(args.batch, args.width)
    marks = []
    for step in ft.steps(args.steps):
        marks.append((step, time.perf_counter(), time.process_time()))
        loss = ddp(x).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    marks.append((args.steps, time.perf_counter(), time.process_time()))
    saves = []
    path = Path(args.scratch) / "torch_save.pt"
    for _ in range(3):
        t0 = time.perf_counter()
        torch.save({"model": model.state_dict(), "optim": opt.optimizer.state_dict()}, path)
        saves.append(time.perf_counter() - t0)
        path.unlink()
    writes = _checksum_writes(model, opt.optimizer, Path(args.scratch))
    nparams = sum(p.numel() for p in model.parameters())
    Path(args.result).write_text(json.dumps({
        "marks": marks, "torch_save_s": saves, "params": nparams, "writes_with": writes[True],
        "writes_without": writes[False],
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))


def _checksum_writes(model, optimizer, scratch: Path) -> dict:
    """DCP writes of the state as ftrun takes it, with checksums (torch's record CRCs on, and the
    CRC of .metadata ftrun adds) and without (torch's CRCs off), alternating ABBA; seconds each."""
    import types
    import zlib

    import torch
    import torch.distributed.checkpoint as dcp

    from ftrun.worker.ft.checkpoint.state import StateDicts

    sd = StateDicts().state_dict(types.SimpleNamespace(models=[model], optimizers=[optimizer], extras={}))
    default = torch.serialization.get_crc32_options()
    times: dict = {True: [], False: []}
    try:
        for i in range(2 * WRITE_PAIRS):
            on = i % 4 in (0, 3)
            path = scratch / f"dcp-{i}"
            torch.serialization.set_crc32_options(on)
            t0 = time.perf_counter()
            dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(path), sync_files=True), no_dist=True)
            if on:
                zlib.crc32((path / ".metadata").read_bytes())
            times[on].append(time.perf_counter() - t0)
            shutil.rmtree(path)
    finally:
        torch.serialization.set_crc32_options(default)
    return times


# ----------------------------------------------------------------------------- the driver

def one_run(size: str, scratch: Path) -> dict:
    width, layers, batch = SIZES[size]
    steps = WARM + 2 * BLOCK * PAIRS
    ck = scratch / "ck"
    shutil.rmtree(ck, ignore_errors=True)
    result = scratch / "result.json"
    result.unlink(missing_ok=True)
    env = dict(os.environ, FTRUN_HOME=str(scratch / "home"), FTRUN_CHECKPOINT_VERIFY="alternate")
    logs = scratch / "logs"
    shutil.rmtree(logs, ignore_errors=True)
    cmd = [sys.executable, "-m", "ftrun", "-q", "--nproc", "1", "--ft", "--log-dir", str(logs),
           "--checkpoint-dir", str(ck), "--checkpoint-every", str(SAVE_EVERY),
           __file__, "--worker", "--width", str(width), "--layers", str(layers), "--batch", str(batch),
           "--steps", str(steps), "--scratch", str(scratch), "--result", str(result)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"ftrun failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    r = json.loads(result.read_text())
    # The time of each step's first yield (a discarded round yields its step again).
    first: dict = {}
    cpu: dict = {}
    for s, t, c in r["marks"]:
        first.setdefault(s, t)
        cpu.setdefault(s, c)
    iters = {s: first[s + 1] - first[s] for s in range(steps) if s + 1 in first}
    cpu_iters = {s: cpu[s + 1] - cpu[s] for s in range(steps) if s + 1 in cpu}
    # The iteration that ends with committing step s+1 holds the save of step s+1.
    saving = {s for s in iters if (s + 1) % SAVE_EVERY == 0 and s + 1 < steps}
    usual = statistics.median(d for s, d in iters.items() if s >= WARM // 2 and s not in saving)
    with_save, without, cpu_with, cpu_without = [], [], [], []
    for b in range(2, 2 * PAIRS):  # the first pair is apart: its save allocates the staging buffers
        lo = WARM + b * BLOCK
        # A block with a save: from the iteration holding the save to the BLOCK-1 after it.
        block = range(lo - 1, lo + BLOCK - 1)
        (with_save if b % 2 == 0 else without).append(BLOCK / sum(iters[s] for s in block))
        # The process's CPU time (every thread: training, staging, writing): what the save adds,
        # whatever else the machine runs.
        (cpu_with if b % 2 == 0 else cpu_without).append(sum(cpu_iters[s] for s in block) / BLOCK)
    # What ftrun said of each save (the folder keeps only the newest two).
    said = re.findall(r"checkpoint of step (\d+) written to \S+ \(([\d.]+) MB in ([\d.]+) s; the loop paused ([\d.]+) s",
                      (logs / "rank0" / "stderr.log").read_text())
    infos = [{"step": int(a), "bytes": float(b) * 1e6, "write_s": float(c), "pause_s": float(d)} for a, b, c, d in said]
    infos = [i for i in infos if i["step"] < steps]  # the last save comes after the loop
    # With checksums where step // SAVE_EVERY is odd (300), without where even (200); the first
    # save (100) also allocates the staging buffers: left out.
    checked = [i["write_s"] for i in infos[1:] if (i["step"] // SAVE_EVERY) % 2 == 1]
    unchecked = [i["write_s"] for i in infos[1:] if (i["step"] // SAVE_EVERY) % 2 == 0]
    out = {"with": with_save, "without": without, "cpu_with": cpu_with, "cpu_without": cpu_without, "torch_save_s": statistics.median(r["torch_save_s"]),
           "params": r["params"], "peak_rss": r["peak_rss"], "usual_s": usual,
           "pauses": [i["pause_s"] for i in infos], "excess": [iters[i["step"] - 1] - usual for i in infos],
           "write_s": [i["write_s"] for i in infos], "bytes": infos[0]["bytes"] if infos else 0,
           "checked": checked, "unchecked": unchecked, "alone_with": r["writes_with"],
           "alone_without": r["writes_without"]}
    shutil.rmtree(ck, ignore_errors=True)
    return out


def bench(size: str, runs: int, scratch: Path) -> dict:
    results = []
    for i in range(runs):
        r = one_run(size, scratch)
        results.append(r)
        print(f"  {size} run {i + 1} (load average {os.getloadavg()[0]:.1f}): steps/s with a save {', '.join(f'{x:.3f}' for x in r['with'])}, without "
              f"{', '.join(f'{x:.3f}' for x in r['without'])}; CPU s/step with a save "
              f"{', '.join(f'{x:.3f}' for x in r['cpu_with'])}, without {', '.join(f'{x:.3f}' for x in r['cpu_without'])}; pauses {', '.join(f'{p:.3f}' for p in r['pauses'])} s "
              f"(from the loop {', '.join(f'{e:+.3f}' for e in r['excess'])} s); writes "
              f"{', '.join(f'{w:.2f}' for w in r['write_s'])} s (with checksums "
              f"{', '.join(f'{w:.2f}' for w in r['checked'])}, without {', '.join(f'{w:.2f}' for w in r['unchecked'])}; alone with "
              f"{', '.join(f'{w:.2f}' for w in r['alone_with'])}, without "
              f"{', '.join(f'{w:.2f}' for w in r['alone_without'])}); "
              f"torch.save {r['torch_save_s']:.2f} s; "
              f"usual step {r['usual_s']:.3f} s", flush=True)
    later = [p for r in results for p in r["pauses"][1:]]
    return {
        "size": size, "params": results[0]["params"], "bytes": results[0]["bytes"],
        "pause_first": statistics.median(r["pauses"][0] for r in results), "pause": statistics.median(later),
        "excess": statistics.median(e for r in results for e in r["excess"][1:]),
        "torch_save": statistics.median(r["torch_save_s"] for r in results),
        "write": statistics.median(w for r in results for w in r["write_s"]),
        "sps_on": statistics.median(x for r in results for x in r["with"]),
        "sps_off": statistics.median(x for r in results for x in r["without"]),
        "ratio": statistics.median(statistics.mean(r["with"]) / statistics.mean(r["without"]) for r in results),
        "cpu_ratio": statistics.median(statistics.mean(r["cpu_without"]) / statistics.mean(r["cpu_with"])
                                       for r in results),
        "rss": statistics.median(r["peak_rss"] for r in results),
        "write_checked": statistics.median(w for r in results for w in r["checked"]),
        "write_unchecked": statistics.median(w for r in results for w in r["unchecked"]),
        "checksum_ratio": statistics.median(statistics.mean(r["checked"]) / statistics.mean(r["unchecked"])
                                            for r in results if r["checked"] and r["unchecked"]),
        "alone_with": statistics.median(w for r in results for w in r["alone_with"]),
        "alone_without": statistics.median(w for r in results for w in r["alone_without"]),
        "alone_ratio": statistics.median(statistics.median(r["alone_with"]) / statistics.median(r["alone_without"])
                                         for r in results),
    }


def table(rows) -> str:
    lines = [
        "| params | state | pause per save | seen by the loop | first save | torch.save (sync) | pause / torch.save "
        "| write (background) | steps/s, block with a save | block without | ratio | ratio by CPU time "
        "| worker peak RSS |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['params'] / 1e6:.1f}M | {r['bytes'] / 1e6:.0f} MB | {r['pause']:.3f} s | {r['excess']:+.3f} s "
            f"| {r['pause_first']:.3f} s | {r['torch_save']:.2f} s | {100 * r['pause'] / r['torch_save']:.1f}% "
            f"| {r['write']:.2f} s | {r['sps_on']:.3f} | {r['sps_off']:.3f} | {r['ratio']:.3f} | {r['cpu_ratio']:.3f} "
            f"| {r['rss'] / 2**30:.2f} GiB |")
    lines += ["", "| params | state | ftrun's write, with checksums | without | ratio | the write alone, with | without "
              "| ratio |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['params'] / 1e6:.1f}M | {r['bytes'] / 1e6:.0f} MB | {r['write_checked']:.2f} s "
            f"| {r['write_unchecked']:.2f} s | {r['checksum_ratio']:.3f} | {r['alone_with']:.2f} s "
            f"| {r['alone_without']:.2f} s | {r['alone_ratio']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--width", type=int, help=argparse.SUPPRESS)
    p.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    p.add_argument("--scratch", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--sizes", default="25M,100M", help="comma-separated, of " + ", ".join(SIZES))
    p.add_argument("--runs", type=int, default=3, help="runs per size")
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary folder on the disk of /tmp)")
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    bad = [s for s in sizes if s not in SIZES]
    if bad:
        raise SystemExit(f"unknown size {bad[0]}; pick from {', '.join(SIZES)}")
    scratch = Path(tempfile.mkdtemp(prefix="ftrun-bench-ck-", dir=args.dir))
    load_before = os.getloadavg()[0]
    try:
        rows = [bench(s, args.runs, scratch) for s in sizes]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print()
    print(f"{os.cpu_count()} CPUs, torch {__import__('torch').__version__}, blocks of {BLOCK} steps with and "
          f"without a save, {args.runs} runs per size; load average {load_before:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after")
    print(table(rows))


if __name__ == "__main__":
    scratch.run(main)
