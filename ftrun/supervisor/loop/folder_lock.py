"""One live run per checkpoint folder: a lock on DIR/.ftrun.lock that a dead run never keeps.

Node 0's ftrun takes it before any worker starts and holds it until it exits.
Two things make it:
- flock(LOCK_EX) on the file: the kernel releases it when its holder dies,
  however it dies (SIGKILL included); on a shared file system whose locks
  work across machines (NFSv4, Lustre mounted with -o flock, GPFS, CephFS)
  the server does, for a lost machine once that machine's lease runs out.
- the file names the holder (run id, host, pid and the pid's start time)
  and a lease the holder renews every RENEW_S from a thread of its own: on a
  file system whose locks are local to each machine (NFS with local_lock,
  Lustre's localflock), a holder on another host is alive if it renews.
A holder on this host is checked by its pid (and start time, against pid
reuse); one on another host is alive while it renews: a lease that has not
changed for LEASE_S is dead at once, a fresher one is watched for WATCH_S.
The decision (`decide`) is apart from the IO.
Must never import torch, never delete the lock file (one who opened it to
wait would lock a file nobody else sees), and never block the supervisor's loop.
"""

from __future__ import annotations

import enum
import json
import os
import re
import shutil
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

from ftrun.errors import ConfigError

LOCK_FILE = ".ftrun.lock"
RENEW_S = 5.0
LEASE_S = 60.0    # a lease of another host not renewed for this long: its holder is gone
WATCH_S = 12.0    # a fresher one is watched this long for a renewal (more than two)
SIZE = 1024       # the record is written whole, padded, at offset 0: a reader sees the old one or the new one
PARTIAL_DIR = re.compile(r"\.step-(\d+)\.[A-Za-z0-9._-]+\.partial")  # as ftrun.worker.ft.checkpoint.names


class Verdict(enum.Enum):
    TAKE = "take"        # free, or its holder is gone
    REFUSE = "refuse"    # a live run holds it
    WATCH = "watch"      # a holder on another host whose lease is fresh: alive only if it renews


@dataclass(frozen=True)
class LockDecision:
    verdict: Verdict
    why: str = ""


def decide(holder: Optional[Dict[str, Any]], locked: Optional[bool], host: str, now: float,
           alive: Callable[[int, float], bool]) -> LockDecision:
    """What to do about the folder's lock. `locked`: whether flock() was granted (None where
    the file system has no locks); `holder`: the record in the file (None: none or
    unreadable); `alive(pid, start)`: whether that process of this host still runs."""
    if locked is False:
        return LockDecision(Verdict.REFUSE, "its lock is held")
    if not holder or holder.get("released"):
        return LockDecision(Verdict.TAKE)
    if holder.get("host") == host:
        pid, start = holder.get("pid"), holder.get("pid_start")
        if isinstance(pid, int) and isinstance(start, (int, float)) and alive(pid, float(start)):
            return LockDecision(Verdict.REFUSE, "its holder runs")
        return LockDecision(Verdict.TAKE, "its holder is gone")
    renewed = holder.get("renewed_at")
    if isinstance(renewed, (int, float)) and now - renewed > LEASE_S:
        return LockDecision(Verdict.TAKE, f"its lease was last renewed {now - renewed:.0f} s ago")
    return LockDecision(Verdict.WATCH)


def describe(holder: Optional[Dict[str, Any]]) -> str:
    if not holder:
        return "another ftrun run"
    since = holder.get("since")
    when = time.strftime(" since %H:%M:%S", time.localtime(since)) if isinstance(since, (int, float)) else ""
    return f"run {holder.get('run_id', '?')} (pid {holder.get('pid', '?')} on host {holder.get('host', '?')}{when})"


class FolderLock:
    """The lock this run holds, renewed by a thread until `release()`."""

    def __init__(self, path: Path, fd: int, record: Dict[str, Any]) -> None:
        self.path, self.fd, self.record = path, fd, record
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew_loop, name="ftrun-folder-lock", daemon=True)
        self._thread.start()

    def _renew_loop(self) -> None:
        while not self._stop.wait(RENEW_S):
            self.record["renewals"] += 1
            self.record["renewed_at"] = time.time()
            try:
                _write(self.fd, self.record)
            except OSError:  # the folder's file system hiccuped: the next renewal tries again
                pass

    def release(self) -> None:
        """Say the folder is free and drop the lock (the file stays: see the module's doc)."""
        self._stop.set()
        try:
            _write(self.fd, {**self.record, "released": True})
        except OSError:
            pass
        try:
            os.close(self.fd)  # releases the flock
        except OSError:
            pass


def acquire(folder: str, run_id: str, say: Callable[[str], None]) -> FolderLock:
    """Take the folder for this run, or raise ConfigError (one line) naming the live run holding it."""
    import fcntl

    try:  # preflight found it writable; a folder can still refuse (a kernel file system, a change since)
        Path(folder).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--checkpoint-dir {folder} cannot be created ({e.strerror or e}); give a folder you can "
                          f"write", key="checkpoint_dir") from None
    path = Path(folder) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise ConfigError(f"--checkpoint-dir {folder}: cannot open its lock file {path} ({e.strerror}); give a "
                          f"folder you can write", key="checkpoint_dir") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        locked: Optional[bool] = True
    except BlockingIOError:
        locked = False
    except OSError:  # ENOLCK, EOPNOTSUPP: this file system keeps no locks; the lease decides
        locked = None
    host = socket.gethostname()
    holder = _read(fd)
    decision = decide(holder, locked, host, time.time(), _pid_alive)
    if decision.verdict is Verdict.WATCH:
        say(f"--checkpoint-dir {folder} is held by {describe(holder)}, on another host; waiting up to "
            f"{WATCH_S:g} s to see whether it still renews its lease")
        decision = _watch(fd, holder)
    if decision.verdict is Verdict.REFUSE:
        os.close(fd)
        raise ConfigError(f"--checkpoint-dir {folder} is in use by {describe(holder)}: two runs on one folder would "
                          f"overwrite and prune each other's checkpoints; stop that run, or give this one another "
                          f"folder (a run that died never holds it)", key="checkpoint_dir")
    if holder and not holder.get("released") and decision.why:
        say(f"--checkpoint-dir {folder} was held by {describe(holder)}; {decision.why}: taking it over")
    import psutil

    now = time.time()
    record = {"run_id": run_id, "host": host, "pid": os.getpid(), "pid_start": psutil.Process().create_time(),
              "since": now, "renewed_at": now, "renewals": 0}
    try:
        _write(fd, record)
    except OSError as e:  # a full disk: the flock holds on this host; another host cannot tell
        say(f"--checkpoint-dir {folder}: the lock's record could not be written ({e.strerror}); a run on another "
            f"host would not see this one")
    return FolderLock(path, fd, record)


def remove_partials(folder: str) -> Tuple[int, int]:
    """Remove the partial checkpoint folders killed writes left (nobody else writes here while
    this run holds the lock): (how many, bytes)."""
    count = size = 0
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return 0, 0
    for e in entries:
        if PARTIAL_DIR.fullmatch(e.name) and e.is_dir(follow_symlinks=False):
            size += sum(f.stat().st_size for f in Path(e.path).iterdir() if f.is_file())
            shutil.rmtree(e.path, ignore_errors=True)
            count += 1
    return count, size


def _watch(fd: int, holder: Optional[Dict[str, Any]]) -> LockDecision:
    """A holder on another host: alive if its record changes within WATCH_S."""
    deadline = time.monotonic() + WATCH_S
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = _read(fd)
        if now != holder:
            if now and now.get("released"):
                return LockDecision(Verdict.TAKE)
            return LockDecision(Verdict.REFUSE, "it renews")
    return LockDecision(Verdict.TAKE, f"its lease was not renewed within {WATCH_S:g} s")


def _read(fd: int) -> Optional[Dict[str, Any]]:
    try:
        raw = os.pread(fd, SIZE, 0)
    except OSError:
        return None
    try:
        record = json.loads(raw.decode(errors="replace").strip() or "null")
    except ValueError:
        return {"run_id": "?", "host": "?"} if raw.strip() else None  # someone's, unreadable
    return record if isinstance(record, dict) else None


def _write(fd: int, record: Dict[str, Any]) -> None:
    data = json.dumps(record).encode()
    os.pwrite(fd, data.ljust(SIZE, b" ")[:max(SIZE, len(data))], 0)
    os.fsync(fd)


def _pid_alive(pid: int, start: float) -> bool:
    import psutil

    try:
        return abs(psutil.Process(pid).create_time() - start) < 1.0
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False

