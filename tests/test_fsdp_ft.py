"""--ft with sharded replicas (--replica-size K, FSDP2 inside each replica) through the real CLI.

Real processes, real SIGKILL/SIGSTOP, gloo on CPU, a model of 100 MB of
state (8.4M parameters with AdamW) where the guarantee is about size: a
killed worker takes exactly its replica down and back up, the others keep
training, every shard ends bitwise identical across replicas, and a
failure-free run computes exactly what plain torch HSDP computes.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import psutil
import pytest
import torch

from conftest import SCRIPTS, free_port, run_ftrun, start_ftrun
from helpers import finish, read_reports, read_state, replica, wait_replica, wait_state

TRAIN = SCRIPTS / "train_fsdp_ft.py"
# 8.4M parameters with AdamW: 101 MB of parameters and optimizer state per replica.
BIG = ["--dim", 512, "--hidden", 2048, "--blocks", 4]
SMALL = ["--dim", 64, "--hidden", 128, "--blocks", 2]
# 1M parameters with AdamW: 6 MB of state per worker, several 1 MB chunks to send (FTRUN_FT_CHUNK_MB=1).
MID = ["--dim", 256, "--hidden", 1024, "--blocks", 2]


def _shards(out: Path, rank: int) -> dict:
    return torch.load(f"{out}.rank{rank}.pt", weights_only=True)


def _assert_shards_identical(out: Path, replicas: int, k: int) -> None:
    """Worker j of every replica holds the same shard j: parameters and AdamW state, bitwise."""
    for j in range(k):
        ref = _shards(out, j)
        assert ref["optim"], "no optimizer state was written"
        for rep in range(1, replicas):
            other = _shards(out, rep * k + j)
            for name, t in ref["model"].items():
                assert torch.equal(t, other["model"][name]), f"replica {rep} shard {j}: parameter {name} differs"
            assert ref["optim"].keys() == other["optim"].keys()
            for idx, st in ref["optim"].items():
                for name, t in st.items():
                    assert torch.equal(t, other["optim"][idx][name]), \
                        f"replica {rep} shard {j}: optimizer state {idx}.{name} differs"
    steps = {rep["step"] for rep in read_reports(out, replicas * k).values()}
    assert len(steps) == 1, steps


def _restarts(home: Path, folder: str) -> dict:
    return {r["rank"]: r["restarts"] for r in read_state(home, folder)["replicas"]}


@pytest.mark.extended
def test_2x2_big_two_kills_only_their_replica_restarts(ftrun_home, tmp_path):
    """2 replicas x 2 workers, 101 MB of state: rank 1 SIGKILLed mid-step, then rank 2 right after
    replica 0 is back (replica 0 is then the source): each time exactly the killed worker's replica
    restarts, the run finishes, and both replicas hold identical shards."""
    out = tmp_path / "p"
    proc = start_ftrun(["--nproc", 4, "--ft", "--replica-size", 2, "--run-id", "big", TRAIN, *BIG, "--steps", 36,
                   "--out", out], files=("stderr",))
    try:
        r = wait_replica(ftrun_home, "big", 1, lambda r, st: r["step"] >= 6 and r["state"] == "running", 120, proc)
        os.kill(r["pid"], signal.SIGKILL)
        wait_state(ftrun_home, "big", lambda st: all(replica(st, i)["restarts"] == 1 and replica(st, i)["state"]
                                                     == "running" for i in (0, 1)), 120, "replica 0 back", proc)
        r = wait_replica(ftrun_home, "big", 2, lambda r, st: r["state"] == "running", 120, proc)
        os.kill(r["pid"], signal.SIGKILL)
        rc, err = finish(proc, 300)
    finally:
        proc.kill()
    assert rc == 0, err[-3000:]
    assert _restarts(ftrun_home, "big") == {0: 1, 1: 1, 2: 1, 3: 1}
    assert err.count("restarting its replica (2 workers") == 2, err[-3000:]
    assert "rank 1 of replica 0 (pid" in err and "rank 2 of replica 1 (pid" in err, err[-3000:]
    # Every shard of the restarted replica came from the other replica, in place.
    logs = {r: (ftrun_home / "big" / "logs" / f"rank{r}" / "stderr.log").read_text() for r in range(4)}
    assert "MB of state from rank 2" in logs[0] and "MB of state from rank 3" in logs[1]
    assert "MB of state from rank 0" in logs[2] and "MB of state from rank 1" in logs[3]
    _assert_shards_identical(out, 2, 2)


def test_3x2_source_killed_mid_transfer(ftrun_home, tmp_path):
    """3 replicas x 2 workers: replica 0 is killed; while replica 1 sends it its shards (held open
    by an injected delay), a worker of replica 1 is killed too. Replica 0 heals from replica 2,
    replica 1 restarts and heals, replica 2 never restarts, and all three end identical."""
    out = tmp_path / "p"
    proc = start_ftrun(["--nproc", 6, "--ft", "--replica-size", 2, "--run-id", "six", TRAIN, *MID, "--steps", 60,
                   "--out", out], env={"FTRUN_FT_INJECT_SEND_DELAY": "1.5", "FTRUN_FT_CHUNK_MB": "1"}, files=("stderr",
                                                                                                              ))
    try:
        r = wait_replica(ftrun_home, "six", 0, lambda r, st: r["step"] >= 10 and r["state"] == "running", 120, proc)
        os.kill(r["pid"], signal.SIGKILL)
        r = wait_replica(ftrun_home, "six", 3, lambda r, st: r.get("ft_phase") == "send", 60, proc)
        os.kill(r["pid"], signal.SIGKILL)
        rc, err = finish(proc, 300)
    finally:
        proc.kill()
    assert rc == 0, err[-3000:]
    assert _restarts(ftrun_home, "six") == {0: 1, 1: 1, 2: 1, 3: 1, 4: 0, 5: 0}
    logs = {r: (ftrun_home / "six" / "logs" / f"rank{r}" / "stderr.log").read_text() for r in range(2)}
    assert "state transfer from rank 3 failed" in logs[1], logs[1][-2000:]
    assert "MB of state from rank 5" in logs[1], logs[1][-2000:]  # then from replica 2
    _assert_shards_identical(out, 3, 2)


@pytest.mark.extended
@pytest.mark.quick
def test_failure_free_equals_plain_hsdp(ftrun_home, tmp_path):
    """The exact average: --ft --replica-size 2 and plain torch HSDP (a 2-D replicate x shard mesh,
    same data and seeds) give the same losses over 50 steps and the same final shards."""
    ours, ref = tmp_path / "ft", tmp_path / "hsdp"
    a = run_ftrun(["--nproc", 4, "--ft", "--replica-size", 2, TRAIN, *SMALL, "--steps", 50, "--out", ours],
                  timeout=180)
    assert a.returncode == 0, a.stderr[-3000:]
    b = run_ftrun(["--nproc", 4, TRAIN, *SMALL, "--steps", 50, "--hsdp-reference", 2, "--out", ref], timeout=180)
    assert b.returncode == 0, b.stderr[-3000:]
    for r in range(4):
        la = json.loads(Path(f"{ours}.rank{r}.json").read_text())["losses"]
        lb = json.loads(Path(f"{ref}.rank{r}.json").read_text())["losses"]
        assert [s for s, _ in la] == list(range(50)) == [s for s, _ in lb]
        for (s, x), (_, y) in zip(la, lb):
            assert abs(x - y) <= 1e-5 * max(1.0, abs(y)), (r, s, x, y)
        sa, sb = _shards(ours, r), _shards(ref, r)
        for name, t in sa["model"].items():
            torch.testing.assert_close(t, sb["model"][name], rtol=1e-5, atol=1e-6)


@pytest.mark.extended
def test_sigstopped_worker_restarts_only_its_replica(ftrun_home, tmp_path):
    """No flag (the default rule, its 60 s shortened to 3): a SIGSTOPped worker is found hung, and
    only its replica restarts; its mate and the other replica wait for it, but are not stopped."""
    out = tmp_path / "p"
    proc = start_ftrun(["--nproc", 4, "--ft", "--replica-size", 2, "--run-id", "stop", TRAIN,
                   *SMALL, "--steps", 150, "--out", out], env={"FTRUN_HANG_AFTER_S": "3", "FTRUN_FT_TIMEOUT": "2"}, files=("stderr",))
    try:
        r = wait_replica(ftrun_home, "stop", 3, lambda r, st: r["step"] >= 10 and r["state"] == "running", 120, proc)
        os.kill(r["pid"], signal.SIGSTOP)
        rc, err = finish(proc, 300)
    finally:
        proc.kill()
    assert rc == 0, err[-3000:]
    assert "rank 3 (pid" in err and "is hung (its process was stopped for 3 s)" in err, err[-3000:]
    assert _restarts(ftrun_home, "stop") == {0: 0, 1: 0, 2: 1, 3: 1}, err[-4000:]
    _assert_shards_identical(out, 2, 2)


@pytest.mark.extended
def test_node_lost_with_a_replica_per_node(ftrun_home, tmp_path):
    """Two nodes over loopback, one replica of 2 workers per node: node 1's whole ftrun tree is
    SIGKILLed; node 0 carries on without it and finishes."""
    port = free_port()
    out = tmp_path / "p"
    procs = [start_ftrun(["--nnodes", 2, "--node-rank", k, "--master-addr", "127.0.0.1", "--master-port", port,
                     "--nproc", 2, "--ft", "--replica-size", 2, "--run-id", "nodes", TRAIN, *SMALL,
                     "--steps", 200, "--out", out], env={"FTRUN_NODE_TIMEOUT": "2"}, files=("stderr",)) for k in (0, 1)]
    try:
        wait_replica(ftrun_home, "nodes.node1", 3, lambda r, st: r["step"] >= 20 and r["state"] == "running", 120,
                     procs[1])
        step_at_kill = wait_replica(ftrun_home, "nodes.node0", 0, lambda r, st: r["step"] >= 20, 120, procs[0])["step"]
        tree = [procs[1].pid] + [c.pid for c in psutil.Process(procs[1].pid).children(recursive=True)]
        for pid in tree:
            os.kill(pid, signal.SIGKILL)
        wait_replica(ftrun_home, "nodes.node0", 0, lambda r, st: st["quorum_size"] == 2 and r["step"] > step_at_kill + 5,
                     30, procs[0])
        rc, err = finish(procs[0], 300)
    finally:
        for p in procs:
            p.kill()
    assert rc == 0, err[-3000:]
    assert "node 1" in err and "carrying on without its replicas" in err, err[-3000:]
    assert json.loads(Path(f"{out}.rank0.json").read_text())["step"] == 200


def test_restarted_replica_with_another_layout_says_why(ftrun_home, tmp_path):
    """A restarted replica that builds a different model cannot take its peer's shards: one line
    naming the mismatch, and it exits instead of retrying for ever."""
    script = tmp_path / "other_layout.py"
    script.write_text(
        "import os, sys, runpy\n"
        "if os.environ['TORCHELASTIC_RESTART_COUNT'] != '0':\n"
        "    sys.argv += ['--hidden', '96']\n"
        "elif os.environ['RANK'] == '3':\n"
        "    import threading; threading.Timer(4.0, lambda: os._exit(9)).start()\n"
        f"sys.argv[0] = {str(TRAIN)!r}\n"
        f"runpy.run_path({str(TRAIN)!r}, run_name='__main__')\n")
    proc = run_ftrun(["--nproc", 4, "--ft", "--replica-size", 2, "--max-restarts", 1, "--min-replicas", 2, script,
                      *SMALL, "--steps", 100000], timeout=180)
    assert proc.returncode != 0
    assert "do not fit this worker's shard" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in "\n".join(l for l in proc.stderr.splitlines() if "cannot take the state" in l)


@pytest.mark.quick
@pytest.mark.parametrize("args, message", [
    (["--nproc", 3, "--ft", "--replica-size", 2], "does not divide the 3 workers"),
    (["--nproc", 2, "--ft", "--replica-size", 4], "spanning several nodes is not supported"),
    (["--nproc", 4, "--replica-size", 2], "applies only to --ft"),
    (["--nproc", 4, "--ft", "--replica-size", 2, "--hook", "powersgd"], "needs DDP's buckets"),
    (["--nproc", 4, "--ft", "--replica-size", 0], "--replica-size must be"),
])
def test_bad_replica_size_is_one_line(ftrun_home, args, message):
    proc = run_ftrun([*args, TRAIN], timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and message in lines[0], proc.stderr


def test_fsdp_replicas_of_one_worker_heal(ftrun_home, tmp_path):
    """FSDP2 with --replica-size 1 (the default): ft.device_mesh() makes the replica's own group
    with torch's init_process_group, not the script's wrapped one that a restarted replica skips,
    so a killed replica heals (it once waited for ever for a group of every worker). Nothing says
    the script called init_process_group(): it did not."""
    out = tmp_path / "p"
    proc = start_ftrun(["--nproc", 2, "--ft", "--run-id", "one", TRAIN, *MID, "--steps", 80, "--out", out],
                       files=("stderr",))
    try:
        r = wait_replica(ftrun_home, "one", 1, lambda r, st: r["step"] >= 20 and r["state"] == "running", 120, proc)
        os.kill(r["pid"], signal.SIGKILL)
        rc, err = finish(proc, 180)
    finally:
        proc.kill()
    assert rc == 0, err[-3000:]
    assert "rank 1 is training again, healed from a peer" in err, err[-3000:]
    assert "called init_process_group()" not in err, err[-3000:]
    _assert_shards_identical(out, 2, 1)
