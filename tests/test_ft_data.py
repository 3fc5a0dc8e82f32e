"""ft.DataLoader and ft.epochs(): every sample of an epoch trained exactly once in committed
steps, whatever fails (the counter model of tests/ft_data_worker.py), and failure-free batches
identical to DistributedSampler + DataLoader's. Real CLI, real SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from conftest import ROOT, run_ftrun
from test_ft import _finish, _wait_replica, start_ftrun

WORKER = ROOT / "tests" / "ft_data_worker.py"


def _reports(out: Path, ranks):
    return {r: json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in ranks}


def _assert_each_sample_once(reports, epochs: int, size: int):
    for r, rep in reports.items():
        assert rep["weights"] == [-float(epochs)] * size, (r, [i for i, w in enumerate(rep["weights"])
                                                                if w != -epochs][:20])


def _kill_at(home, run_id, proc, plan):
    """SIGKILL replica r once it has reached step s, for each (r, s) of `plan` in turn."""
    killed = []
    for rank, step in plan:
        r = _wait_replica(home, run_id, rank, lambda r, st: r["step"] >= step and r["state"] == "running"
                          and r["pid"] not in killed, 180)
        os.kill(r["pid"], signal.SIGKILL)
        killed.append(r["pid"])
    return killed


@pytest.mark.quick
def test_failure_free_batches_are_distributed_samplers(ftrun_home, tmp_path):
    """No failure: every rank draws exactly the batches DistributedSampler(shuffle=True, seed=3)
    and a DataLoader give it under torchrun, epoch after epoch; the tail is split without the
    padding DistributedSampler repeats."""
    out, size, batch = tmp_path / "o", 103, 4
    proc = run_ftrun(["--nproc", 3, "--ft", WORKER, 2, out, "--size", size, "--batch", batch], timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = _reports(out, range(3))
    _assert_each_sample_once(reports, 2, size)
    data = list(range(size))
    for r, rep in reports.items():
        ours = [idx for _, idx, _ in rep["drawn"]]
        for epoch in range(2):
            sampler = DistributedSampler(data, num_replicas=3, rank=r, shuffle=True, seed=3)
            sampler.set_epoch(epoch)
            theirs = [b.tolist() for b in DataLoader(data, batch_size=batch, sampler=sampler)]
            mine, ours = ours[:len(theirs)], ours[len(theirs):]
            assert mine[:-1] == theirs[:-1], (r, epoch, mine, theirs)
            # The epoch's last batch: DistributedSampler's, less the samples it repeats as padding.
            assert mine[-1] == theirs[-1][:len(mine[-1])] and len(mine[-1]) >= 1, (r, epoch, mine[-1], theirs[-1])
        assert not ours


def _kill_run(home, tmp_path, run_id, args, plan, extra=()):
    """Run the counter model (args: EPOCHS, then its options) with 3 replicas, killing by `plan`."""
    out = tmp_path / "o"
    proc = start_ftrun(["--nproc", 3, "--ft", "--max-restarts", 5, "--run-id", run_id, *extra, WORKER, args[0], out,
                        *args[1:]])
    try:
        _kill_at(home, run_id, proc, plan)
        rc, _, err = _finish(proc, 300)
    finally:
        proc.kill()
    return rc, err, out


def test_kills_at_several_moments_train_each_sample_once(ftrun_home, tmp_path):
    """Three replicas, 3 epochs, kills of different replicas early, mid-epoch and at an epoch's
    end (one right after a heal): every weight ends at exactly -3, replicas identical."""
    size = 240
    rc, err, out = _kill_run(ftrun_home, tmp_path, "kills", [3, "--size", size, "--batch", 4, "--step-sleep", 0.03],
                             [(1, 3), (2, 19), (1, 21), (0, 40)])
    assert rc == 0, err[-3000:]
    assert err.count("restarting it alone") == 4, err[-3000:]
    _assert_each_sample_once(_reports(out, range(3)), 3, size)


def test_dataloader_workers_and_accumulation_under_kills(ftrun_home, tmp_path):
    """num_workers=2 (persistent, prefetching) and two micro-batches a step under no_sync():
    batches prefetched for a membership that changed are never used; exactly once."""
    size = 200
    rc, err, out = _kill_run(ftrun_home, tmp_path, "workers",
                             [2, "--size", size, "--batch", 3, "--workers", 2, "--accumulate", 2,
                              "--step-sleep", 0.03], [(2, 4), (0, 12)])
    assert rc == 0, err[-3000:]
    _assert_each_sample_once(_reports(out, range(3)), 2, size)


def test_whole_run_killed_and_resumed_from_checkpoint(ftrun_home, tmp_path):
    """--checkpoint-dir: the whole run is SIGKILLed mid-epoch (ftrun and every worker), then run
    again: it resumes at the checkpoint's position and trains each sample exactly once an epoch."""
    size, ck, out = 240, tmp_path / "ck", tmp_path / "o"
    args = ["--nproc", 2, "--ft", "--checkpoint-dir", ck, "--checkpoint-every", 7, "--run-id", "first", WORKER, 3,
            out, "--size", size, "--batch", 4, "--step-sleep", 0.03]
    proc = start_ftrun(args)
    try:
        _wait_replica(ftrun_home, "first", 0, lambda r, st: r["step"] >= 40, 180)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        proc.kill()
    args[args.index("first")] = "second"
    again = run_ftrun(args, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from checkpoint" in again.stderr, again.stderr[-3000:]
    _assert_each_sample_once(_reports(out, range(2)), 3, size)


def test_sharded_replicas_each_worker_its_own_batch(ftrun_home, tmp_path):
    """--replica-size 2: both workers of a replica get batches of their own (FSDP is data parallel
    inside a replica too); a replica killed mid-run: exactly once."""
    size, out = 160, tmp_path / "o"
    proc = start_ftrun(["--nproc", 4, "--ft", "--replica-size", 2, "--run-id", "shard", WORKER, 2, out,
                        "--size", size, "--batch", 2, "--step-sleep", 0.03])
    try:
        _kill_at(ftrun_home, "shard", proc, [(3, 6)])
        rc, _, err = _finish(proc, 300)
    finally:
        proc.kill()
    assert rc == 0, err[-3000:]
    reports = _reports(out, range(4))
    _assert_each_sample_once(reports, 2, size)
    first = [set(idx) for _, idx, _ in reports[0]["drawn"][:1]] + [set(idx) for _, idx, _ in reports[1]["drawn"][:1]]
    assert not first[0] & first[1], first  # the replica's two workers trained different samples


def test_step_loop_with_a_loader_resumes_its_position(ftrun_home, tmp_path):
    """An ft.steps() loop that takes its batches from an ft.DataLoader (a new pass at each
    epoch's end), two micro-batches a step, under a kill: the steps train each sample of every
    full epoch exactly once."""
    size, out = 120, tmp_path / "o"
    steps = 60  # 60 steps x 2 micro x 3 workers x 2 = 720 samples: 6 epochs of 120 at full membership
    proc = start_ftrun(["--nproc", 3, "--ft", "--run-id", "steps", WORKER, 0, out, "--size", size, "--batch", 2,
                        "--accumulate", 2, "--style", "steps", "--steps", steps, "--step-sleep", 0.03])
    try:
        _kill_at(ftrun_home, "steps", proc, [(1, 10)])
        rc, _, err = _finish(proc, 300)
    finally:
        proc.kill()
    assert rc == 0, err[-3000:]
    reports = _reports(out, range(3))
    weights = reports[0]["weights"]
    full = -min(weights)  # every sample of the epochs completed, once each; the one under way, partly
    assert set(weights) <= {-full, -(full - 1)} and full >= 5, sorted(set(weights))
    assert len({json.dumps(r["weights"]) for r in reports.values()}) == 1
