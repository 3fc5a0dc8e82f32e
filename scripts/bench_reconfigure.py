"""Rebuilding the replicas' gloo group against torch's reconfigure API (torch >= 2.14).

    python scripts/bench_reconfigure.py                      # N = 2, 4, 8; 9 changes each
    python scripts/bench_reconfigure.py --sizes 4 --rounds 15

ftrun gives every quorum change a fresh group: each member builds a new
ProcessGroupGloo under a fresh store prefix (ftrun.worker.ft.member.group.build_group),
which connects every pair of ranks again through the run's TCPStore. torch 2.14
adds an experimental alternative: a backend made once with
``enable_reconfigure=True`` is re-pointed at a new set of peers by
``reconfigure(uuid, handles)``, each member's handle exchanged out of band (here:
through the same store, as ftrun's vote would carry it).

N processes, one per replica, each with its own store connection, go through
quorum changes in turn: the whole group, then the group without its last
member (a replica lost), and so on. Per change and per method, the time from
the change's start (a store barrier) to the moment every member has finished
one 1-float allreduce on the new group (the slowest member counts); medians
and the spread (min-max) over the changes, both methods in the same run,
interleaved change by change. Only where torch has the API (ProcessGroupGloo
with ``enable_reconfigure``); on an older torch only the rebuild is timed.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TIMEOUT = datetime.timedelta(seconds=60)


def has_reconfigure() -> bool:
    import torch.distributed as dist

    return hasattr(dist.ProcessGroupGloo, "reconfigure") and hasattr(dist.ProcessGroupGloo, "get_reconfigure_handle")


def _barrier(store, key: str, rank: int, members: List[int]) -> None:
    store.set(f"{key}/{rank}", "1")
    store.wait([f"{key}/{r}" for r in members], TIMEOUT)


def member(port: int, rank: int, size: int, rounds: int, methods: List[str]) -> None:
    import torch
    import torch.distributed as dist

    from ftrun.worker.ft.member.group import build_group

    store = dist.TCPStore("127.0.0.1", port, None, False, TIMEOUT)
    recon = None
    if "reconfigure" in methods:
        # Made once, before the first change; its communicator exists only after reconfigure().
        recon = dist.ProcessGroupGloo(dist.PrefixStore("recon", store), rank, size, TIMEOUT, enable_reconfigure=True)
    t = torch.ones(1)
    for i in range(rounds):
        # Even changes: every replica; odd ones: the last replica lost.
        members = list(range(size)) if i % 2 == 0 else list(range(size - 1))
        for method in methods:
            key = f"{method}/{i}"
            if rank not in members:
                continue
            _barrier(store, f"{key}/start", rank, members)
            t0 = time.perf_counter()
            new_rank, n = members.index(rank), len(members)
            if method == "rebuild":
                pg = build_group(store, f"pg/{i}/", new_rank, n)
                pg.allreduce([t]).wait()
            else:
                store.set(f"{key}/handle/{rank}", recon.get_reconfigure_handle())
                handles = [store.get(f"{key}/handle/{r}").decode() for r in members]
                opts = dist.ReconfigureOptions() if hasattr(dist, "ReconfigureOptions") else \
                    torch._C._distributed_c10d.ReconfigureOptions()
                opts.uuid = 1000 + i
                opts.handles = handles
                opts.timeout = TIMEOUT
                recon.reconfigure(opts).wait()
                recon.allreduce([t]).wait()
                assert recon.size() == n, (recon.size(), n)
            dt = time.perf_counter() - t0
            store.set(f"{key}/time/{rank}", repr(dt))
            _barrier(store, f"{key}/end", rank, members)


def run(size: int, rounds: int, methods: List[str]) -> Dict[str, List[float]]:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, None, True, TIMEOUT, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=member, args=(store.port, r, size, rounds, methods)) for r in range(size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise SystemExit(f"bench_reconfigure: a member failed (exit {p.exitcode}) at N={size}")
    out: Dict[str, List[float]] = {m: [] for m in methods}
    for i in range(rounds):
        n = size if i % 2 == 0 else size - 1
        for m in methods:
            # The change is done when its slowest member is.
            out[m].append(max(float(store.get(f"{m}/{i}/time/{r}")) for r in range(n)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="2,4,8", help="replica counts (comma-separated)")
    ap.add_argument("--rounds", type=int, default=9, help="quorum changes per size")
    a = ap.parse_args()
    import torch

    methods = ["rebuild"] + (["reconfigure"] if has_reconfigure() else [])
    print(f"torch {torch.__version__}, load average {os.getloadavg()[0]:.2f}, {a.rounds} changes per N"
          + ("" if len(methods) == 2 else " (no reconfigure API in this torch: rebuild only)"))
    print("| N | rebuild, median (min-max) | reconfigure, median (min-max) | reconfigure / rebuild |")
    print("|---|---|---|---|")
    for size in [int(s) for s in a.sizes.split(",")]:
        res = run(size, a.rounds, methods)
        cells = []
        for m in methods:
            v = res[m]
            cells.append(f"{statistics.median(v) * 1000:.1f} ms ({min(v) * 1000:.1f}-{max(v) * 1000:.1f})")
        if len(methods) == 1:
            cells.append("-")
        ratio = (f"{statistics.median(res['reconfigure']) / statistics.median(res['rebuild']):.2f}x"
                 if len(methods) == 2 else "-")
        print(f"| {size} | {cells[0]} | {cells[1]} | {ratio} |", flush=True)


if __name__ == "__main__":
    main()
