"""Shared helpers: run the real `ftrun` CLI in a subprocess, isolated per test."""

from __future__ import annotations

import contextlib
import fcntl
import os
import resource
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"
FTRUN = [sys.executable, "-m", "ftrun"]

# A suite started in the background of a non-interactive shell (`cmd &`) inherits SIGINT
# ignored, and so would every process it starts: the tests that stop ftrun with Ctrl-C's
# signal would wait in vain. A handler here is reset to the default in each child at exec.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# One OpenMP thread per process, as ftrun (and torchrun) give each worker when a node runs more than
# one. The suite runs two tests at once on a few cores, and a test's nodes are several ftrun processes
# with one worker each: left unset, every such worker's OpenMP threads spin-wait for CPUs the others
# hold, and a 200-step run of train_ft.py took 39 CPU s instead of 4 (160 s instead of 30) on 2 cores.
# Tests of what ftrun sets there remove it from the environment they pass.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session", autouse=True)
def _temporary_files_in_pytests_folder(tmp_path_factory):
    """Temporary files the tests and every process they start make (consoles captured to files,
    scratch scripts, torchrun's and multiprocessing's folders) go under pytest's own folder,
    which it prunes, not loose in /tmp."""
    import tempfile

    folder = str(tmp_path_factory.mktemp("tmp"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tempfile, "tempdir", folder)
        patch.setenv("TMPDIR", folder)
        yield


# scripts/test.sh runs the suite on three pytest-xdist workers (two cores): most tests wait (heartbeats, sleeps,
# restarts) more than they compute. A test marked `alone` holds wall time to a bound or a ratio that
# another test's load could push it past: it runs while no other test runs. Every test holds a lock
# shared, an `alone` one holds it exclusively; a turnstile taken first keeps a waiting `alone` test from
# being passed over by the other worker's next tests.
_XDIST = "PYTEST_XDIST_WORKER" in os.environ
# FTRUN_TEST_TIMES=FILE: one line per test appended to FILE, "nodeid wall cpu" in seconds, the CPU of
# this pytest process and of every process it started and reaped during the test (setup and teardown
# included): on a loaded machine wall time alone says little of where the suite's time goes.
_TIMES = os.environ.get("FTRUN_TEST_TIMES")


def _cpu() -> float:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _weights() -> dict:
    weights = {}
    for line in (ROOT / "tests" / "durations.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            seconds, nodeid = line.split(" ", 1)
            weights[nodeid] = float(seconds)
    return weights


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist, deal the tests out longest first (tests/durations.txt): xdist's worksteal
    gives each worker one contiguous block of the collection, and steals from the blocks' ends.
    Each block gets its share of the long tests at its start (the least loaded block takes the
    next longest), so no long test starts near the end while the other workers stand idle."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers < 2 or len(items) < 2 * workers:
        return
    weights = _weights()
    weight = {item.nodeid: weights.get(item.nodeid, 2.0) for item in items}
    ranked = sorted(items, key=lambda item: (-weight[item.nodeid], item.nodeid))
    sizes, left = [], len(items)
    for i in range(workers):  # the block sizes worksteal's first distribution makes
        sizes.append(left // (workers - i))
        left -= sizes[-1]
    blocks = [[] for _ in range(workers)]
    loads = [0.0] * workers
    for item in ranked:
        j = min((j for j in range(workers) if len(blocks[j]) < sizes[j]), key=lambda j: (loads[j], j))
        blocks[j].append(item)
        loads[j] += weight[item.nodeid]
    items[:] = [item for block in blocks for item in block]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    with contextlib.ExitStack() as stack:
        if _XDIST:  # in the folder of the session's temporary folders (xdist gives each worker one in it)
            folder = Path(item.config.option.basetemp).parent
            turnstile, lock = (stack.enter_context(open(folder / name, "a")) for name in ("turnstile", "lock"))
            fcntl.flock(turnstile, fcntl.LOCK_EX)
            fcntl.flock(lock, fcntl.LOCK_EX if item.get_closest_marker("alone") else fcntl.LOCK_SH)
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        wall, cpu = time.monotonic(), _cpu()
        yield
        if _TIMES:
            with open(_TIMES, "a") as f:
                f.write(f"{item.nodeid} {time.monotonic() - wall:.2f} {_cpu() - cpu:.2f}\n")


@pytest.fixture
def ftrun_home(tmp_path, monkeypatch):
    """A private runs folder per test, so tests never see each other's runs."""
    home = tmp_path / "ftrun-home"
    monkeypatch.setenv("FTRUN_HOME", str(home))
    return home


def run_ftrun(args, timeout=120, env=None, cwd=None, check=False) -> subprocess.CompletedProcess:
    """Run `ftrun ARGS` to completion and return its CompletedProcess (text)."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    proc = subprocess.run(FTRUN + [str(a) for a in args], capture_output=True, text=True, timeout=timeout,
                          env=full_env, cwd=cwd or ROOT)
    if check and proc.returncode != 0:
        raise AssertionError(f"ftrun {args} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


def start_ftrun(args, env=None, cwd=None, files: Sequence[str] = (), **kw) -> subprocess.Popen:
    """Start `ftrun ARGS` (environment `env` over this one's) and return its Popen (text).

    Its stdout and stderr are pipes (read them with wait_for_line, or communicate()), unless
    `files` names streams ("stderr", "stdout") to write to files instead, at proc.err_path and
    proc.out_path: a test reads those at any time without blocking (helpers.err_text), and
    shows them when it fails. A stream not named then is discarded, never a pipe nobody reads:
    a full pipe would stop ftrun mid-run."""
    import tempfile

    full_env = dict(os.environ)
    full_env.update(env or {})
    streams = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    paths = {}
    if files:
        assert set(files) <= set(streams), files
        for name in streams:
            if name in files:
                streams[name] = tempfile.NamedTemporaryFile("w+", prefix=f"ftrun-{name[3:]}-", suffix=".log",
                                                            delete=False)
                paths[name] = streams[name].name
            else:
                streams[name] = subprocess.DEVNULL
    proc = subprocess.Popen(FTRUN + [str(a) for a in args], text=True, env=full_env, cwd=cwd or ROOT, **streams, **kw)
    for name, path in paths.items():
        streams[name].close()  # the child holds its own copy
        setattr(proc, f"{name[3:]}_path", path)
    return proc


class _Lines:
    """The lines of one pipe of a child, read with a deadline: select() on the pipe, never a
    readline() that would block past any deadline while the child prints nothing."""

    def __init__(self, stream) -> None:
        self.fd = stream.fileno()
        self.buf = b""
        self.closed = False

    def next(self, deadline: float):
        """The next line, '' once the pipe is closed, None at the deadline."""
        while b"\n" not in self.buf:
            if self.closed:
                line, self.buf = self.buf, b""
                return line.decode(errors="replace")
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if select.select([self.fd], [], [], left)[0]:
                chunk = os.read(self.fd, 65536)
                self.buf += chunk
                self.closed = not chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode(errors="replace") + "\n"


def wait_for_line(proc: subprocess.Popen, needle: str, timeout: float = 60.0, stream: str = "stdout") -> str:
    """Read `proc`'s stdout (or stderr) until a line containing `needle` (the event a test waits
    for). Fails, saying what it read, at the deadline or if the pipe closes first. Later reads of
    that pipe go on from the line after `needle` (use this function for them, or communicate())."""
    readers = proc.__dict__.setdefault("_ftrun_lines", {})
    lines = readers.setdefault(stream, _Lines(getattr(proc, stream)))
    deadline = time.monotonic() + timeout
    seen = []
    while True:
        line = lines.next(deadline)
        if line is None:
            raise AssertionError(f"{needle!r} not printed within {timeout:g} s; got {''.join(seen)[-2000:]}")
        if not line:
            raise AssertionError(f"{needle!r} never printed (the {stream} of pid {proc.pid} closed); "
                                 f"got {''.join(seen)[-2000:]}")
        seen.append(line)
        if needle in line:
            return line


def really_alive(procs, timeout: float) -> list:
    """Processes still running after `timeout` (a zombie is dead, merely not reaped by init yet)."""
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    out = []
    for p in alive:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(port: int) -> bool:
    """Whether something accepts connections on 127.0.0.1:port."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


# A worker that takes optimizer steps until the file named by its argument exists:
# a live run for tests of `ftrun status` and of refusing a second run with the same id.
STEP_LOOP = """\
import os, sys, time
import torch
stop = sys.argv[1]
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
while not os.path.exists(stop):
    opt.zero_grad()
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    time.sleep(0.02)
"""
