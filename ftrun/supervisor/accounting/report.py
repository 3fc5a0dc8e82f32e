"""Words for what happened to a worker: exit reasons and the final failure report.

Names the reasons a user meets (killed by a signal, exited with a traceback,
hung), from the worker's error file (TORCHELASTIC_ERROR_FILE) when it wrote one,
else from the tail of its stderr, and prints the report of the first failure with the tail of its stderr
and where the full log is. Must never decide anything or touch processes.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import List, Optional, Sequence

import psutil
from rich.text import Text

from ftrun.supervisor.workers.spawn import signal_name
from ftrun.supervisor.workers.worker import Failure, Worker
from ftrun.supervisor.workers.worker import WorkerState
from ftrun.wire import WorkerError, first_line

SIGNAL_HINTS = {
    "SIGSEGV": "segmentation fault",
    "SIGABRT": "aborted",
    "SIGBUS": "bus error",
    "SIGTERM": "terminated",
}


# A worker's memory at its last sample this close to the limit makes the out-of-memory killer
# the likely sender of a SIGKILL.
OOM_NEAR = 0.8


def exit_reason(exit_code: Optional[int], sig: Optional[int], stderr_tail: List[str], pid: int = 0,
                rss: Optional[int] = None) -> str:
    """What ended a worker, in words. A SIGKILL reaching here was not ftrun's (its own kills
    are stops or hangs): it is put on the out-of-memory killer only on evidence."""
    if sig:
        name = signal_name(sig)
        hint = sigkill_sender(pid, rss) if name == "SIGKILL" else SIGNAL_HINTS.get(name)
        return f"killed by {name} (signal {sig}{'; ' + hint if hint else ''})"
    last_error = _last_exception_line(stderr_tail)
    if last_error:
        return f"exited {exit_code} with a traceback: {last_error}"
    return f"exited with code {exit_code}"


def sigkill_sender(pid: int, rss: Optional[int]) -> str:
    """Who sent a SIGKILL that ftrun did not: the out-of-memory killer where the kernel's log
    names the process, or where its memory at the last sample was near the limit; else outside."""
    if pid and _kernel_log_says_oom(pid):
        return "the out-of-memory killer, says the kernel log"
    limit = memory_limit()
    if rss and limit and rss >= OOM_NEAR * limit:
        return (f"likely the out-of-memory killer: it used {rss / 2**30:.1f} GiB of the "
                f"{limit / 2**30:.1f} GiB limit at its last sample")
    return "sent from outside ftrun"


def _kernel_log_says_oom(pid: int, max_records: int = 200_000) -> bool:
    """Whether the kernel's log (/dev/kmsg; unreadable: no claim) has the OOM killer's line for `pid`."""
    needles = (f"Killed process {pid} ".encode(), f",pid={pid},".encode())
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        for _ in range(max_records):  # one record per read
            try:
                record = os.read(fd, 8192)
            except BrokenPipeError:  # records overwritten while read: go on with the next
                continue
            except OSError:  # EAGAIN: the end of the log
                return False
            if not record:
                return False
            if any(n in record for n in needles):
                return True
        return False
    finally:
        os.close(fd)


def memory_limit() -> Optional[int]:
    """The memory this process may use: its cgroup's limit (v2 or v1) or the machine's, the lower."""
    limits = []
    try:
        limits.append(psutil.virtual_memory().total)
    except Exception:
        pass
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:  # v1 says "no limit" with a huge number, v2 "max"
            limits.append(int(text))
    return min(limits) if limits else None


def worker_error(path: Path, since: float) -> Optional[WorkerError]:
    """The error a worker wrote to its TORCHELASTIC_ERROR_FILE at `path` since `since` (its
    incarnation's start; an older file is a previous incarnation's); None when it wrote none."""
    try:
        if path.stat().st_mtime < since - 1.0:  # file times may be coarser than the clock
            return None
        return WorkerError.decode(path.read_bytes()[:1_000_000])
    except OSError:
        return None


def error_reason(exit_code: Optional[int], error: WorkerError) -> str:
    """exit_reason() for a worker that wrote its error file."""
    return f"exited {exit_code} with a traceback: {error.message}"


def _last_exception_line(tail: List[str]) -> Optional[str]:
    """The exception of the last traceback: the first unindented line after it (lines the
    process wrote after the exception, such as ftrun's figures at exit, are not it)."""
    starts = [i for i, line in enumerate(tail) if line.startswith("Traceback")]
    if not starts:
        return None
    for line in tail[starts[-1] + 1:]:
        s = line.strip()
        if s and not s.startswith(("File ", "^", "~")) and not line.startswith(" "):
            return first_line(s)
    return None


def early_signature(tail: List[str]) -> Optional[str]:
    """What identifies a script's error across restarts: the innermost frame of its last
    traceback (file and line) and the exception line that follows it. None without one (a
    signal, a plain exit code). A long traceback's head may be out of the tail: the last frame
    and the exception are enough."""
    frames = [i for i, line in enumerate(tail) if line.lstrip().startswith('File "') and ", line " in line]
    if not frames:
        return None
    for line in tail[frames[-1] + 1:]:
        if line.strip() and not line.startswith((" ", "\t", "^", "~")):
            return f"{first_line(line)} | {tail[frames[-1]].strip()}"
    return None


def failure_report(failure: Failure, attempts: str, workers: Sequence[Worker] = ()) -> Text:
    """The final report: one headline a person (and grep) can read, then the evidence.

    A rank that exited 0 while its peers still needed it is named first: the peers'
    errors that follow ("connection closed") are its consequence, not the cause."""
    body = Text()
    body.append("ftrun: run failed: ", style="bold red")
    early = sorted((w for w in workers if w.state == WorkerState.DONE and w.finished_at
                    and w.finished_at <= failure.when and w.rank != failure.rank), key=lambda w: w.finished_at)
    for w in early:
        body.append(f"rank {w.rank}", style="bold")
        body.append(f" (pid {w.pid}) exited 0 at {_clock(w.finished_at)} while its peers were still running; ")
    if early:
        body.append("the failure that followed is ")
    body.append(f"rank {failure.rank}", style="bold")
    body.append(f" (pid {failure.pid}) {'at' if early else 'failed first at'} {_clock(failure.when)}: "
                f"{failure.reason}\n")
    body.append(f"ftrun: {attempts}\n")
    if failure.stderr_tail:
        body.append("ftrun: last lines of its stderr:\n", style="dim")
        for line in failure.stderr_tail[-15:]:
            body.append(f"    {line}\n")
    if failure.log_path:
        body.append("ftrun: full log: ", style="dim")
        body.append(failure.log_path)
    return body


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t * 1000) % 1000:03d}"
