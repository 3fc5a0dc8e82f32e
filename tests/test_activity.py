"""The supervisor's process samples (ftrun.supervisor.accounting.activity), in-process, on real
processes: a worker's child at work keeps it from being quiet, and a tick reads the process
table once for all its workers (a tree walk reads every process's stat file: once per worker,
an 8-worker node with hundreds of loader processes spent a tenth of a core on it)."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

from ftrun.supervisor.accounting.activity import ProcessSampler, children_of
from ftrun.supervisor.workers.worker import Worker, WorkerSpec, WorkerState

pytestmark = pytest.mark.quick

# A worker-like parent with two children: one idle, one that works once the file `go` exists.
PARENT = """\
import os, subprocess, sys, time
idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
busy = subprocess.Popen([sys.executable, "-c", '''
import os, sys, time
start = time.time()
while not os.path.exists(sys.argv[1]) and time.time() < start + 60:
    time.sleep(0.01)
end = time.time() + 60
while time.time() < end:
    pass
''', sys.argv[1]])
print(idle.pid, busy.pid, flush=True)
time.sleep(60)
"""


def _worker(rank: int, pid: int) -> Worker:
    w = Worker(WorkerSpec(rank, rank))
    w.pid, w.state = pid, WorkerState.RUNNING
    return w


def _family(tmp_path, n):
    procs = [subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path / f"go{i}")], stdout=subprocess.PIPE,
                              text=True) for i in range(n)]
    kids = [tuple(int(x) for x in p.stdout.readline().split()) for p in procs]
    return procs, kids


def _kill(procs, kids) -> None:
    """Each family, its children by the pids they printed: a test may have patched
    psutil.Process.children, and a child left behind would spin on."""
    for p, family in zip(procs, kids):
        for pid in family:
            try:
                psutil.Process(pid).kill()
            except psutil.NoSuchProcess:
                pass
        p.kill()
        p.wait()


def test_a_tick_reads_the_process_table_once_and_finds_every_workers_children(tmp_path, monkeypatch):
    procs, kids = _family(tmp_path, 3)
    try:
        tree = children_of()
        for p, (idle, busy) in zip(procs, kids):
            assert sorted(c.pid for c in tree.get(p.pid, ())) == sorted([idle, busy])
        walks, passes = [], []
        monkeypatch.setattr(psutil.Process, "children", lambda self, recursive=False: walks.append(self.pid) or [])
        real_iter = psutil.process_iter
        monkeypatch.setattr(psutil, "process_iter", lambda *a, **k: passes.append(1) or real_iter(*a, **k))
        sampler = ProcessSampler()
        workers = [_worker(r, p.pid) for r, p in enumerate(procs)]
        for now in (1.0, 2.0, 3.0):
            sampler.sample(workers, now)
        assert walks == [] and len(passes) == 3, (walks, passes)
    finally:
        _kill(procs, kids)


def test_a_worker_whose_child_works_is_not_quiet_and_one_whose_children_idle_is(tmp_path):
    procs, kids = _family(tmp_path, 2)
    try:
        sampler = ProcessSampler()
        workers = [_worker(r, p.pid) for r, p in enumerate(procs)]
        now = 0.0
        sampler.sample(workers, now)  # the watches start

        def tick() -> None:
            nonlocal now
            time.sleep(0.5)
            now += 1
            sampler.sample(workers, now)

        # Once the interpreters have started, every family only sleeps: each worker is quiet.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(w.idle_since for w in workers):
            tick()
        assert all(w.idle_since for w in workers), [w.idle_since for w in workers]
        quiet_since = workers[0].idle_since
        (tmp_path / "go1").touch()  # worker 1's busy child spins from now on
        while time.monotonic() < deadline and workers[1].idle_since is not None:
            tick()
        assert workers[1].idle_since is None, "a worker whose child spins was sampled quiet"
        tick()
        assert workers[0].idle_since == quiet_since and workers[1].idle_since is None
    finally:
        _kill(procs, kids)
