"""What every part of a --ft member shares: its lines to the log, how it leaves the process (one
named helper per exit code, ftrun.exits' EXIT_*), how it reads a tuning knob, and its poll period.
Must never import torch or the supervisor.
"""

from __future__ import annotations

import os
import re
import sys
from typing import NoReturn

from ftrun import exits
from ftrun.wire import DETAIL_PREFIX

POLL_S = 0.005
SLOW_S = 2.0  # a protocol wait longer than this is worth a line in the log


def _log(msg: str) -> None:
    sys.stderr.write(f"ftrun.ft: {msg}\n")
    sys.stderr.flush()


def _log_detail(msg: str) -> None:
    """A line for the rank's log file only (the console filter keeps it off unless --verbose).
    Each line of a text of several (a torch hook's error with its "At:" frames) carries the prefix:
    a line without it would reach the console."""
    sys.stderr.write("".join(f"{DETAIL_PREFIX}{line}\n" for line in msg.splitlines() or [""]))
    sys.stderr.flush()


# What a collective says when a peer of the group went away (gloo: the connection reset or
# closed; ftrun: the member's incarnation is gone, or the group was given up for a newer quorum).
PEER_LOST = re.compile(r"reset by peer|connection closed|closed by peer|broken pipe|connection refused|"
                       r"are gone|is out\b|aborted|end of file|EOF", re.IGNORECASE)


def _plain(text: str, most: int = 160) -> str:
    """A collective's error for a person: without the library's source path, cut at a word."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", text.strip())
    if len(text) <= most:
        return text
    return text[:most].rsplit(" ", 1)[0] + " ..."


def _env_number(name: str, default: float, lo: float, hi: float) -> float:
    """A tuning knob from the environment; a value that is not a number in [lo, hi] is
    replaced by the default, with one line saying so (never a crash in the middle of a run)."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not lo <= value <= hi:  # also false for nan
        _log(f"{name}={raw!r} is not a number between {lo:g} and {hi:g}; using {default:g}")
        return default
    return value


def leave(code: int, line: str = "") -> NoReturn:
    """Exit the process at once with `code` (ftrun.exits' EXIT_*), after `line` in ftrun's words:
    the supervisor reads the code; no atexit handler, no thread left to join. The run cannot go
    on (EXIT_CANNOT_GO_ON): the line is the run's reason to stop, recorded in the worker's error
    file (wire.WorkerError) for the supervisor, which says it; the log file keeps it too."""
    if line and code == exits.EXIT_CANNOT_GO_ON and _record(line):
        _log_detail(line)
    elif line:
        _log(line)
    sys.stderr.flush()
    os._exit(code)


def _record(line: str, where: str = "") -> bool:
    """Write `line` as this worker's recorded error (TORCHELASTIC_ERROR_FILE); False when it
    could not be written (no such file set, a full disk): the line then goes to stderr as is."""
    import time

    from ftrun.wire import WorkerError
    from ftrun.worker.settings import current

    path = current().error_file
    if not path:
        return False
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "w") as f:
            f.write(WorkerError(line, where=where, timestamp=int(time.time())).encode())
        os.replace(path + ".tmp", path)
        return True
    except OSError:
        return False


def restart_replica(line: str, peers_decided: str = "") -> NoReturn:
    """Exit so that ftrun restarts this replica (exits.EXIT_REPLICA_RESTART), which then joins
    and heals from a peer like any newcomer. `peers_decided`: why, when the others' decision of
    a round contradicts what this member did; recorded for the supervisor, for which another
    replica's failure caused this restart, not this one's (wire.PEERS_DECIDED)."""
    if peers_decided:
        from ftrun.wire import PEERS_DECIDED

        _record(peers_decided, PEERS_DECIDED)
    leave(exits.EXIT_REPLICA_RESTART, line)
