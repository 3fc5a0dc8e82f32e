"""c10d rendezvous: the same command line on every node, ranks assigned at join, elastic re-formation.

Several ftruns on loopback act as nodes. torchrun runs the same lines as the oracle:
the workers (tiny scripts, no torch) dump their environment, and every worker's
ranks, sizes, role, MASTER_ADDR and restart count must match torchrun's.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import free_port, listening, wait_for_line
from helpers import wait_for

BIN = Path(sys.executable).parent
LAUNCHERS = {"ftrun": [str(BIN / "ftrun")], "torchrun": [str(BIN / "torchrun")]}
KEYS = ("RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE GROUP_RANK GROUP_WORLD_SIZE ROLE_NAME ROLE_RANK "
        "ROLE_WORLD_SIZE MASTER_ADDR TORCHELASTIC_RESTART_COUNT TORCHELASTIC_MAX_RESTARTS TORCHELASTIC_RUN_ID").split()

# Round 0 waits for a go file (the test's cue); a worker whose round must end on cue exits 1, as a
# training worker does when a collective fails because a peer node went away.
WORKER = """\
import json, os, sys, time
out = os.environ["DUMP_DIR"]
keys = {keys!r}
n = os.environ["TORCHELASTIC_RESTART_COUNT"]
path = os.path.join(out, f"{{n}}.{{os.environ['RANK']}}.json")
with open(path + ".part", "w") as f:  # renamed whole: the test reads a file as soon as it exists
    json.dump({{k: os.environ.get(k) for k in keys}} | {{"argv": sys.argv}}, f)
os.replace(path + ".part", path)
if n == "0" and os.environ.get("HOLD_RANK") == os.environ["RANK"]:  # slow to stop: SIGTERM does nothing
    import signal
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    deadline = time.time() + 120
    while not os.path.exists(os.environ["HOLD_FOR"]) and time.time() < deadline:
        time.sleep(0.05)
    sys.exit(1)
if n == "0" and os.environ.get("WAIT_FOR"):
    deadline = time.time() + 120
    while not os.path.exists(os.environ["WAIT_FOR"]) and time.time() < deadline:
        time.sleep(0.05)
    sys.exit(1)
"""


def _start_nodes(launcher, n, line, tmp_path, out, env_extra=None, wait_port=True):
    """n identical command lines; the first is started alone until it hosts the endpoint."""
    out.mkdir(parents=True, exist_ok=True)
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(keys=KEYS))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC", "OMP_NUM"))}
    env.update(DUMP_DIR=str(out), FTRUN_HOME=str(tmp_path / "home"), **(env_extra or {}))
    port = int(line.split("localhost:")[1].split()[0])
    procs = []
    for i in range(n):
        procs.append(subprocess.Popen(LAUNCHERS[launcher] + line.split() + ["worker.py", "--x", "1"],
                                      cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, start_new_session=True))
        if i == 0 and wait_port:
            wait_for(lambda: listening(port), 60, f"node 0 hosting the endpoint at port {port}", procs[0], poll=0.05)
    return procs


def _wait_all(procs, timeout=150):
    deadline = time.monotonic() + timeout
    results = []
    for p in procs:
        try:
            o, e = p.communicate(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                try:
                    os.killpg(q.pid, signal.SIGKILL)
                except OSError:
                    pass
            raise AssertionError("nodes still running: " + " | ".join(q.communicate()[1][-1500:] for q in procs))
        results.append((p.returncode, e))
    return results


def _dumps(out: Path, restart: int):
    return {int(f.name.split(".")[1]): json.loads(f.read_text()) for f in out.glob(f"{restart}.*.json")}


def _first_dumps(out: Path, count: int):
    """A wait_for predicate: `count` workers of the first round have written their dumps."""
    return lambda: len(list(out.glob("0.*.json"))) >= count


@pytest.mark.parametrize("nodes", [2, pytest.param(3, marks=pytest.mark.quick)])
def test_identical_lines_form_one_run(tmp_path, nodes):
    port = {k: free_port() for k in LAUNCHERS}
    results = {}
    for launcher in (["ftrun", "torchrun"] if nodes == 2 else ["ftrun"]):
        line = (f"--nnodes={nodes} --nproc-per-node=2 --rdzv-id=job5 --rdzv-backend=c10d "
                f"--rdzv-endpoint=localhost:{port[launcher]}")
        procs = _start_nodes(launcher, nodes, line, tmp_path / launcher, tmp_path / launcher / "out")
        for code, err in _wait_all(procs):
            assert code == 0, err[-3000:]
        results[launcher] = _dumps(tmp_path / launcher / "out", 0)
    ours = results["ftrun"]
    assert sorted(ours) == list(range(2 * nodes))
    for r, d in ours.items():
        assert (d["WORLD_SIZE"], d["GROUP_WORLD_SIZE"], d["LOCAL_WORLD_SIZE"]) == (str(2 * nodes), str(nodes), "2")
        assert (d["GROUP_RANK"], d["LOCAL_RANK"]) == (str(r // 2), str(r % 2))
        assert d["MASTER_ADDR"] == socket.getfqdn() and d["TORCHELASTIC_RUN_ID"] == "job5"
        assert d["argv"][1:] == ["--x", "1"]
    if "torchrun" in results:
        theirs = results["torchrun"]
        assert sorted(theirs) == sorted(ours)
        for r in theirs:
            for k in KEYS + ["argv"]:
                assert ours[r][k] == theirs[r][k], (r, k, ours[r][k], theirs[r][k])


# torchrun's own run of the same lines (the oracle of what ftrun does) is the extended tier's.
@pytest.mark.parametrize("launcher", ["ftrun", pytest.param("torchrun", marks=pytest.mark.extended)])
def test_elastic_nodes_reform_after_a_node_is_killed(tmp_path, launcher):
    """--nnodes 2:3 on three nodes; one node is SIGKILLed (with its workers); the other two re-form with
    world size 2 and finish, as torchrun's do."""
    port = free_port()
    go = tmp_path / "go"
    line = (f"--nnodes=2:3 --nproc-per-node=1 --max-restarts=2 --rdzv-id=el --rdzv-backend=c10d "
            f"--rdzv-endpoint=localhost:{port} --rdzv-conf=last_call_timeout=1")
    out = tmp_path / "out"
    procs = _start_nodes(launcher, 3, line, tmp_path, out, env_extra={"WAIT_FOR": str(go)})
    wait_for(_first_dumps(out, 3), 90, "3 workers' first dumps", procs, poll=0.05)
    first = _dumps(out, 0)
    assert sorted(first) == [0, 1, 2] and {d["WORLD_SIZE"] for d in first.values()} == {"3"}
    os.killpg(procs[2].pid, signal.SIGKILL)  # a node that does not host the store, workers and all
    procs[2].wait(10)
    go.touch()  # the survivors' workers fail, as their collectives would without the lost node
    for code, err in _wait_all(procs[:2]):
        assert code == 0, err[-3000:]
    second = _dumps(out, 1)
    assert sorted(second) == [0, 1], second
    for r, d in second.items():
        assert (d["WORLD_SIZE"], d["GROUP_WORLD_SIZE"], d["GROUP_RANK"], d["TORCHELASTIC_RESTART_COUNT"]) == \
            ("2", "2", str(r), "1"), d
        assert d["TORCHELASTIC_MAX_RESTARTS"] == "2" and d["TORCHELASTIC_RUN_ID"] == "el"


def test_a_signal_while_a_round_ends_to_reform_stops_the_run(tmp_path):
    """Without --ft a failure ends the round and the nodes re-form. A SIGTERM that reaches node 0 while
    it waits for node 1 to end that round (node 1's worker is slow to stop) ends the run: no round 1
    starts (it was lost when it came between the round's agent and the next round's)."""
    port = free_port()
    go, hold = tmp_path / "go", tmp_path / "hold"
    line = (f"--nnodes=2 --nproc-per-node=1 --max-restarts=1 --shutdown-timeout=60 --rdzv-backend=c10d "
            f"--rdzv-endpoint=localhost:{port}")
    out = tmp_path / "out"
    procs = _start_nodes("ftrun", 2, line, tmp_path, out,
                         env_extra={"WAIT_FOR": str(go), "HOLD_RANK": "1", "HOLD_FOR": str(hold)})
    try:
        wait_for(_first_dumps(out, 2), 90, "2 workers' first dumps", procs, poll=0.05)
        go.touch()  # rank 0 fails; rank 1 ignores the SIGTERM of its group's stop until `hold` exists
        wait_for_line(procs[0], "to end (this node hosts the run's store)", stream="stderr")
        os.kill(procs[0].pid, signal.SIGTERM)  # node 0's ftrun alone, not its workers
        try:
            procs[0].wait(30)
        except subprocess.TimeoutExpired:
            pass
        assert procs[0].returncode == 128 + signal.SIGTERM, "node 0 went on to the next round after a SIGTERM"
    finally:
        hold.touch()
    (code0, err0), (code1, err1) = _wait_all(procs, timeout=60)
    assert code0 == 143 and "received SIGTERM: stopping" in err0 and "Traceback" not in err0, err0
    assert code1 != 0 and "Traceback" not in err1, err1
    assert _dumps(out, 1) == {}  # no worker of a round 1 started anywhere


@pytest.mark.extended
def test_a_late_node_joins_at_the_next_reformation(tmp_path):
    """Round 0 forms with two nodes of 2:3; a third node started later waits, and round 1 has all three."""
    port = free_port()
    go = tmp_path / "go"
    line = (f"--nnodes=2:3 --nproc-per-node=1 --max-restarts=1 --rdzv-backend=c10d "
            f"--rdzv-endpoint=localhost:{port} --rdzv-conf=last_call_timeout=0.5")
    out = tmp_path / "out"
    procs = _start_nodes("ftrun", 2, line, tmp_path, out, env_extra={"WAIT_FOR": str(go)})
    wait_for(_first_dumps(out, 2), 90, "2 workers' first dumps", procs, poll=0.05)
    late = _start_nodes("ftrun", 1, line, tmp_path, out, env_extra={"WAIT_FOR": str(go)}, wait_port=False)[0]
    wait_for_line(late, "joins at the next re-formation", stream="stderr")  # registered for the next round
    go.touch()
    for code, err in _wait_all(procs + [late]):
        assert code == 0, err[-3000:]
    assert sorted(_dumps(out, 0)) == [0, 1]
    second = _dumps(out, 1)
    assert sorted(second) == [0, 1, 2] and {d["WORLD_SIZE"] for d in second.values()} == {"3"}


def test_waiting_node_stops_on_ctrl_c_and_a_short_join_timeout_is_one_line(tmp_path):
    port = free_port()
    line = f"--nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint=localhost:{port}"
    (waiting,) = _start_nodes("ftrun", 1, line, tmp_path, tmp_path / "out")  # hosts the store, waits for node 1
    os.killpg(waiting.pid, signal.SIGINT)
    (code, err), = _wait_all([waiting], timeout=30)
    assert code == 130 and "Traceback" not in err, err
    host, joining = _start_nodes("ftrun", 2, line.replace("--nnodes=2", "--nnodes=3"), tmp_path, tmp_path / "out")
    wait_for_line(joining, "waiting for the round to form", stream="stderr")  # node 1 waits for the round to fill
    os.killpg(joining.pid, signal.SIGINT)  # a node that joins, not the host: it says why it stops
    (code, err), = _wait_all([joining], timeout=30)
    assert code == 130 and "Traceback" not in err and "lost the run's store" not in err, err
    os.killpg(host.pid, signal.SIGINT)
    _wait_all([host], timeout=30)
    (alone,) = _start_nodes("ftrun", 1, line + " --rdzv-conf=join_timeout=1", tmp_path, tmp_path / "out")
    (code, err), = _wait_all([alone], timeout=60)
    assert code == 2 and err.strip().splitlines() == [
        "ftrun: error: only 1 of at least 2 nodes joined within --rdzv-conf join_timeout=1; start ftrun with "
        "the same line on the others"], err
    assert not list((tmp_path / "out").glob("*.json"))  # nothing was started
