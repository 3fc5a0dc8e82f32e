"""Worker output: per-rank log files, and console lines prefixed with the rank.

Each worker incarnation writes into two pipes; a pump thread per pipe copies
every line to the rank's log file (always, in full) and to the console with a
coloured ``[rank N]`` prefix (plain when piped), unless --quiet, --ranks,
--local-ranks-filter or torchrun's --redirects hide it (--tee keeps it).
ftrun's own per-rank chatter in a worker's stderr (joins, state transfers,
traffic figures: `chatter()`) stays in the log file unless --verbose; the
script's own lines are never held back. The last lines of stderr are kept for
the failure report, which is printed after drain(): the workers' buffered
lines come first.
Must never block a worker: pumps only read, and the console is shared under a lock.
"""

from __future__ import annotations

import collections
import os
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any, Deque, Dict, Optional, Sequence

from rich.console import Console
from rich.text import Text

from ftrun.protocol import DETAIL_PREFIX

COLOURS = ("cyan", "green", "magenta", "yellow", "blue", "bright_red", "bright_cyan", "bright_green")
TAIL_LINES = 30
DRAIN_S = 5.0

# What ftrun's worker-side code writes into a worker's stderr. ftrun.ft says which of its lines
# are for the log file (DETAIL_PREFIX: joins, state received, groups formed, slow waits, saves
# written) and which a person must see (FT_PREFIX: something went wrong, a resume from a
# checkpoint); the hooks' traffic lines are for the log file, except the figures at exit of one
# rank per node; which hook was registered is said by that rank too.
FT_PREFIX = "ftrun.ft: "
HOOK_LINE = re.compile(r"ftrun: rank \d+: (?:(registered DDP comm hook )|hook \S+ step \d+: .*?( \(at exit\))?$)")
# A worker stopped by Ctrl-C says where, in its log (ftrun.worker.bootstrap): the console has ftrun's line.
INTERRUPTED_LINE = re.compile(r"ftrun: rank \d+: stopped by SIGINT \(KeyboardInterrupt\) in ")


def chatter(line: str, speaker: bool) -> bool:
    """Is this stderr line of a worker ftrun's own per-rank chatter, kept off the console by
    default? `speaker`: the worker is its node's local rank 0, the one that says what every
    rank would say alike (the hook registered, traffic figures at exit)."""
    if line.startswith(DETAIL_PREFIX):
        return True
    if line.startswith(FT_PREFIX):
        return False
    if INTERRUPTED_LINE.match(line):
        return True
    m = HOOK_LINE.match(line)
    if m is None:
        return False
    return not (speaker and (m.group(1) or m.group(2)))


class ConsoleOut:
    """The supervisor's console: worker lines and ftrun's own lines, thread-safe."""

    def __init__(self, quiet: bool = False, ranks: Optional[Sequence[int]] = None, nproc: int = 1,
                 local_ranks: Optional[Sequence[int]] = None, hidden: Optional[Dict[int, int]] = None,
                 verbose: bool = False) -> None:
        self.out = Console(file=sys.stdout, highlight=False, soft_wrap=True, markup=False, emoji=False)
        self.err = Console(file=sys.stderr, highlight=False, soft_wrap=True, markup=False, emoji=False)
        self.quiet = quiet
        self.ranks = set(ranks) if ranks is not None else None
        self.nproc = max(1, nproc)
        self.local_ranks = set(local_ranks) if local_ranks is not None else None
        self.hidden = dict(hidden or {})  # local rank (-1: every one) -> torchrun Std bits kept off the console
        self.verbose = verbose  # ftrun's per-rank chatter on the console too (--verbose, FTRUN_VERBOSE=1)
        self.lock = threading.Lock()
        # A progress line is drawn on the terminal (ftrun.supervisor.waits): every line goes through
        # self.err, which prints above it; stdout's console would write through the drawing.
        self.live = False

    @classmethod
    def for_config(cls, cfg: Any) -> "ConsoleOut":
        # torchrun: --redirects sends a stream to its file only, --tee to file and console;
        # ftrun always writes the files, so only what is redirected and not teed leaves the console.
        hidden: Dict[int, int] = {}
        for lr in set(cfg.redirects) | set(cfg.tee):
            red = cfg.redirects.get(lr, cfg.redirects.get(-1, 0))
            tee = cfg.tee.get(lr, cfg.tee.get(-1, 0))
            hidden[lr] = red & ~tee
        return cls(cfg.quiet, cfg.ranks, cfg.nproc, cfg.local_ranks_filter, hidden, cfg.verbose)

    def shows(self, rank: int, stderr: bool = False) -> bool:
        if self.quiet or (self.ranks is not None and rank not in self.ranks):
            return False
        local = rank % self.nproc  # every node runs a contiguous block of nproc ranks
        if self.local_ranks is not None and local not in self.local_ranks:
            return False
        bits = self.hidden.get(local, self.hidden.get(-1, 0))
        return not bits & (2 if stderr else 1)

    def worker_lines(self, rank: int, lines: Sequence[str], stderr: bool) -> None:
        """Several lines of one worker in one write: a chatty worker must not fall far behind."""
        style = COLOURS[rank % len(COLOURS)]
        text = Text()
        for i, line in enumerate(lines):
            text.append(f"[rank {rank}] ", style=style)
            text.append(line + ("\n" if i < len(lines) - 1 else ""))
        with self.lock:
            (self.err if stderr or (self.live and self.out.is_terminal) else self.out).print(text)

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
                if lines:
                    self._lines(lines)
            if pending:
                self._lines([pending])
        self.done.set()

    def _lines(self, raws: Sequence[bytes]) -> None:
        lines = [raw.decode("utf-8", errors="replace").rstrip("\r") for raw in raws]
        if self.stderr:
            self.tail.extend(lines)
        if not self.console.shows(self.rank, self.stderr):
            return
        if self.stderr and not self.console.verbose:
            speaker = self.rank % self.console.nproc == 0
            lines = [line for line in lines if not chatter(line, speaker)]
        if lines:
            self.console.worker_lines(self.rank, lines, self.stderr)


def drain(pumps: Sequence["Pump"], timeout: float = DRAIN_S) -> None:
    """Wait until every pump has copied what its worker wrote (bounded: a process a worker
    left behind may hold its pipe open), so a final report comes after the workers' lines."""
    deadline = time.monotonic() + timeout
    for p in pumps:
        p.done.wait(max(0.0, deadline - time.monotonic()))


def open_pipes():
    """(read, write) pairs for stdout and stderr of one worker."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    return (out_r, out_w), (err_r, err_w)
