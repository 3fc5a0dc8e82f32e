"""No single point of failure under --ft: the run's store moves when the node hosting it is lost.

Three ftrun processes act as three nodes over loopback (or network namespaces the test
creates). The store host's whole process tree is SIGKILLed mid-run: the two others agree on
a new host, their replicas keep their state, rejoin, heal from the one holding the newest
step, commit again within seconds and finish bitwise identical. A node cut off from the
others never forms a second run.
"""

from __future__ import annotations

import json
import os
import signal
import time

import psutil
import pytest

from conftest import free_port, listening, start_ftrun
from helpers import assert_identical, finish, rank_log, wait_printed, wait_replica
from test_ft import MID, TRAIN, _received_mb


def _three_nodes(port, run_id, out, steps, env=None, model=MID):
    env = {"FTRUN_NODE_TIMEOUT": "2", **(env or {})}
    return {k: start_ftrun(["--nnodes", 3, "--node-rank", k, "--master-addr", "127.0.0.1", "--master-port", port,
                            "--nproc", 1, "--ft", "--run-id", run_id, TRAIN, "--steps", steps,
                            "--step-sleep", 0.02, *model, "--out", out], env=env, files=("stderr",)) for k in (2, 1, 0)}


def _survivors_finish(procs):
    """Nodes 1 and 2 finish 0, each saying the store moved to node 1; node 0 was killed."""
    try:
        results = {k: finish(procs[k], 180) for k in (1, 2)}
    finally:
        for p in procs.values():
            p.kill()
    for k, (rc, err) in results.items():
        assert rc == 0, (k, err[-4000:])
        assert "moving the run's store" in err and "node 1 hosts the run's store now" in err, err[-3000:]


def _kill_tree(proc) -> None:
    """SIGKILL an ftrun and everything it started, at once: the node is gone."""
    family = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    for pid in family:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _start_in(ns, args, env):
    import subprocess
    import tempfile

    from conftest import FTRUN, ROOT

    err = tempfile.NamedTemporaryFile("w+", prefix="ftrun-err-", suffix=".log", delete=False)
    proc = subprocess.Popen(["ip", "netns", "exec", ns, *FTRUN, *map(str, args)], stdout=subprocess.DEVNULL,
                            stderr=err, text=True, env={**os.environ, **env}, cwd=ROOT)
    proc.err_path = err.name
    return proc


@pytest.mark.extended
def test_node_cut_off_never_forms_a_second_run(ftrun_home, tmp_path):
    """Nodes 0 and 1 in one network namespace, node 2 in another; node 2's link goes down. Node 2
    cannot reach a majority (it tries node 1, then hosts alone): it stops with exit 200 and never
    hosts a store. Nodes 0 and 1, two of three, go on and finish bitwise identical."""
    import pytest
    import subprocess
    import uuid

    from test_multinode import _netns_setup, _netns_teardown

    got = _netns_setup(uuid.uuid4().hex[:4])
    if isinstance(got, str):
        pytest.skip(got)
    ns0, ns1, addr, d0, d1 = got
    out = tmp_path / "p"
    try:
        port = free_port()
        procs = {}
        for k, ns, dev in ((2, ns1, d1), (1, ns0, d0), (0, ns0, d0)):
            procs[k] = _start_in(ns, ["--nnodes", 3, "--node-rank", k, "--master-addr", addr, "--master-port", port,
                                      "--nproc", 1, "--ft", "--run-id", "cut", TRAIN, "--steps", 350,
                                      "--step-sleep", 0.02, "--out", out],
                                 {"GLOO_SOCKET_IFNAME": dev, "FTRUN_NODE_TIMEOUT": "2"})
        try:
            for k in (0, 2):
                wait_replica(ftrun_home, f"cut.node{k}", k, lambda r, st: r["step"] >= 30 and r["state"] == "running",
                             120, proc=procs[k])
            subprocess.run(["ip", "-n", ns1, "link", "set", d1, "down"], check=True)
            cut_at = time.monotonic()
            rc2, err2 = finish(procs[2], 60)
            stopped_s = time.monotonic() - cut_at
            results = {k: finish(procs[k], 240) for k in (0, 1)}
        finally:
            for p in procs.values():
                p.kill()
    finally:
        _netns_teardown(ns0, ns1)
    assert rc2 == 200, err2[-3000:]
    assert "no second run can form" in err2 and "hosts the run's store now" not in err2, err2[-3000:]
    for k, (rc, err) in results.items():
        assert rc == 0, (k, err[-3000:])
        assert "carrying on without its replicas" in err or k == 1, err[-3000:]
    _, stats = assert_identical(out, [0, 1])
    assert stats["step"] == 350
    print(f"the cut-off node stopped {stopped_s:.1f} s after its link went down")


@pytest.mark.extended
def test_store_host_lost_while_a_replica_heals(ftrun_home, tmp_path):
    """--ft on three static nodes. Node 2's replica is killed and heals from rank 0 on node 0, slowly
    (the source pauses after its first 4 MiB chunk); node 0 (the store and the keeper) is SIGKILLed
    with its workers in the middle of that transfer. The store moves to node 1, which commits again
    within 20 s; its replica is then the only one holding the trained state: it heals node 2's, and
    both finish bitwise identical."""
    out = tmp_path / "p"
    procs = _three_nodes(free_port(), "mvh", out, 250,
                         env={"FTRUN_FT_INJECT_SEND_DELAY": "2", "FTRUN_FT_CHUNK_MB": "4"})
    try:
        r = wait_replica(ftrun_home, "mvh.node2", 2, lambda r, st: r["step"] >= 30 and r["state"] == "running", 120,
                         proc=procs[2])
        os.kill(r["pid"], signal.SIGKILL)
        wait_replica(ftrun_home, "mvh.node2", 2, lambda r, st: r.get("ft_phase") == "heal" and r["restarts"] >= 1, 60,
                     proc=procs[2])
        step_at_kill = wait_replica(ftrun_home, "mvh.node1", 1, lambda r, st: True, 10, proc=procs[1])["step"]
        _kill_tree(procs[0])
        killed_at = time.time()
        wait_replica(ftrun_home, "mvh.node1", 1, lambda r, st: r["step"] > step_at_kill + 10, 30, proc=procs[1])
        resumed_s = time.time() - killed_at
    except BaseException:
        for p in procs.values():
            p.kill()
        raise
    _survivors_finish(procs)
    assert resumed_s < 20, resumed_s
    log1 = rank_log(ftrun_home, "mvh.node1", 1)
    assert "the run's store moved to" in log1, log1[-2000:]
    log2 = rank_log(ftrun_home, "mvh.node2", 2)
    assert "received" in log2.split("the run's store moved to")[-1], log2[-2000:]  # healed on the new store
    _, stats = assert_identical(out, [1, 2])
    assert stats["step"] == 250


@pytest.mark.extended
def test_a_restarted_replica_waiting_on_another_store_at_the_runs_address_follows_the_move(ftrun_home, tmp_path):
    """--ft on three static nodes. Rank 2 is killed, and its next incarnation finds another store
    at the run's address (FTRUN_FT_INJECT_STORE; in a loaded run a worker that connected as node 0
    was lost reached the store of the node restarted at its endpoint): it asks to join there,
    where no keeper reads. Node 0 is SIGKILLed; once its node announces where the run's store is
    now, rank 2 follows it, joins, heals and finishes identical with rank 1. Before, no call on
    that store ever failed: rank 2 waited there while the others finished (here for ever; in the
    loaded run until that node exited, and then it exited 0 with nothing trained)."""
    from torch.distributed import TCPStore

    from ftrun import keys

    out, other = tmp_path / "p", TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    procs = _three_nodes(free_port(), "imp", out, 250, env={"FTRUN_FT_INJECT_STORE": f"2:1=127.0.0.1:{other.port}"},
                         model=[])
    try:
        r = wait_replica(ftrun_home, "imp.node2", 2, lambda r, st: r["step"] >= 20 and r["state"] == "running", 120,
                         proc=procs[2])
        os.kill(r["pid"], signal.SIGKILL)
        wait_replica(ftrun_home, "imp.node2", 2, lambda r, st: r.get("ft_phase") == "join" and r["restarts"] >= 1, 60,
                     proc=procs[2])
        assert other.get(keys.join_key(2)) == b"1"  # it asked to join on the other store
        _kill_tree(procs[0])
    except BaseException:
        for p in procs.values():
            p.kill()
        raise
    _survivors_finish(procs)
    log2 = rank_log(ftrun_home, "imp.node2", 2)
    assert "announced that the run's store moved while this member waited to join" in log2, log2[-2000:]
    assert _received_mb(log2.split("the run's store moved to")[-1]), log2[-2000:]  # healed on the moved store
    _, stats = assert_identical(out, [1, 2])
    assert stats["step"] == 250


# A plain DDP script with its own checkpoint, as a user writes it (no ftrun API): rank 0 saves
# every 5 steps (atomically), every run resumes from the newest one, rank 0 says how it ended.
# FAIL_AT=S: in the first attempt the last rank fails at step S (the nodes then re-form).
C10D_TRAIN = """\
import json, os, sys, time
import torch, torch.distributed as dist, torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
ck, out, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
fail_at = int(os.environ.get("FAIL_AT", "-1"))
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
dist.init_process_group("gloo")
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1)))
opt = torch.optim.Adam(model.parameters(), 1e-3)
start = 0
if os.path.exists(ck):
    state = torch.load(ck)
    model.module.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    start = state["step"]
for step in range(start, steps):
    if step == fail_at and restart == 0 and dist.get_rank() == dist.get_world_size() - 1:
        sys.exit(1)
    x = torch.randn(32, 256, generator=torch.Generator().manual_seed(1000 * step + dist.get_rank()))
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()
    if dist.get_rank() == 0 and (step + 1) % 5 == 0:
        torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step + 1}, ck + ".tmp")
        os.replace(ck + ".tmp", ck)
        with open(ck + ".step", "w") as f:
            f.write(str(step + 1))
    time.sleep(0.05)
if dist.get_rank() == 0:
    with open(out, "w") as f:
        json.dump({"start": start, "world": dist.get_world_size(), "restart": restart}, f)
dist.destroy_process_group()
"""


@pytest.mark.parametrize("when", [pytest.param("mid-run", marks=pytest.mark.extended), "re-forming"])
def test_c10d_store_host_lost_the_others_reform_from_their_checkpoint(tmp_path, when):
    """Without --ft, --nnodes 2:3 (2:4) over c10d on three nodes: the node hosting the rendezvous
    endpoint (the run's store) is SIGKILLed with its workers, mid-run or while the nodes re-form
    after a worker failed (the host waits for a fourth node). torchrun's survivors end there
    (exit 1, measured); ftrun's two others move the store to one of them, form a round of two,
    and the script resumes from its own checkpoint and finishes."""
    import subprocess

    from conftest import FTRUN, ROOT

    port = free_port()
    script, ck, done = tmp_path / "train.py", tmp_path / "ck.pt", tmp_path / "done.json"
    script.write_text(C10D_TRAIN)
    # mid-run: a round of three closes at once; re-forming: the host waits for a fourth node
    line = [f"--nnodes=2:{3 if when == 'mid-run' else 4}", "--nproc-per-node=1", "--max-restarts=3", "--rdzv-id=mvc", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=localhost:{port}", "--rdzv-conf=last_call_timeout=3",
            str(script), str(ck), str(done), "60"]
    env = {**os.environ, "FTRUN_HOME": str(tmp_path / "home"), "FTRUN_NODE_TIMEOUT": "2",
           "FAIL_AT": "20" if when == "re-forming" else "-1"}
    procs, errs = [], [tmp_path / f"err{i}" for i in range(3)]
    try:
        for i in range(3):
            with open(errs[i], "w") as err:
                procs.append(subprocess.Popen([*FTRUN, *line], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                              stderr=err, text=True, start_new_session=True))
            deadline = time.monotonic() + 60
            while i == 0 and not listening(port):  # the first hosts the endpoint
                assert procs[0].poll() is None and time.monotonic() < deadline, errs[0].read_text()
                time.sleep(0.05)
        deadline = time.monotonic() + 120

        def cue() -> bool:
            if when == "re-forming":  # both others arrived at round 1, the host waits for a fourth
                return all("round 1: arrived as node" in errs[i].read_text() for i in (1, 2))
            return ck.with_name("ck.pt.step").exists() and int(ck.with_name("ck.pt.step").read_text() or 0) >= 15

        while not cue():
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
                [e.read_text()[-2000:] for e in errs]
            time.sleep(0.05)
        os.killpg(procs[0].pid, signal.SIGKILL)  # the store's node, workers and all
        killed_at = time.monotonic()
        for p in procs[1:]:
            p.wait(180)
        took = time.monotonic() - killed_at
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except OSError:
                pass
    for p, e in zip(procs[1:], errs[1:]):
        err = e.read_text()
        assert p.returncode == 0, err[-4000:]
        assert "the run's store moved to" in err and "ftrun: error" not in err, err[-3000:]
    ended = json.loads(done.read_text())
    assert ended["world"] == 2 and ended["start"] >= 15, ended
    assert ended["restart"] == 1, ended  # a round that never formed costs no restart
    print(f"{when}: re-formed on the survivors and resumed from step {ended['start']}; finished {took:.1f} s "
          f"after the kill")


@pytest.mark.extended
def test_c10d_ft_store_host_lost_while_a_node_joins(ftrun_home, tmp_path):
    """--ft, --nnodes 3:4 over c10d, the same line on every node: three nodes train; a fourth is taken
    into the running run, and as soon as the others know of it (before its replica has healed) the
    endpoint's node, the run's store and keeper, is SIGKILLed with its workers. The three others, the
    newcomer among them, move the store to node 1 and commit again within 20 s. Then a node is started
    with the run's original line, on the endpoint's machine, as a restarted pod would be: it finds the
    word the moved store left there, joins the run where it is now (no second run forms at the old
    endpoint), and all four finish bitwise identical."""
    from test_ft import _c10d_node, _c10d_start

    port, out = free_port(), tmp_path / "p"
    procs = [_c10d_node(port, "3:4", "cj", out, 500)]
    try:
        procs += [_c10d_start(port, "3:4", "cj", out, 500) for _ in range(2)]
        wait_printed(procs[0], "quorum 1: 3 replicas", 120)
        wait_replica(ftrun_home, "cj.node1", 1, lambda r, st: r["step"] >= 30 and r["state"] == "running", 120)
        procs.append(_c10d_start(port, "3:4", "cj", out, 500))
        for p in procs[1:4]:  # the newcomer has joined, and every survivor counts it, before the host goes...
            wait_printed(p, "joined the running run", 60)
        # ...and node 1 has seen it beat (its table comes with its beats): a node that loses the store
        # before it has finished joining stops, and the others no longer count it (nodes.layout_size;
        # test_late_node_that_loses_the_store_mid_join_is_not_counted)
        wait_replica(ftrun_home, "cj.node1", 3, lambda r, st: True, 30)
        r = wait_replica(ftrun_home, "cj.node1", 1, lambda r, st: True, 10)
        _kill_tree(procs[0])
        killed_at, step_at_kill = time.time(), r["step"]
        wait_replica(ftrun_home, "cj.node1", 1, lambda r, st: r["step"] > step_at_kill + 10, 30)
        resumed_s = time.time() - killed_at
        procs.append(_c10d_start(port, "3:4", "cj", out, 500))  # binds the endpoint's port afresh
        wait_printed(procs[4], "joining the run there", 30)
        results = {k: finish(procs[k], 180) for k in (1, 2, 3, 4)}
    finally:
        for p in procs:
            p.kill()
    for k, (rc, err) in results.items():
        assert rc == 0, (k, "\n".join(line for line in err.splitlines() if not line.startswith("[rank"))[-4000:])
        if k < 4:
            assert "moving the run's store" in err and "node 1 hosts the run's store now" in err, err[-3000:]
    assert "joined the running run cj" in results[4][1] and "round 0: 1 node" not in results[4][1], results[4][1]
    # node 4's replica received the trained state (1.3M parameters with Adam: 16 MB) from a peer
    heals = _received_mb(rank_log(ftrun_home, "cj.node4", 4))
    assert heals and heals[-1] > 10, heals
    assert resumed_s < 20, resumed_s
    _, stats = assert_identical(out, [1, 2, 3, 4])
    assert stats["step"] == 500
    print(f"c10d: committing again {resumed_s:.1f} s after the store host was killed as node 3 joined")


@pytest.mark.extended
def test_late_node_that_loses_the_store_mid_join_is_not_counted(ftrun_home, tmp_path):
    """--ft, --nnodes 3:4 over c10d: node 0 takes a fourth node in, and is SIGKILLed, store and all,
    while that node is still joining (held there by fault injection: taken in, no beat yet). It
    cannot take part in the move and stops; nodes 1 and 2 do not count it in the majority (2 of the
    3 nodes that ever beat, not 2 of 4), so they move the store and finish identical, where before
    both stopped with exit 200."""
    from test_ft import _c10d_node, _c10d_start

    port, out, gate = free_port(), tmp_path / "p", tmp_path / "go-on-joining"
    procs = [_c10d_node(port, "3:4", "mj", out, 400)]
    try:
        procs += [_c10d_start(port, "3:4", "mj", out, 400) for _ in range(2)]
        wait_replica(ftrun_home, "mj.node1", 1, lambda r, st: r["step"] >= 20 and r["state"] == "running", 120)
        procs.append(start_ftrun(["--nnodes", "3:4", "--nproc-per-node", 1, "--rdzv-backend", "c10d",
                                  "--rdzv-endpoint", f"localhost:{port}", "--rdzv-conf", "last_call_timeout=0.5",
                                  "--ft", "--run-id", "mj", TRAIN, "--steps", 400, "--step-sleep", 0.02,
                                  "--out", out, *MID],
                                 env={"FTRUN_NODE_TIMEOUT": "2", "FTRUN_INJECT_JOIN_HOLD": str(gate)}, files=("stderr",)))
        for p in procs[1:3]:  # both survivors know of the newcomer: it is in the run's node list
            wait_printed(p, "joined the running run", 60)
        _kill_tree(procs[0])
        gate.write_text("")  # the newcomer goes on joining, on a store that is gone
        results = {k: finish(procs[k], 180) for k in (1, 2, 3)}
    finally:
        for p in procs:
            p.kill()
    for k in (1, 2):
        rc, err = results[k]
        assert rc == 0, (k, "\n".join(line for line in err.splitlines() if not line.startswith("[rank"))[-4000:])
        assert "node 1 hosts the run's store now, at" in err and "(2 of 3 nodes" in err, err[-3000:]
    rc, err = results[3]
    assert rc != 0 and "Traceback" not in err, err[-3000:]
    # one line either way: lost while its join is checked, or while the run's rounds are read
    assert ("lost node 0's store" in err and "while joining" in err) or "lost the run's store at" in err, \
        err[-3000:]
    _, stats = assert_identical(out, [1, 2])
    assert stats["step"] == 400


def test_a_workers_store_client_is_refused_at_once_by_a_store_that_is_gone():
    """A worker that connects just as the run's store goes away (a node that joins as the endpoint's
    node is lost) is refused at once. torch's client retried its connect for the whole vote timeout
    (600 s) and took the store a node started later at that port (the run's original line again):
    the newcomer never followed the move, and the keeper of the moved store waited for it in vain
    (test_c10d_ft_store_host_lost_while_a_node_joins, now and then under load)."""
    import datetime
    import threading

    import torch.distributed as dist

    from ftrun.worker.ft.member.torch_effects import store_client

    port = free_port()
    later = []
    started = threading.Event()

    def host_later() -> None:  # a store at the old address a second later
        started.wait(10)
        time.sleep(1.0)
        later.append(dist.TCPStore("127.0.0.1", port, None, True, datetime.timedelta(seconds=30)))

    threading.Thread(target=host_later, daemon=True).start()
    t0 = time.monotonic()
    started.set()
    with pytest.raises(dist.DistError, match="does not answer"):
        store_client(f"127.0.0.1:{port}", datetime.timedelta(seconds=600))
    assert time.monotonic() - t0 < 1.0
