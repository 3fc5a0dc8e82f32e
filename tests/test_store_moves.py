"""No single point of failure under --ft: the run's store moves when the node hosting it is lost.

Three ftrun processes act as three nodes over loopback (or network namespaces the test
creates). The store host's whole process tree is SIGKILLed mid-run: the two others agree on
a new host, their replicas keep their state, rejoin, heal from the one holding the newest
step, commit again within seconds and finish bitwise identical. A node cut off from the
others never forms a second run.
"""

from __future__ import annotations

import os
import signal
import time

import psutil

from conftest import free_port
from test_ft import MID, TRAIN, _assert_identical, _finish, _rank_log, _wait_replica, start_ftrun


def _three_nodes(port, run_id, out, steps, extra=(), env=None, nproc=1):
    env = {"FTRUN_NODE_TIMEOUT": "2", **(env or {})}
    return {k: start_ftrun(["--nnodes", 3, "--node-rank", k, "--master-addr", "127.0.0.1", "--master-port", port,
                            "--nproc", nproc, "--ft", "--run-id", run_id, *extra, TRAIN, "--steps", steps,
                            "--step-sleep", 0.02, *MID, "--out", out], env=env) for k in (2, 1, 0)}


def _kill_tree(proc) -> None:
    """SIGKILL an ftrun and everything it started, at once: the node is gone."""
    family = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    for pid in family:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_store_host_lost_the_others_go_on(ftrun_home, tmp_path):
    """--ft on three nodes; node 0 (the store and the keeper) is SIGKILLed with its workers: nodes
    1 and 2 move the store to node 1, commit again within 20 s, and end bitwise identical."""
    out = tmp_path / "p"
    procs = _three_nodes(free_port(), "mv", out, 400)
    try:
        for k in (1, 2):
            _wait_replica(ftrun_home, f"mv.node{k}", k, lambda r, st: r["step"] >= 30 and r["state"] == "running", 120)
        r = _wait_replica(ftrun_home, "mv.node1", 1, lambda r, st: True, 10)
        _kill_tree(procs[0])
        killed_at, step_at_kill = time.time(), r["step"]
        _wait_replica(ftrun_home, "mv.node1", 1, lambda r, st: r["step"] > step_at_kill + 10, 30)
        resumed_s = time.time() - killed_at
        results = {k: _finish(procs[k], 180) for k in (1, 2)}
    finally:
        for p in procs.values():
            p.kill()
    for k, (rc, _, err) in results.items():
        assert rc == 0, (k, err[-4000:])
        assert "moving the run's store" in err and "node 1 hosts the run's store now" in err, err[-3000:]
    assert resumed_s < 20, resumed_s
    for k in (1, 2):
        log = _rank_log(ftrun_home, f"mv.node{k}", k)
        assert "the run's store moved to" in log and "restarting" not in log, log[-2000:]
    _, stats = _assert_identical(out, [1, 2])
    assert stats["step"] == 400
    print(f"committing again {resumed_s:.1f} s after the store host was killed")
