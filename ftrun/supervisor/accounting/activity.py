"""Whether a worker's process does anything at all: CPU, I/O, or work in its child processes.

The default hang rule may only take a worker that does nothing. A rank that waits between
steps on a download, a slow file system, a pipe, or a tool it runs with subprocess uses
almost no CPU, yet makes progress: its read and write counters move, or its children work.
So a sample is quiet only when the process used (almost) no CPU, its I/O counters did not
move, and its child processes neither changed, used CPU, nor moved their I/O counters.
psutil reads /proc; the reads count against this process, never the worker's. Finding a
process's children reads the stat file of every process on the machine, so a tick makes one
such pass (children_of) for all its workers, not one per worker.
ProcessSampler keeps each worker's record of those samples.
Must never signal or change a process: it only looks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import psutil

from ftrun.supervisor.workers.worker import Worker

# Below this share of one CPU a process is idle (a worker's progress thread costs a fraction of it).
IDLE_CPU_PERCENT = 5.0


@dataclass
class Sample:
    stopped: bool       # its state is "stopped" (SIGSTOP, SIGTSTP)
    cpu_percent: float  # of one CPU, since the last sample
    rss_bytes: int
    quiet: bool         # no CPU, no I/O, no child at work since the last sample


def _io(proc: psutil.Process) -> Tuple[int, ...]:
    """The process's read/write syscalls and characters (pipes, terminals and files alike)."""
    try:
        c = proc.io_counters()
    except (psutil.AccessDenied, AttributeError, NotImplementedError):
        return ()
    return (c.read_count, c.write_count, getattr(c, "read_chars", 0), getattr(c, "write_chars", 0))


Children = Dict[int, List[psutil.Process]]


def children_of() -> Children:
    """Every live process's children, from one pass over the process table."""
    kids: Children = {}
    for p in psutil.process_iter(["ppid"]):
        ppid = p.info.get("ppid")
        if ppid:
            kids.setdefault(ppid, []).append(p)
    return kids


def _descendants(pid: int, kids: Children) -> List[psutil.Process]:
    found, todo = [], [pid]
    while todo:
        for child in kids.get(todo.pop(), ()):
            found.append(child)
            todo.append(child.pid)
    return found


class ProcessWatch:
    """Samples one worker process, once a second (the supervisor's metrics tick)."""

    def __init__(self, pid: int, kids: Children) -> None:
        self.proc = psutil.Process(pid)
        self.proc.cpu_percent(None)  # the first call only starts the measurement
        self._io = _io(self.proc)
        self._kids, self._kids_cpu = self._children(kids)
        self._at = time.monotonic()

    def _children(self, tree: Children) -> Tuple[Tuple[Tuple[int, Tuple[int, ...]], ...], float]:
        """(each live descendant's pid and I/O counters, the CPU seconds of all descendants:
        the live ones and those the worker has reaped)."""
        kids = []
        times = self.proc.cpu_times()
        cpu = times.children_user + times.children_system
        for child in _descendants(self.proc.pid, tree):
            try:
                with child.oneshot():
                    t = child.cpu_times()
                    cpu += t.user + t.system
                    kids.append((child.pid, _io(child)))
            except psutil.Error:
                kids.append((child.pid, ()))  # gone mid-read: the set changed, which is activity anyway
        return tuple(sorted(kids)), cpu

    def sample(self, kids: Children) -> Sample:
        """Raises psutil.Error once the process is gone. `kids`: children_of() of this tick."""
        now = time.monotonic()
        with self.proc.oneshot():
            cpu = self.proc.cpu_percent(None)
            stopped = self.proc.status() == psutil.STATUS_STOPPED
            rss = self.proc.memory_info().rss
            io = _io(self.proc)
        kids, kids_cpu = self._children(kids)
        dt = max(1e-3, now - self._at)
        kids_percent = max(0.0, kids_cpu - self._kids_cpu) / dt * 100.0
        quiet = (cpu < IDLE_CPU_PERCENT and io == self._io and kids == self._kids
                 and kids_percent < IDLE_CPU_PERCENT)
        self._io, self._kids, self._kids_cpu, self._at = io, kids, kids_cpu, now
        return Sample(stopped, cpu, rss, quiet)


def watch(pid: Optional[int], kids: Children) -> Optional[ProcessWatch]:
    """A watch of `pid`, or None when there is no such process (any more). `kids`: children_of()."""
    if not pid:
        return None
    try:
        return ProcessWatch(pid, kids)
    except psutil.Error:
        return None


class ProcessSampler:
    """Once a second: every live worker's CPU, memory, and whether it is stopped or quiet, into
    its record (the state file shows them; the default hang rule reads them)."""

    def __init__(self) -> None:
        self._procs: Dict[int, ProcessWatch] = {}

    def sample(self, workers: Sequence[Worker], now: float) -> None:
        live = [w for w in workers if w.pid and w.alive]
        kids = children_of() if live else {}
        for w in live:
            proc = self._procs.get(w.pid)
            if proc is None:
                proc = watch(w.pid, kids)  # its first sample comes a second from now
                if proc is not None:
                    self._procs[w.pid] = proc
                continue
            try:
                sample = proc.sample(kids)
            except (psutil.Error, OSError):
                self._procs.pop(w.pid, None)
                continue
            w.cpu_percent = sample.cpu_percent
            w.rss_bytes = sample.rss_bytes
            w.note_process(sample.stopped, sample.quiet, now)
