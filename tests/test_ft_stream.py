"""ft.DataLoader over a stream: each replica reads its own shard, every sample of every shard
trained exactly once among committed steps whatever fails (the counter model of
tests/ft_stream_worker.py), and what becomes of a given-up replica's shard. Real CLI, real SIGKILL."""

from __future__ import annotations

import os

import pytest

from conftest import ROOT, start_ftrun
from helpers import finish, needs, read_reports
from test_ft_data import _kill_at

WORKER = ROOT / "tests" / "ft_stream_worker.py"
os.environ["HF_HUB_OFFLINE"] = "1"  # nothing from a hub: the Hugging Face stream is built from a local generator
os.environ["HF_DATASETS_OFFLINE"] = "1"


def _train_killing(home, tmp_path, run_id, args, plan, restarts):
    """3 replicas of the stream worker, killed by `plan` (see _kill_at), to the end: (exit status, stderr, --out)."""
    out = tmp_path / "o"
    proc = start_ftrun(["--nproc", 3, "--ft", "--max-restarts", restarts, "--run-id", run_id, WORKER, 2, out, *args],
                       files=("stderr",))
    try:
        _kill_at(home, run_id, proc, plan, after_heals=True)
        rc, err = finish(proc, 300)
    finally:
        proc.kill()
    return rc, err, out


@pytest.mark.parametrize("loader", ["iterable", "stateful", pytest.param("datasets", marks=needs("datasets"))])
def test_shards_heal_and_a_given_up_replicas_shard_is_read_on(ftrun_home, tmp_path, loader):
    """The shards given as a list (IterableDatasets, or loaders with state_dict() as torchdata's
    StatefulDataLoader), or a Hugging Face streaming dataset that ftrun splits (datasets is a
    test-only dependency, installed by scripts/test.sh; skipped where it is not), 3 replicas, 2 passes: replica 1 killed mid-step (in the sleep between
    backward and opt.step(), its peers' exchange fails and the step is redone with the same
    batches), replica 2 likewise later, then replica 1 again with its budget spent: it is given
    up, and a peer reads its shard on from its committed position, said in one line. Every
    weight ends at exactly -2 (each sample once a pass), the two replicas' states identical."""
    size = 360  # 30 steps a pass: the last kill leaves shard 1 samples to read on however late it lands
    if loader == "datasets":
        size = 960  # a restarted replica imports datasets: a longer run, to be killed again after it
    rc, err, out = _train_killing(ftrun_home, tmp_path, f"stream-{loader}",
                                  ["--loader", loader, "--shards", "list", "--size", size, "--batch", 4, "--step-sleep", 0.05],
                                  [(1, 3), (2, 9), (1, 14)], restarts=1)
    assert rc == 137, err[-3000:]  # the given-up replica's status
    assert "carrying on with 2 replicas" in err, err[-3000:]
    assert "reads shard 1 of the stream on, where replica 1 left it (replica 1 is away" in err, err[-3000:]
    reports = read_reports(out, (0, 2))
    for r, rep in reports.items():
        assert rep["weights"] == [-2.0] * size, (r, [(i, w) for i, w in enumerate(rep["weights"]) if w != -2][:20])
    assert reports[0]["state"] == reports[2]["state"] and reports[0]["step"] == reports[2]["step"]
    assert reports[0]["redone"] >= 1  # a kill mid-step voted a step down: its batches were given again


def test_a_given_up_replicas_own_shard_is_skipped_and_said(ftrun_home, tmp_path):
    """Each replica's dataset reads its own shard (by its replica id, as a torchrun script splits by
    RANK), so no peer can read another's: replica 1 given up mid-pass, the pass ends without the
    rest of its shard, said in one line; the other shards are trained exactly once a pass, and of
    shard 1 just what committed steps took before the kill, once (a prefix of it, in pass 0)."""
    size = 240
    rc, err, out = _train_killing(ftrun_home, tmp_path, "stream-own",
                                  ["--shards", "own", "--size", size, "--batch", 4, "--step-sleep", 0.05], [(1, 6)], restarts=0)
    assert rc == 137, err[-3000:]
    assert "pass 0 over the stream ends without the rest of shard 1: its replica was away" in err, err[-3000:]
    reports = read_reports(out, (0, 2))
    for r, rep in reports.items():
        w = rep["weights"]
        assert all(w[i] == -2.0 for i in range(size) if i % 3 != 1), (r, w)
        mine = [w[i] for i in range(1, size, 3)]
        trained = mine.count(-1.0)
        assert trained >= 4 * 5 and mine == [-1.0] * trained + [0.0] * (len(mine) - trained), (r, mine)
    assert reports[0]["state"] == reports[2]["state"]
