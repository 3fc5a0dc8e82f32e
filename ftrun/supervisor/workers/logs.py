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
A pump's work is linear in the bytes: a line without a newline is held up to
MAX_LINE bytes and then shown in pieces, a line that redraws itself with '\r'
(a progress bar) keeps only its newest state, shown at most every PROGRESS_S.
A full disk stops the log files, never the pump: it is said once and counted
(WriteTrouble, the state file's `not_written`); a pipe backlogged because the
pump fell behind is an output stall in the goodput.
Must never block a worker: pumps only read, and the console is shared under a lock;
a pump reads its pipe to the end whatever the file or the console do.
"""

from __future__ import annotations

import collections
import fcntl
import os
import re
import sys
import termios
import threading
import time
from pathlib import Path
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple

from rich.console import Console
from rich.text import Text

from ftrun.wire import DETAIL_PREFIX

COLOURS = ("cyan", "green", "magenta", "yellow", "blue", "bright_red", "bright_cyan", "bright_green")
TAIL_LINES = 30
DRAIN_S = 5.0
READ_BYTES = 1 << 16
MAX_LINE = 1 << 16      # a longer line reaches the console in pieces of this size (the log gets it whole)
PROGRESS_S = 1.0        # a progress bar ('\r') is shown at most this often per pipe, and its last state at the end
RETRY_S = 30.0          # a log file that could not be written is tried again this much later
PIPE_BYTES = 1 << 20    # each worker pipe's buffer: a burst of output is not a wait for the worker
# A pipe half full is backlogged: its writer waits, or soon will (the pipe is made of pages, and
# small writes leave part of each unused: a pipe whose writer waits may hold half its capacity).
BACKLOG = 0.5
MIN_STALL_S = 0.05      # shorter waits on a full pipe are not worth a window in the books

# What ftrun's worker-side code writes into a worker's stderr. ftrun.ft says which of its lines
# are for the log file (DETAIL_PREFIX: joins, state received, groups formed, slow waits, saves
# written) and which a person must see (FT_PREFIX: something went wrong, a resume from a
# checkpoint); the hooks' traffic lines are for the log file, except the figures at exit of one
# rank per node; which hook was registered is said by that rank too.
FT_PREFIX = "ftrun.ft: "
HOOK_LINE = re.compile(r"ftrun: rank \d+: (?:(registered DDP comm hook )|hook \S+ step \d+: .*?( \(at exit\))?$)")
# A worker stopped by Ctrl-C says where, in its log (ftrun.worker.bootstrap): the console has ftrun's line.
INTERRUPTED_LINE = re.compile(r"ftrun: rank \d+: stopped by SIGINT \(KeyboardInterrupt\) in ")
# torch's C++ warning of a store read that timed out ("[W1127 23:53:02.756 socket.cpp:494] [c10d]
# waitForInput: socket ... timed out after 10000ms"): under --ft a group formation given up when a
# member died ends that way a few seconds later, on its own thread. ftrun says what happened in
# its own words (the failure line); the exception that follows such a timeout still shows. The
# quorum watcher's read (worker/ft/member/watch.py) times out so every 10 s of a steady run. Once the
# process has a default group, torch puts its rank before the line ("[rank0]:[W1203 ...").
STORE_TIMEOUT_LINE = re.compile(r"(?:\[rank\d+\]:)?\[W\d{4} [^\]]*socket\.cpp:\d+\] \[c10d\] waitForInput: ")
# A worker whose collective failed because a peer went away writes its traceback between these two
# lines (ftrun.worker.bootstrap, PEER_LOST_BEGIN and PEER_LOST_END): kept in the rank's log, off the
# console (the peer's failure is ftrun's line), and out of the failure report's tail but for the
# traceback itself.
PEER_LOST_BEGIN = re.compile(r"ftrun: rank \d+: a peer went away mid-collective \(")
PEER_LOST_END = re.compile(r"ftrun: rank \d+: end of the traceback of the collective a peer left$")
# A framework's part of --ft (ftrun.worker.frameworks: a Trainer's fp16, a Lightning strategy it
# cannot drive...) said why this script cannot heal, and what to do: ftrun's own advice for a script
# without ftrun.ft would not fit it (ftrun.supervisor.ft.quorum_view, ConsoleOut.framework_said).
FRAMEWORK_LINE = re.compile(r"ftrun: --ft: ")


def chatter(line: str, speaker: bool) -> bool:
    """Is this stderr line of a worker ftrun's own per-rank chatter, kept off the console by
    default? `speaker`: the worker is its node's local rank 0, the one that says what every
    rank would say alike (the hook registered, traffic figures at exit)."""
    if line.startswith(DETAIL_PREFIX):
        return True
    if line.startswith(FT_PREFIX):
        return False
    if INTERRUPTED_LINE.match(line) or STORE_TIMEOUT_LINE.match(line):
        return True
    m = HOOK_LINE.match(line)
    if m is None:
        return False
    return not (speaker and (m.group(1) or m.group(2)))


class _Console(Console):
    """A rich Console whose reader may go away (`ftrun ... | head`). rich's answer to a closed
    pipe is SystemExit(1) from whichever thread printed: a pump would stop reading its pipe (the
    worker then dies of BrokenPipeError at its next print) and a good run would exit 1. Here the
    console goes quiet instead, its stream pointed at /dev/null (the final flush finds nothing
    to write); the log files still get every byte, and the run's status is the workers'."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), self.file.fileno())
        except (OSError, ValueError, AttributeError):
            pass


class ConsoleOut:
    """The supervisor's console: worker lines and ftrun's own lines, thread-safe."""

    def __init__(self, quiet: bool = False, ranks: Optional[Sequence[int]] = None, nproc: int = 1,
                 local_ranks: Optional[Sequence[int]] = None, hidden: Optional[Dict[int, int]] = None,
                 verbose: bool = False) -> None:
        self.out = _Console(file=sys.stdout, highlight=False, soft_wrap=True, markup=False, emoji=False)
        self.err = _Console(file=sys.stderr, highlight=False, soft_wrap=True, markup=False, emoji=False)
        self.quiet = quiet
        self.ranks = set(ranks) if ranks is not None else None
        self.nproc = max(1, nproc)
        self.local_ranks = set(local_ranks) if local_ranks is not None else None
        self.hidden = dict(hidden or {})  # local rank (-1: every one) -> torchrun Std bits kept off the console
        self.verbose = verbose  # ftrun's per-rank chatter on the console too (--verbose, FTRUN_VERBOSE=1)
        self.lock = threading.Lock()
        self.trouble = WriteTrouble(self)
        # A progress line is drawn on the terminal (ftrun.supervisor.accounting.waits): every line goes through
        # self.err, which prints above it; stdout's console would write through the drawing.
        self.live = False
        self.framework_said = False  # a worker's framework said why it cannot heal (FRAMEWORK_LINE)

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


class WriteTrouble:
    """What ftrun could not write while the run went on (a full disk under --log-dir or
    FTRUN_HOME), said once per kind on the console and counted for `ftrun status`; and the
    stretches in which a worker waited on its full output pipe (goodput: output). Thread-safe:
    every pump reports here."""

    WHAT = {"logs": "the workers' logs", "state": "the run's state"}
    THEN = {"logs": ", and the console still shows the workers' output; free space there or give --log-dir "
                    "another folder",
            "state": ", but `ftrun status` shows older figures; free space there or set FTRUN_HOME to another folder"}

    def __init__(self, console: "ConsoleOut") -> None:
        self.console = console
        self.lock = threading.Lock()
        self.kinds: Dict[str, Dict[str, Any]] = {}  # kind -> folder, why, failed, bytes_lost, since
        self.stalls: List[Tuple[float, float]] = []  # output stalls not yet taken by the books
        self.working: Dict[int, Tuple[float, int, int]] = {}  # pump -> (since, its pipe, full at)

    def failed(self, kind: str, folder: Path, err: OSError) -> None:
        """A write of `kind` (logs, state) into `folder` failed with `err`: said the first time."""
        why = err.strerror or str(err)
        with self.lock:
            rec = self.kinds.get(kind)
            first = rec is None
            if first:
                rec = self.kinds[kind] = {"folder": str(folder), "why": why, "failed": 0, "bytes_lost": 0,
                                          "since": time.time()}
            rec["failed"] += 1
        if first:
            self.console.note(f"cannot write {self.WHAT.get(kind, kind)} in {folder} ({why}): training goes on"
                              f"{self.THEN.get(kind, '')}", style="bold yellow")

    def lost_bytes(self, n: int) -> None:
        with self.lock:
            rec = self.kinds.get("logs")
            if rec is not None:
                rec["bytes_lost"] += n

    def fields(self) -> Optional[Dict[str, Any]]:
        """The state file's `not_written`: per kind, where, why, failed writes and lost bytes."""
        with self.lock:
            return {k: dict(v) for k, v in self.kinds.items()} or None

    def stalled(self, start: float, end: float) -> None:
        """A worker may have waited on its full pipe from `start` to `end` (wall clock)."""
        if end - start < MIN_STALL_S:
            return
        with self.lock:
            if self.stalls and start <= self.stalls[-1][1]:
                self.stalls[-1] = (self.stalls[-1][0], max(end, self.stalls[-1][1]))
            else:
                self.stalls.append((start, end))

    def busy(self, pump: object, since: Optional[float], fd: int = -1, full: int = 0) -> None:
        """`pump` works on what it read at `since` (None: it is back at its pipe). A pump held up
        there (a console that does not take its lines) is a stall while its pipe is full."""
        with self.lock:
            if since is None:
                self.working.pop(id(pump), None)
            else:
                self.working[id(pump)] = (since, fd, full)

    def take_stalls(self) -> List[Tuple[float, float]]:
        """The stalls since the last call, and those still going on (up to now)."""
        now = time.time()
        with self.lock:
            out, self.stalls = self.stalls, []
            for since, fd, full in self.working.values():
                if now - since >= MIN_STALL_S and pending_bytes(fd) >= full:
                    out.append((since, now))
        return out


class RankLog:
    """Log files of one rank: stdout.log and stderr.log, appended across restarts."""

    def __init__(self, log_dir: Path, rank: int) -> None:
        self.dir = log_dir / f"rank{rank}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self.stdout_path = self.dir / "stdout.log"
        self.stderr_path = self.dir / "stderr.log"


class LineBuffer:
    """A worker's bytes cut into the lines the console shows, in time linear in the bytes.

    A line ends at '\n'. Within a line, '\r' goes back to its start, as on a terminal: only the
    latest segment is kept (a progress bar's newest state), so a bar that redraws itself for an
    hour holds one bar's bytes, not all of them. A line longer than `limit` bytes is cut into
    pieces of at most that size (at a UTF-8 character's start). The log file gets every byte."""

    def __init__(self, limit: int = MAX_LINE) -> None:
        self.limit = limit
        self.pending = bytearray()   # the current segment: bytes since the line's last '\r'
        self.shown = b""             # the last whole '\r'-ended segment that had text
        self.redrawn = False         # the current line has a '\r': it is a progress display

    def feed(self, chunk: bytes) -> List[bytes]:
        """The lines (and pieces of a too long line) that `chunk` completes."""
        out: List[bytes] = []
        start = 0
        while True:
            nl = chunk.find(b"\n", start)
            if nl < 0:
                break
            self._add(chunk, start, nl, out)
            out.append(bytes(self.pending) if self.pending else self.shown)
            self.pending, self.shown, self.redrawn = bytearray(), b"", False
            start = nl + 1
        self._add(chunk, start, len(chunk), out)
        return out

    def _add(self, chunk: bytes, start: int, end: int, out: List[bytes]) -> None:
        cr = chunk.rfind(b"\r", start, end)
        if cr >= 0:
            self.redrawn = True
            last = chunk.rfind(b"\r", start, cr)  # the segment that this '\r' ends
            seg = bytes(self.pending) + chunk[start:cr] if last < 0 else chunk[last + 1:cr]
            if seg:
                self.shown = seg[-self.limit:]
            self.pending = bytearray()
            start = cr + 1
        self.pending += chunk[start:end]
        while len(self.pending) > self.limit:
            cut = self.limit
            while cut > self.limit - 4 and self.pending[cut] & 0xC0 == 0x80:
                cut -= 1  # not inside a UTF-8 character
            out.append(bytes(self.pending[:cut]))
            del self.pending[:cut]

    def progress(self) -> Optional[bytes]:
        """The newest state of a line that redraws itself ('\r'), None for any other line."""
        if not self.redrawn:
            return None
        return bytes(self.pending) if self.pending else self.shown

    def rest(self) -> Optional[bytes]:
        """What is left at the end of the output: the last line, unfinished."""
        last = bytes(self.pending) if self.pending else self.shown
        return last or None


class LogFile:
    """One log file of a rank, written while it can be. A write that fails (a full disk) never
    stops the pump: the bytes are counted as lost, said once (WriteTrouble), and writing is tried
    again RETRY_S later; what was lost meanwhile is marked in the file."""

    def __init__(self, path: Path, trouble: "WriteTrouble") -> None:
        self.path = path
        self.trouble = trouble
        self.fd: Optional[int] = None
        self.retry_at = 0.0
        self.lost = 0  # bytes not written since the last write that worked

    def write(self, data: bytes) -> None:
        now = time.monotonic()
        if self.fd is None and now < self.retry_at:
            self._lose(len(data))
            return
        view = memoryview(data)
        try:
            if self.fd is None:
                self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            if self.lost:
                self._all(memoryview(f"\n===== ftrun: {self.lost} bytes of output were not written here "
                                     f"(the disk was full) =====\n".encode()))
                self.lost = 0
            view = self._all(view)
        except OSError as e:
            self._lose(len(view))
            self.trouble.failed("logs", self.path.parent.parent, e)
            self.close()
            self.retry_at = now + RETRY_S

    def _all(self, view: memoryview) -> memoryview:
        while view:
            view = view[os.write(self.fd, view):]  # type: ignore[arg-type]
        return view

    def _lose(self, n: int) -> None:
        self.lost += n
        self.trouble.lost_bytes(n)

    def close(self) -> None:
        if self.fd is not None:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = None


class Pump:
    """Copies one pipe of one worker incarnation to its file and the console.

    Whatever happens to the file or the console, it reads the pipe to its end: a pump that
    stopped would close the pipe under the worker (BrokenPipeError at its next print). A read
    that finds the pipe (nearly) full means the worker may have waited on it since the pump's
    previous read: that stretch is recorded as an output stall (WriteTrouble.stalled, goodput)."""

    def __init__(self, read_fd: int, path: Path, rank: int, console: ConsoleOut, stderr: bool, banner: str) -> None:
        self.read_fd = read_fd
        self.path = path
        self.rank = rank
        self.console = console
        self.stderr = stderr
        self.banner = banner
        self.tail: Deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.done = threading.Event()
        self._progress_at = 0.0
        self._progress_shown: Optional[bytes] = None
        self._held = False  # inside a traceback for the log only (PEER_LOST_BEGIN to PEER_LOST_END)
        self.thread = threading.Thread(target=self._run, name=f"ftrun-log-{rank}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        log = LogFile(self.path, self.console.trouble)
        lines = LineBuffer()
        try:
            log.write(self.banner.encode())
            with os.fdopen(self.read_fd, "rb", buffering=0) as pipe:
                full = int(pipe_capacity(self.read_fd) * BACKLOG)
                read_at = time.time()  # when this pump last took bytes from its pipe
                while True:
                    if pending_bytes(self.read_fd) >= full:
                        self.console.trouble.stalled(read_at, time.time())
                    try:
                        chunk = pipe.read(READ_BYTES)
                    except OSError:
                        chunk = b""
                    if not chunk:
                        break
                    read_at = time.time()
                    self.console.trouble.busy(self, read_at, self.read_fd, full)
                    log.write(chunk)
                    self._show(lines.feed(chunk), lines.progress())
                    self.console.trouble.busy(self, None)
                rest = lines.rest()
                if rest is not None and rest != self._progress_shown:
                    self._show([rest], None)
        finally:
            log.close()
            self.done.set()

    def _show(self, raws: Sequence[bytes], progress: Optional[bytes]) -> None:
        """Complete lines at once; a progress bar's newest state at most every PROGRESS_S."""
        if raws and self._progress_shown is not None and raws[0] == self._progress_shown:
            raws = raws[1:]  # the bar's last state ended its line: shown already
        if raws:
            self._progress_shown = None
        now = time.monotonic()
        if progress is not None and progress != self._progress_shown and now - self._progress_at >= PROGRESS_S:
            raws = list(raws) + [progress]
            self._progress_at, self._progress_shown = now, progress
        if not raws:
            return
        try:
            self._lines(raws)
        except (OSError, ValueError):
            pass  # the console is gone (a closed pipe): the log file still gets every byte

    def _lines(self, raws: Sequence[bytes]) -> None:
        lines = [raw.decode("utf-8", errors="replace").rstrip("\r") for raw in raws]
        held: List[bool] = []  # per line: part of a traceback for the log only
        if self.stderr:
            for line in lines:
                if PEER_LOST_BEGIN.match(line) or PEER_LOST_END.match(line):
                    self._held = bool(PEER_LOST_BEGIN.match(line))
                    held.append(True)
                    continue
                held.append(self._held)
                self.tail.append(line)
                if FRAMEWORK_LINE.match(line):
                    self.console.framework_said = True
        if not self.console.shows(self.rank, self.stderr):
            return
        if self.stderr and not self.console.verbose:
            speaker = self.rank % self.console.nproc == 0
            lines = [line for line, hold in zip(lines, held) if not hold and not chatter(line, speaker)]
        if lines:
            self.console.worker_lines(self.rank, lines, self.stderr)


def drain(pumps: Sequence["Pump"], timeout: float = DRAIN_S) -> None:
    """Wait until every pump has copied what its worker wrote (bounded: a process a worker
    left behind may hold its pipe open), so a final report comes after the workers' lines."""
    deadline = time.monotonic() + timeout
    for p in pumps:
        p.done.wait(max(0.0, deadline - time.monotonic()))


def open_pipes():
    """(read, write) pairs for stdout and stderr of one worker, each with a PIPE_BYTES buffer
    where the system allows it (the default 64 KiB fills within one burst of output)."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    for fd in (out_w, err_w):
        try:
            fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        except (OSError, AttributeError):
            pass  # above /proc/sys/fs/pipe-max-size, or not Linux: the default size
    return (out_r, out_w), (err_r, err_w)


def pipe_capacity(fd: int) -> int:
    try:
        return fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ)
    except (OSError, AttributeError):
        return 1 << 16


def pending_bytes(fd: int) -> int:
    """Bytes waiting in pipe `fd` (FIONREAD); 0 when unknown."""
    buf = bytearray(4)
    try:
        fcntl.ioctl(fd, termios.FIONREAD, buf)
    except OSError:
        return 0
    return int.from_bytes(buf, sys.byteorder)
