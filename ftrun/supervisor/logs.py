"""Worker output: per-rank log files, and console lines prefixed with the rank.

Each worker incarnation writes into two pipes; a pump thread per pipe copies
every line to the rank's log file (always, in full) and to the console with a
coloured ``[rank N]`` prefix (plain when piped), unless --quiet or --ranks
hides it. The last lines of stderr are kept for the failure report.
Must never block a worker: pumps only read, and the console is shared under a lock.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
from pathlib import Path
from typing import Deque, Optional, Sequence

from rich.console import Console
from rich.text import Text

COLOURS = ("cyan", "green", "magenta", "yellow", "blue", "bright_red", "bright_cyan", "bright_green")
TAIL_LINES = 30


class ConsoleOut:
    """The supervisor's console: worker lines and ftrun's own lines, thread-safe."""

    def __init__(self, quiet: bool = False, ranks: Optional[Sequence[int]] = None) -> None:
        self.out = Console(file=sys.stdout, highlight=False, soft_wrap=True, markup=False, emoji=False)
        self.err = Console(file=sys.stderr, highlight=False, soft_wrap=True, markup=False, emoji=False)
        self.quiet = quiet
        self.ranks = set(ranks) if ranks is not None else None
        self.lock = threading.Lock()

    def shows(self, rank: int) -> bool:
        return not self.quiet and (self.ranks is None or rank in self.ranks)

    def worker_line(self, rank: int, line: str, stderr: bool) -> None:
        prefix = Text(f"[rank {rank}] ", style=COLOURS[rank % len(COLOURS)])
        text = prefix + Text(line)
        with self.lock:
            (self.err if stderr else self.out).print(text)

    def note(self, message: str, style: str = "bold") -> None:
        """One of ftrun's own lines, on stderr."""
        with self.lock:
            self.err.print(Text("ftrun: ", style=style) + Text(message))

    def renderable(self, obj) -> None:
        with self.lock:
            self.err.print(obj)


class RankLog:
    """Log files of one rank: stdout.log and stderr.log, appended across restarts."""

    def __init__(self, log_dir: Path, rank: int) -> None:
        self.dir = log_dir / f"rank{rank}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self.stdout_path = self.dir / "stdout.log"
        self.stderr_path = self.dir / "stderr.log"


class Pump:
    """Copies one pipe of one worker incarnation to its file and the console."""

    def __init__(self, read_fd: int, path: Path, rank: int, console: ConsoleOut, stderr: bool, banner: str) -> None:
        self.read_fd = read_fd
        self.path = path
        self.rank = rank
        self.console = console
        self.stderr = stderr
        self.banner = banner
        self.tail: Deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"ftrun-log-{rank}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        with open(self.path, "ab", buffering=0) as f, os.fdopen(self.read_fd, "rb", buffering=0) as pipe:
            f.write(self.banner.encode())
            pending = b""
            while True:
                try:
                    chunk = pipe.read(65536)
                except OSError:
                    chunk = b""
                if not chunk:
                    break
                f.write(chunk)
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for raw in lines:
                    self._line(raw)
            if pending:
                self._line(pending)
        self.done.set()

    def _line(self, raw: bytes) -> None:
        line = raw.decode("utf-8", errors="replace").rstrip("\r")
        if self.stderr:
            self.tail.append(line)
        if self.console.shows(self.rank):
            self.console.worker_line(self.rank, line, self.stderr)


def open_pipes():
    """(read, write) pairs for stdout and stderr of one worker."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    return (out_r, out_w), (err_r, err_w)
