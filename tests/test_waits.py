"""Progress of ftrun's own long waits: drawn on a terminal (a real pseudo-terminal here),
never when stderr is a pipe or a file; and which --ft replica phases count as long waits.
"""

from __future__ import annotations

import os
import pty
import select
import subprocess
import time

import pytest

from conftest import FTRUN, ROOT, SCRIPTS, free_port
from ftrun.supervisor.accounting.waits import replica_waits
from ftrun.wire import MemberReport


def _two_nodes(tmp_path, node0_on_tty: bool) -> str:
    """Node 0 alone for 3 s at least (on a terminal: until it draws its wait), then node 1: what
    node 0 wrote to its stderr."""
    port = free_port()
    env = dict(os.environ, FTRUN_HOME=str(tmp_path / f"home{int(node0_on_tty)}"), COLUMNS="120", TERM="xterm")
    env.pop("FTRUN_PROGRESS", None)
    args = ["--nnodes", 2, "--nproc", 1, "--master-port", port, "--run-id", "waits", SCRIPTS / "train_ddp.py",
            "--steps", 3]
    node = lambda k: FTRUN + [str(a) for a in args[:4]] + ["--node-rank", str(k)] + [str(a) for a in args[4:]]  # noqa: E731
    if node0_on_tty:
        master, slave = pty.openpty()
        n0 = subprocess.Popen(node(0), stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=env, cwd=ROOT)
        os.close(slave)
    else:
        n0 = subprocess.Popen(node(0), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=env, cwd=ROOT)
        master = n0.stderr.fileno()
    out = b""
    n1 = None
    t0 = time.monotonic()
    try:
        while n0.poll() is None and time.monotonic() - t0 < 120:
            # Node 1 once node 0 has drawn its wait (on a terminal; 30 s at most) or after 3 s (piped):
            # on a loaded machine node 0 itself may take 3 s to start waiting.
            ready = b"1/2" in out if node0_on_tty else True
            if n1 is None and time.monotonic() - t0 > 3.0 and (ready or time.monotonic() - t0 > 30):
                n1 = subprocess.Popen(node(1), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, env=env, cwd=ROOT)
            if select.select([master], [], [], 0.2)[0]:
                try:
                    out += os.read(master, 65536)
                except OSError:  # the terminal's other side closed
                    break
        n0.wait(60)
        if n1 is not None:
            n1.wait(60)
    finally:
        for p in (n0, n1):
            if p is not None:
                p.kill()
    assert n0.returncode == 0, out.decode(errors="replace")[-3000:]
    return out.decode(errors="replace")


@pytest.mark.extended
def test_waiting_for_nodes_shows_progress_on_a_terminal_only(tmp_path):
    seen = _two_nodes(tmp_path, node0_on_tty=True)
    assert "ftrun: waiting for the nodes of run waits to join" in seen, seen[-2000:]
    assert "1/2" in seen, seen[-2000:]
    assert "all nodes joined run waits" in seen
    piped = _two_nodes(tmp_path, node0_on_tty=False)
    assert "all nodes joined run waits" in piped
    assert "waiting for the nodes" not in piped and "\x1b[" not in piped, piped[-2000:]


@pytest.mark.quick
def test_replica_phases_that_are_long_waits():
    info = {0: MemberReport(phase="compute", phase_since=5.0, inc=0),
            1: MemberReport(phase="heal", phase_since=7.0, inc=1),
            2: MemberReport(phase="resume", phase_since=8.0, inc=0),
            3: MemberReport(phase="heal", phase_since=9.0, inc=0),   # an old incarnation's report
            4: MemberReport(phase="heal-wait", phase_since=9.5, inc=2)}
    alive = {0: 0, 1: 1, 2: 0, 3: 1, 4: 2}
    got = replica_waits(info, alive, 1, {0, 1, 2, 3})
    assert got == {"replica 1": ("rank 1 healing from a peer", 7.0, None, None),
                   "replica 2": ("rank 2 resuming from a checkpoint", 8.0, None, None)}
    # replicas of two workers: the first worker speaks for its replica
    assert replica_waits(info, alive, 2, {0, 1, 2, 3}) == {
        "replica 2": ("replica 1 resuming from a checkpoint", 8.0, None, None)}
