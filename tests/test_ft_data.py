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

from conftest import ROOT, run_ftrun, start_ftrun
from helpers import finish, read_reports, wait_replica

WORKER = ROOT / "tests" / "ft_data_worker.py"


def _assert_each_sample_once(reports, epochs: int, size: int):
    for r, rep in reports.items():
        assert rep["weights"] == [-float(epochs)] * size, (r, [i for i, w in enumerate(rep["weights"])
                                                                if w != -epochs][:20])


def _finishers_reports(out, err: str, ranks) -> dict:
    """The reports of `ranks` after a run with kills. A replica whose last restart came back only
    after the others had finished writes none: it exits at once, without running the code after
    the loop on its untrained model, and says so (ft/member/stop.py finish_without_peers); any
    other missing report fails. At least one replica trained to the end."""
    written = [r for r in ranks if Path(f"{out}.rank{r}.json").exists()]
    for r in set(ranks) - set(written):
        assert f"rank {r}: the run finished at step" in err, (r, err[-3000:])
    assert written, err[-3000:]
    return read_reports(out, written)


def _others_hold_the_state(rank, st) -> bool:
    """Every replica but `rank` is in the quorum holding the trained state (none is healing)."""
    return all(o["in_quorum"] and not o["healing"] for o in st["replicas"] if o["rank"] != rank)


def _kill_at(home, run_id, proc, plan, after_heals=False):
    """SIGKILL replica r once it has reached step s, for each (r, s) of `plan` in turn; with
    `after_heals`, only once every other replica holds the trained state, so that a kill never
    leaves the run with no holder of it (it would start again from the first step)."""
    killed = []
    for rank, step in plan:
        r = wait_replica(home, run_id, rank, lambda r, st: r["step"] >= step and r["state"] == "running"
                         and r["pid"] not in killed and (not after_heals or _others_hold_the_state(rank, st)), 180, proc)
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
    reports = read_reports(out, range(3))
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


def _kill_run(home, tmp_path, run_id, args, plan, extra=(), after_heals=False):
    """Run the counter model (args: EPOCHS, then its options) with 3 replicas, killing by `plan`."""
    out = tmp_path / "o"
    proc = start_ftrun(["--nproc", 3, "--ft", "--max-restarts", 5, "--run-id", run_id, *extra, WORKER, args[0], out,
                        *args[1:]], files=("stderr",))
    try:
        _kill_at(home, run_id, proc, plan, after_heals)
        rc, err = finish(proc, 300)
    finally:
        proc.kill()
    return rc, err, out


def test_kills_at_several_moments_train_each_sample_once(ftrun_home, tmp_path):
    """Three replicas, 3 epochs, kills of different replicas early, mid-epoch and at an epoch's
    end (one right after a heal): every weight ends at exactly -3, replicas identical. Each kill
    waits until the others hold the trained state: on a loaded machine rank 1 was once killed
    while ranks 0 and 2 both healed from it, which leaves no holder of the trained state, and the
    run began again from the first step, as it must without --checkpoint-dir."""
    size = 240
    rc, err, out = _kill_run(ftrun_home, tmp_path, "kills", [3, "--size", size, "--batch", 4, "--step-sleep", 0.03],
                             [(1, 3), (2, 19), (1, 21), (0, 40)], after_heals=True)
    assert rc == 0, err[-3000:]
    assert err.count("sent from outside ftrun); restarting it alone") == 4, err[-3000:]
    assert "starting again from the first step" not in err, err[-3000:]
    _assert_each_sample_once(_finishers_reports(out, err, range(3)), 3, size)


def test_dataloader_workers_and_accumulation_under_kills(ftrun_home, tmp_path):
    """num_workers=2 (persistent, prefetching) and two micro-batches a step under no_sync():
    batches prefetched for a membership that changed are never used; exactly once."""
    size = 200
    rc, err, out = _kill_run(ftrun_home, tmp_path, "workers",
                             [2, "--size", size, "--batch", 3, "--workers", 2, "--accumulate", 2,
                              "--step-sleep", 0.03], [(2, 4), (0, 12)])
    assert rc == 0, err[-3000:]
    _assert_each_sample_once(_finishers_reports(out, err, range(3)), 2, size)


def test_whole_run_killed_and_resumed_from_checkpoint(ftrun_home, tmp_path):
    """--checkpoint-dir: the whole run is SIGKILLed mid-epoch (ftrun and every worker), then run
    again: it resumes at the checkpoint's position and trains each sample exactly once an epoch."""
    size, ck, out = 240, tmp_path / "ck", tmp_path / "o"
    args = ["--nproc", 2, "--ft", "--checkpoint-dir", ck, "--checkpoint-every", 7, "--run-id", "first", WORKER, 3,
            out, "--size", size, "--batch", 4, "--step-sleep", 0.03]
    proc = start_ftrun(args, files=("stderr",))
    try:
        wait_replica(ftrun_home, "first", 0, lambda r, st: r["step"] >= 40, 180, proc=proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        proc.kill()
    args[args.index("first")] = "second"
    again = run_ftrun(args, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from checkpoint" in again.stderr, again.stderr[-3000:]
    _assert_each_sample_once(read_reports(out, range(2)), 3, size)


def test_sharded_replicas_each_worker_its_own_batch(ftrun_home, tmp_path):
    """--replica-size 2: both workers of a replica get batches of their own (FSDP is data parallel
    inside a replica too); a replica killed mid-run: exactly once."""
    size, out = 160, tmp_path / "o"
    proc = start_ftrun(["--nproc", 4, "--ft", "--replica-size", 2, "--run-id", "shard", WORKER, 2, out,
                        "--size", size, "--batch", 2, "--step-sleep", 0.03], files=("stderr",))
    try:
        _kill_at(ftrun_home, "shard", proc, [(3, 6)])
        rc, err = finish(proc, 300)
    finally:
        proc.kill()
    assert rc == 0, err[-3000:]
    reports = read_reports(out, range(4))
    _assert_each_sample_once(reports, 2, size)
    first = [set(idx) for _, idx, _ in reports[0]["drawn"][:1]] + [set(idx) for _, idx, _ in reports[1]["drawn"][:1]]
    assert not first[0] & first[1], first  # the replica's two workers trained different samples


def test_step_loop_with_a_loader_resumes_its_position(ftrun_home, tmp_path):
    """An ft.steps() loop that takes its batches from an ft.DataLoader (a new pass at each
    epoch's end), two micro-batches a step, under a kill: the steps train each sample of every
    full epoch exactly once."""
    size, out = 120, tmp_path / "o"
    # 240 steps x 2 micro x 3 workers x 2 = 2,880 samples: 24 epochs of 120 at full membership (long
    # enough that a loaded restart is back before the others finish)
    steps = 240
    proc = start_ftrun(["--nproc", 3, "--ft", "--run-id", "steps", WORKER, 0, out, "--size", size, "--batch", 2,
                        "--accumulate", 2, "--style", "steps", "--steps", steps, "--step-sleep", 0.03], files=("stderr",))
    try:
        _kill_at(ftrun_home, "steps", proc, [(1, 10)])
        rc, err = finish(proc, 300)
    finally:
        proc.kill()
    assert rc == 0, err[-3000:]
    reports = read_reports(out, range(3))
    weights = reports[0]["weights"]
    full = -min(weights)  # every sample of the epochs completed, once each; the one under way, partly
    assert set(weights) <= {-full, -(full - 1)} and full >= 5, sorted(set(weights))
    assert len({json.dumps(r["weights"]) for r in reports.values()}) == 1


def test_a_hung_replica_is_replaced_and_each_sample_trained_once(ftrun_home, tmp_path):
    """A replica SIGSTOPped mid-epoch (a hang): the default rule (shortened to 3 s) names it,
    kills it, it heals; the steps its peers discarded meanwhile give their batches again."""
    size, out = 180, tmp_path / "o"
    proc = start_ftrun(["--nproc", 3, "--ft", "--run-id", "hang", WORKER, 2, out, "--size", size, "--batch", 3,
                        "--step-sleep", 0.03], env={"FTRUN_HANG_AFTER_S": "3", "FTRUN_FT_TIMEOUT": "2"}, files=("stderr",))
    try:
        r = wait_replica(ftrun_home, "hang", 2, lambda r, st: r["step"] >= 8 and r["state"] == "running", 180,
                         proc=proc)
        os.kill(r["pid"], signal.SIGSTOP)
        rc, err = finish(proc, 300)
    finally:
        proc.kill()
    assert rc == 0, err[-3000:]
    assert "rank 2 (pid" in err and "is hung" in err, err[-3000:]
    _assert_each_sample_once(_finishers_reports(out, err, range(3)), 2, size)


def test_store_host_node_lost_each_sample_trained_once(ftrun_home, tmp_path):
    """Three nodes (one replica each); node 0, which hosts the run's store, is SIGKILLed with its
    worker mid-epoch: the store moves, the two survivors rejoin and go on from the newest whole
    step, and every sample of every epoch is trained exactly once by them."""
    from conftest import free_port
    from test_store_moves import _kill_tree

    size, out, port = 240, tmp_path / "o", free_port()
    procs = {k: start_ftrun(["--nnodes", 3, "--node-rank", k, "--master-addr", "127.0.0.1", "--master-port", port,
                             "--nproc", 1, "--ft", "--run-id", "nodes", WORKER, 2, out, "--size", size, "--batch", 4,
                             "--step-sleep", 0.03], env={"FTRUN_NODE_TIMEOUT": "2"}, files=("stderr",)) for k in (2, 1, 0)}
    try:
        wait_replica(ftrun_home, "nodes.node1", 1, lambda r, st: r["step"] >= 12 and r["state"] == "running", 180,
                     procs[1])
        _kill_tree(procs[0])
        results = {k: finish(procs[k], 300) for k in (1, 2)}
    finally:
        for p in procs.values():
            p.kill()
    for k, (rc, err) in results.items():
        assert rc == 0, (k, err[-3000:])
        assert "moving the run's store" in err, err[-3000:]
    _assert_each_sample_once(read_reports(out, (1, 2)), 2, size)


@pytest.mark.parametrize("bad, says", [
    ("loader", "a loader given in place of the dataset must say where it is"),
    ("sampler", "ft.DataLoader(sampler=SequentialSampler(...)): ft.DataLoader orders an epoch as"),
    ("batch", "ft.DataLoader(batch_size=0)"),
    ("outside", "an ft.DataLoader was iterated outside an ftrun.ft loop"),
])
def test_what_ft_dataloader_cannot_serve_is_one_line(ftrun_home, tmp_path, bad, says):
    """A plain DataLoader given in place of the dataset, a sampler of the script's own, a bad batch size, a loader iterated
    outside ft.epochs()/ft.steps(): one line naming the fix, the run stopped (exit 2), no traceback."""
    script = tmp_path / "bad.py"
    script.write_text(f"""
import torch, ftrun.ft as ft
from torch.utils.data import IterableDataset, TensorDataset, SequentialSampler
data = TensorDataset(torch.arange(10.0))
class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(10))
bad = {bad!r}
if bad == "loader":
    ft.DataLoader(torch.utils.data.DataLoader(Stream(), batch_size=2))
elif bad == "sampler":
    ft.DataLoader(data, batch_size=2, sampler=SequentialSampler(data))
elif bad == "batch":
    ft.DataLoader(data, batch_size=0)
else:
    for x in ft.DataLoader(data, batch_size=2):
        pass
""")
    proc = run_ftrun(["--nproc", 2, "--ft", script], timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert says in proc.stderr and "stopping the run (exit 2)" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_dataloader_arguments_work(ftrun_home, tmp_path):
    """collate_fn, pin_memory, drop_last, prefetch_factor, persistent_workers and num_workers reach
    torch's DataLoader: the collated batches come back as the collate_fn made them, drop_last
    leaves out the epoch's tail, len() counts what a pass gives."""
    script = tmp_path / "args.py"
    script.write_text("""
import json, os, sys, torch, ftrun.ft as ft
from torch.utils.data import TensorDataset
data = TensorDataset(torch.arange(50.0))
def collate(items):
    return {"x": torch.stack([x for (x,) in items]), "n": len(items)}
loader = ft.DataLoader(data, batch_size=4, shuffle=False, drop_last=True, num_workers=2, pin_memory=True,
                       prefetch_factor=3, persistent_workers=True, collate_fn=collate)
ddp = ft.DistributedDataParallel(torch.nn.Linear(1, 1))
opt = ft.Optimizer(torch.optim.SGD(ddp.parameters(), lr=0.0))
seen, lens = [], []
for epoch in ft.epochs(2):
    lens.append(len(loader))
    for b in loader:
        seen.append([b["n"], b["x"].tolist()])
        ddp(b["x"][:, None]).sum().backward()
        opt.step()
json.dump({"seen": seen, "lens": lens}, open(sys.argv[1] + "." + os.environ["RANK"], "w"))
""")
    out = tmp_path / "seen"
    proc = run_ftrun(["--nproc", 2, "--ft", script, out], timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for r in range(2):
        got = json.loads(Path(f"{out}.{r}").read_text())
        assert got["lens"] == [6, 6], got["lens"]  # 50 samples, 2 x 4 a step, the tail of 2 dropped
        assert [n for n, _ in got["seen"]] == [4] * 12
        first = [x for n, xs in got["seen"][:6] for x in xs]
        assert first == [float(i) for i in range(r, 48, 2)], first
