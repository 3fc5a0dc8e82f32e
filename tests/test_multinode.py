"""Several machines, one run: two ftrun processes act as two nodes (loopback, or two network namespaces).

Real processes through the real CLI, failures injected with real signals:
a 2x2 DDP run trains to identical parameters with torchrun's variables, a
killed worker on node 1 restarts every node, a killed node is noticed by the
other within seconds, and a node that cannot join says why.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid

import psutil
import pytest

from conftest import FTRUN, ROOT, SCRIPTS, free_port, really_alive, run_ftrun, start_ftrun
from helpers import assert_identical, replica, wait_state
from test_env_contract import CONTRACT

from ftrun.machine import store_bind_addr
from ftrun.slurm import expand_hostlist, first_host, job_port, layout_from_env

TRAIN = SCRIPTS / "train_ddp.py"

# Dumps the worker's environment, then (given training arguments) runs train_ddp.py as __main__.
WRAP = """
import json, os, runpy, sys
out = sys.argv[1]
with open(os.path.join(out, "env." + os.environ["RANK"] + ".json"), "w") as f:
    json.dump(dict(os.environ), f)
if len(sys.argv) > 2:
    sys.argv = [{train!r}] + sys.argv[2:]
    runpy.run_path({train!r}, run_name="__main__")
"""


def _nodes(port, args, nproc=2, extra=(), env=None, addr="127.0.0.1"):
    """Start node 1 first (it must wait for node 0), then node 0."""
    procs = {}
    for k in (1, 0):
        procs[k] = start_ftrun(["--nnodes", 2, "--node-rank", k, "--master-addr", addr, "--master-port", port,
                                "--nproc", nproc, *extra, *args], env=env)
    return procs


def _finish(procs, timeout=120):
    """Wait for every node; on a timeout, kill them all and fail with what each one said."""
    out = {}
    deadline = time.monotonic() + timeout
    for k, p in procs.items():
        try:
            o, e = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs.values():
                q.kill()
            said = {j: q.communicate()[1][-3000:] for j, q in procs.items() if j not in out}
            raise AssertionError(f"nodes still running after {timeout} s; their stderr: {said}") from None
        out[k] = (p.returncode, o, e)
    return out


def _running(ranks, min_step: int = 1):
    """A wait_state predicate: every rank of `ranks` running, at step `min_step` or later."""
    return lambda st: all(any(r["rank"] == x and r["state"] == "running" and r["step"] >= min_step
                              for r in st["replicas"]) for x in ranks)


# ----------------------------------------------------------------------------- training together


@pytest.mark.extended
def test_two_nodes_train_together_with_torchruns_env(ftrun_home, tmp_path):
    wrap = tmp_path / "wrap.py"
    wrap.write_text(WRAP.format(train=str(TRAIN)))
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    ours.mkdir()
    theirs.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}

    port = free_port()
    res = _finish(_nodes(port, [wrap, ours, "--steps", 12, "--out", tmp_path / "p"],
                         extra=["--run-id", "mn", "--max-restarts", 1]))
    for k, (rc, _o, e) in res.items():
        assert rc == 0, (k, e)
    assert "all nodes joined run mn" in res[1][2]
    assert_identical(tmp_path / "p", 4, optimizer=False, step=False)  # train_ddp.py saves the parameters only

    # torchrun, one per node, same layout: dump only.
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or "torchrun"
    tport = free_port()
    tprocs = [subprocess.Popen([torchrun, "--nnodes", "2", "--node-rank", str(k), "--nproc-per-node", "2",
                                "--max-restarts", "1", "--rdzv-id", "mn", "--master-addr", "127.0.0.1",
                                "--master-port", str(tport), str(wrap), str(theirs)],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for k in (1, 0)]
    for p in tprocs:
        _o, e = p.communicate(timeout=90)
        assert p.returncode == 0, e
    for r in range(4):
        a = json.loads((ours / f"env.{r}.json").read_text())
        b = json.loads((theirs / f"env.{r}.json").read_text())
        for key in CONTRACT:
            if key == "MASTER_PORT":
                assert a[key] == str(port) and b[key] == str(tport), (r, a[key], b[key])
                continue
            assert a.get(key) == b.get(key), (r, key, a.get(key), b.get(key))
        assert a["FTRUN_STORE"] == f"127.0.0.1:{port}"
        assert a["FTRUN_REPLICA_ID"] == str(r)


# ----------------------------------------------------------------------------- failures


def _slurm_env(job: str, k: int) -> dict:
    return {"SLURM_JOB_ID": job, "SLURM_NNODES": "2", "SLURM_NODEID": str(k), "SLURM_NTASKS": "2",
            "SLURM_JOB_NODELIST": "127.0.0.[1-2]", "SLURM_STEP_ID": "0"}


def _free_slurm_job() -> str:
    for _ in range(50):
        job = str(4_000_000 + int.from_bytes(os.urandom(2), "little"))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", job_port(job)))
                return job
            except OSError:
                continue
    pytest.skip("no free port for a fake Slurm job")


@pytest.mark.extended
def test_worker_kill_on_node1_restarts_every_node_under_slurm(ftrun_home, tmp_path):
    """Layout from SLURM_* only (as under `srun ftrun`); SIGKILL of rank 3 restarts all four ranks."""
    job = _free_slurm_job()
    run_id = f"slurm-{job}.0"
    args = ["--nproc", 2, "--max-restarts", 1, TRAIN, "--steps", 80, "--step-sleep", 0.03, "--out", tmp_path / "p"]
    procs = {k: start_ftrun(args, env=_slurm_env(job, k)) for k in (1, 0)}
    try:
        st = wait_state(ftrun_home, f"{run_id}.node1", _running([2, 3], min_step=2), 60, "node 1 running ranks 2, 3")
        os.kill(replica(st, 3)["pid"], signal.SIGKILL)
        # `ftrun status` on node 0 shows every node's replicas, here those of the restarted attempt.
        # Node 1's table reaches node 0 through the store a moment later: wait for all four.
        wait_state(ftrun_home, f"{run_id}.node0", lambda st: st["group_restarts"] == 1 and sum(
            r["state"] == "running" and r["restarts"] == 1 for r in st["replicas"]) == 4,
            30, "node 0 showing the 4 restarted ranks running")
        view = run_ftrun(["status", "--json", run_id])
        assert view.returncode == 0, view.stderr
        runs = [r for r in json.loads(view.stdout) if r["node_rank"] == 0]
        assert sorted((r["rank"], r["node_rank"]) for r in runs[0]["replicas"]) == [(0, 0), (1, 0), (2, 1), (3, 1)]
        assert all(r["restarts"] == 1 for r in runs[0]["replicas"]), runs[0]["replicas"]
    except BaseException:
        for p in procs.values():
            p.kill()
        raise
    res = _finish(procs)
    for k, (rc, _o, e) in res.items():
        assert rc == 0, (k, e)
        assert "rank 3 on node 1 killed by SIGKILL" in e, (k, e)
        assert "restarting all 4 workers on 2 nodes (restart 1 of 1)" in e, (k, e)
    assert_identical(tmp_path / "p", 4, optimizer=False, step=False)  # train_ddp.py saves the parameters only
    assert json.loads((tmp_path / "p.rank3.json").read_text())["steps"] == 80


def _long_run(port, tmp_path, extra=()):
    return _nodes(port, [TRAIN, "--steps", 10_000, "--step-sleep", 0.05], nproc=1,
                  extra=["--run-id", "loss", *extra])


@pytest.mark.alone
def test_killed_node1_is_noticed_by_node0(ftrun_home, tmp_path):
    procs = _long_run(free_port(), tmp_path)
    try:
        wait_state(ftrun_home, "loss.node0", _running([0], min_step=2), 60, "node 0 running rank 0")
        wait_state(ftrun_home, "loss.node1", _running([1], min_step=2), 60, "node 1 running rank 1")
        t0 = time.monotonic()
        procs[1].kill()
        rc, _o, err = _finish({0: procs[0]}, timeout=30)[0]
        noticed = time.monotonic() - t0
    finally:
        for p in procs.values():
            p.kill()
    assert rc != 0
    assert "node 1 (" in err and "went away (no heartbeat" in err, err
    assert noticed < 10, noticed  # heartbeats: seconds, not torchrun's minutes
    print(f"node 0 noticed node 1's death and ended in {noticed:.1f} s")


@pytest.mark.alone
def test_killed_node0_stops_node1_cleanly(ftrun_home, tmp_path):
    procs = _long_run(free_port(), tmp_path)
    try:
        wait_state(ftrun_home, "loss.node0", _running([0], min_step=2), 60, "node 0 running rank 0")
        wait_state(ftrun_home, "loss.node1", _running([1], min_step=2), 60, "node 1 running rank 1")
        family = psutil.Process(procs[1].pid).children(recursive=True)
        assert len(family) >= 2  # zygote + worker
        t0 = time.monotonic()
        procs[0].kill()
        rc, _o, err = _finish({1: procs[1]}, timeout=30)[1]
        took = time.monotonic() - t0
    finally:
        for p in procs.values():
            p.kill()
    assert rc not in (0, None), err
    assert "node 0 (the run's store at 127.0.0.1:" in err and "went away" in err, err
    assert took < 15, took
    assert not really_alive(family, 10.0), "orphans left behind"


# ----------------------------------------------------------------------------- joining and bad input


def test_join_errors_are_one_line(ftrun_home, tmp_path):
    script = tmp_path / "noop.py"
    script.write_text("print('ran')\n")
    pa, pb, pc = free_port(), free_port(), free_port()
    # all at once, to keep the test short:
    # a node that never comes: named after the join timeout, nothing started
    alone = start_ftrun(["--nnodes", 3, "--node-rank", 0, "--master-port", pa, "--join-timeout", 2, script])
    # node 0 unreachable
    lost = start_ftrun(["--nnodes", 2, "--node-rank", 1, "--master-port", pb, "--join-timeout", 1, script])
    # two nodes claim rank 1: whichever comes second is told so; the other stays, waiting for node 2
    pair = [start_ftrun(["--nnodes", 3, "--node-rank", r, "--master-port", pc, "--join-timeout", 30, script])
            for r in (1, 1, 0)]
    try:
        a_out, a_err = alone.communicate(timeout=60)
        _l_out, l_err = lost.communicate(timeout=60)
        # Wait for the node that is told "taken" to exit (the other keeps waiting for node 2).
        deadline = time.time() + 60
        while all(p.poll() is None for p in pair[:2]):
            assert time.time() < deadline, "neither node claiming rank 1 was refused within 60 s"
            time.sleep(0.05)
    finally:
        for p in pair + [alone, lost]:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        results = [p.communicate(timeout=30) for p in pair]
    assert alone.returncode == 2 and "nodes 1, 2 of 3 did not join within --join-timeout 2 s" in a_err, a_err
    assert "ran" not in a_out
    assert lost.returncode == 2 and "could not reach node 0's store at 127.0.0.1:" in l_err, l_err
    assert len([line for line in l_err.splitlines() if line.strip()]) <= 2, l_err  # no C++ stack traces
    codes = sorted(p.returncode for p in pair[:2])
    assert codes == [2, 130], [r[1] for r in results]
    dup_err = results[[p.returncode for p in pair].index(2)][1]
    # Two ftruns of one run on one machine: the second is told by the join, or (if the first has
    # written its state file by then) by the twin-run check; either way one line, nothing started.
    assert "node rank 1 is already taken by" in dup_err or "a run of that name is already running here" in dup_err, \
        dup_err


@pytest.mark.parametrize("args, message", [
    (["--nnodes", 2, "--node-rank", 2, "--master-port", 29400], "--node-rank 2 is out of range for --nnodes 2"),
    (["--nnodes", 0], "--nnodes must be >= 1"),
    (["--nnodes", 2, "--node-rank", 1], "--nnodes 2 needs --master-port"),
    (["--nnodes", 2, "--master-port", 29400, "--master-addr", "no-such-host.invalid"], "cannot resolve"),
])
@pytest.mark.quick
def test_bad_layout_is_one_line_exit_2(ftrun_home, args, message):
    proc = run_ftrun([*args, TRAIN])
    assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.splitlines()) == 1, proc.stderr


@pytest.mark.quick
def test_slurm_layout_parsing():
    assert expand_hostlist("node[01-03,7],gpu5") == ["node01", "node02", "node03", "node7", "gpu5"]
    assert expand_hostlist("r[1-2]n[08-09]") == ["r1n08", "r1n09", "r2n08", "r2n09"]
    assert first_host("node[09-11,2]") == "node09" and first_host("a,b[1-2]") == "a"
    env = {"SLURM_JOB_ID": "123", "SLURM_NNODES": "3", "SLURM_NODEID": "2", "SLURM_JOB_NODELIST": "node[09-11]"}
    got = layout_from_env(env)
    assert got["nnodes"] == 3 and got["node_rank"] == 2 and got["master_addr"] == "node09"
    assert got["master_port"] == job_port("123") and got["run_id"] == "slurm-123"
    assert layout_from_env({}) == {}
    with pytest.raises(ValueError, match="one ftrun per node"):
        layout_from_env({**env, "SLURM_NTASKS": "12"})


def test_store_listens_on_master_addr_interface_only():
    assert store_bind_addr("127.0.0.1") == "127.0.0.1"  # a local address: that interface, nothing else
    assert store_bind_addr("192.0.2.77") == "0.0.0.0"   # not this machine's (NAT, load balancer): all


# ----------------------------------------------------------------------------- two network namespaces


def _netns_setup(tag: str):
    """Two namespaces joined by a veth pair: (ns0, ns1, addr0, dev0, dev1), or a reason to skip."""
    if os.geteuid() != 0 or not shutil.which("ip"):
        return "needs root and iproute2 (ip netns)"
    ns0, ns1, d0, d1 = f"ft{tag}a", f"ft{tag}b", f"vf{tag}a", f"vf{tag}b"
    cmds = [
        ["ip", "netns", "add", ns0], ["ip", "netns", "add", ns1],
        ["ip", "link", "add", d0, "type", "veth", "peer", "name", d1],
        ["ip", "link", "set", d0, "netns", ns0], ["ip", "link", "set", d1, "netns", ns1],
        ["ip", "-n", ns0, "addr", "add", "10.231.7.1/24", "dev", d0],
        ["ip", "-n", ns1, "addr", "add", "10.231.7.2/24", "dev", d1],
        ["ip", "-n", ns0, "link", "set", d0, "up"], ["ip", "-n", ns1, "link", "set", d1, "up"],
        ["ip", "-n", ns0, "link", "set", "lo", "up"], ["ip", "-n", ns1, "link", "set", "lo", "up"],
    ]
    for c in cmds:
        r = subprocess.run(c, capture_output=True, text=True)
        if r.returncode != 0:
            _netns_teardown(ns0, ns1)
            return f"`{' '.join(c)}` failed: {r.stderr.strip()}"
    return ns0, ns1, "10.231.7.1", d0, d1


def _netns_teardown(*names):
    for ns in names:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_two_nodes_in_two_network_namespaces(ftrun_home, tmp_path):
    tag = uuid.uuid4().hex[:4]
    got = _netns_setup(tag)
    if isinstance(got, str):
        pytest.skip(got)
    ns0, ns1, addr, d0, d1 = got
    try:
        port = free_port()
        procs = {}
        for k, ns, dev in ((1, ns1, d1), (0, ns0, d0)):
            env = dict(os.environ, GLOO_SOCKET_IFNAME=dev)
            procs[k] = subprocess.Popen(
                ["ip", "netns", "exec", ns, *FTRUN, "--nnodes", "2", "--node-rank", str(k), "--master-addr", addr,
                 "--master-port", str(port), "--nproc", "2", "--run-id", "ns", str(TRAIN), "--steps", "10",
                 "--out", str(tmp_path / "p")],
                env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        res = _finish(procs)
        for k, (rc, _o, e) in res.items():
            assert rc == 0, (k, e)
        assert f"at {addr}:{port}" in res[1][2]
        assert_identical(tmp_path / "p", 4, optimizer=False, step=False)  # train_ddp.py saves the parameters only
    finally:
        _netns_teardown(ns0, ns1)
