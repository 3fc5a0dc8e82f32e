"""Words for what happened to a worker: exit reasons and the final failure report.

Names the reasons a user meets (killed by a signal, exited with a traceback,
hung), from the worker's error file (TORCHELASTIC_ERROR_FILE) when it wrote one,
else from the tail of its stderr, and prints the report of the first failure with the tail of its stderr
and where the full log is. Must never decide anything or touch processes.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import List, Optional, Sequence

from rich.text import Text

from ftrun.supervisor.spawn import signal_name
from ftrun.supervisor.worker import WorkerState
from ftrun.supervisor.worker import Failure, Worker
from ftrun.wire import WorkerError, first_line

SIGNAL_HINTS = {
    "SIGKILL": "often the out-of-memory killer",
    "SIGSEGV": "segmentation fault",
    "SIGABRT": "aborted",
    "SIGBUS": "bus error",
    "SIGTERM": "terminated",
}


def exit_reason(exit_code: Optional[int], sig: Optional[int], stderr_tail: List[str]) -> str:
    if sig:
        name = signal_name(sig)
        hint = SIGNAL_HINTS.get(name)
        return f"killed by {name} (signal {sig}{'; ' + hint if hint else ''})"
    last_error = _last_exception_line(stderr_tail)
    if last_error:
        return f"exited {exit_code} with a traceback: {last_error}"
    return f"exited with code {exit_code}"


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
