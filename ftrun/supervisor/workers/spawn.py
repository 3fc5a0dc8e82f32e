"""Starting worker processes and learning, within milliseconds, that one has exited.

Two ways to start a worker, one interface:
- ZygoteSpawner forks workers from a zygote that has imported torch already
  (python scripts and modules): a start or restart costs milliseconds.
- PopenSpawner execs each worker (``--no-python``, or FTRUN_ZYGOTE=0).
Both put every worker in its own session with a parent-death signal and post
``WorkerExited`` events on the supervisor's queue the moment a worker dies (the
zygote reaps on SIGCHLD; Popen children have a waiter thread each) — no
polling. The supervisor (and the zygote) are child subreapers: a process a worker
started and left behind (setsid, SIGTERM ignored) is reparented to them, not to
init, and close() kills it when the run ends. Children ftrun had before it started
anything (bash's `> >(tee log)` forks the tee in the process that then execs ftrun)
are not its to stop. Must never decide policy: it starts, signals and reports, nothing else.
"""

from __future__ import annotations

import json
import os
import queue
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set, Tuple

import psutil

from ftrun.prctl import become_subreaper

PDEATH_SHIM = ("import ctypes, os, sys\n"
               "ctypes.CDLL(None).prctl(1, 9, 0, 0, 0)\n"
               "os.getppid() == int(sys.argv[1]) or os._exit(1)\n"
               "os.execvp(sys.argv[2], sys.argv[2:])\n")


@dataclass(frozen=True)
class WorkerExited:
    """A worker incarnation ended. `tag` is the spawner's handle for it."""

    tag: str
    pid: int
    exit_code: Optional[int]   # None when killed by a signal
    signal: Optional[int]
    seen: float = field(default_factory=time.time, compare=False)  # when the exit was reaped (time to detect)


@dataclass(frozen=True)
class Spawned:
    tag: str
    pid: int


@dataclass(frozen=True)
class SpawnerDied:
    """The spawner can start no more workers; `lost` are the tags of workers that died with it
    (each is also reported as WorkerExited, after this event)."""

    reason: str
    lost: Tuple[str, ...] = ()


@dataclass(frozen=True)
class SpawnerWarning:
    """Something the supervisor should say, that changes nothing (e.g. a malformed message was skipped)."""

    message: str


def _decode_status(status: int):
    if os.WIFSIGNALED(status):
        return None, os.WTERMSIG(status)
    return os.WEXITSTATUS(status), None


class ZygoteSpawner:
    """Forks workers from one pre-warmed zygote process."""

    def __init__(self, events: "queue.Queue", env: Dict[str, str], cwd: str) -> None:
        self.events = events
        note_inherited_children()
        become_subreaper()
        global _waiting
        self.proc: "subprocess.Popen | _Forked"
        if _waiting is not None:  # forked before the supervisor's first thread, torch imported
            pid, self.sock = _waiting
            _waiting = None
            try:
                self.sock.send(json.dumps({"op": "become", "env": dict(env), "cwd": cwd}).encode())
            except OSError:
                pass  # it died already: the reader sees its socket closed and reports it
            self.proc = _Forked(pid)
        else:
            self.sock, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            zenv = dict(env)
            zenv["FTRUN_ZYGOTE_FD"] = str(child.fileno())
            zenv["FTRUN_SUPERVISOR_PID"] = str(os.getpid())
            # No preexec_fn: forking a multi-threaded supervisor through Python code is
            # unsafe; the zygote sets its own parent-death signal first thing.
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ftrun.worker.zygote"], env=zenv, cwd=cwd,
                pass_fds=(child.fileno(),), start_new_session=True,
            )
            child.close()
        self.ready = threading.Event()
        self._lock = threading.Lock()
        self._live: Dict[str, Optional[psutil.Process]] = {}  # tag -> worker, written by the reader only
        self._reader = threading.Thread(target=self._read, name="ftrun-zygote", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        warned = False
        while True:
            try:
                data = self.sock.recv(1 << 16)
            except OSError:
                data = b""
            if not data:
                self._zygote_gone()
                return
            try:
                msg = json.loads(data)
                op = msg.get("op")
                if op == "ready":
                    self.ready.set()
                elif op == "spawned":
                    self._track(msg["tag"], msg["pid"])
                    self.events.put(Spawned(msg["tag"], msg["pid"]))
                elif op == "exit":
                    self._live.pop(msg.get("tag") or "", None)
                    code, sig = _decode_status(msg["status"])
                    self.events.put(WorkerExited(msg.get("tag") or "", msg["pid"], code, sig))
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                # One bad message must not blind the supervisor to every later exit.
                if not warned:
                    warned = True
                    self.events.put(SpawnerWarning(f"ignored a malformed message from the zygote "
                                                   f"({type(e).__name__}: {e}): {data[:120]!r}"))

    def _track(self, tag: str, pid: int) -> None:
        try:
            self._live[tag] = psutil.Process(pid)
        except psutil.Error:
            self._live[tag] = None  # already gone: its exit report follows

    def _zygote_gone(self) -> None:
        """The zygote died: its workers die with it (parent-death signal) and nobody reaps them
        for us, so report each one as lost here, at once, instead of waiting for exits that never come."""
        try:
            status = self.proc.wait(timeout=5)
            how = f"was killed by {signal_name(-status)}" if status < 0 else f"exited with code {status}"
        except subprocess.TimeoutExpired:
            how = "closed its socket"
        lost = dict(self._live)
        self._live.clear()
        self.events.put(SpawnerDied(f"the zygote (pid {self.proc.pid}) {how}", tuple(lost)))
        procs = [p for p in lost.values() if p is not None]
        for p in procs:
            signal_group(p.pid, signal.SIGKILL)  # the parent-death signal did it already; make sure
        psutil.wait_procs(procs, timeout=5)
        for tag, p in lost.items():
            self.events.put(WorkerExited(tag, p.pid if p is not None else 0, None, signal.SIGKILL))

    def spawn(self, tag: str, argv: List[str], env: Dict[str, str], cwd: str, out_fd: int, err_fd: int) -> None:
        msg = json.dumps({"op": "spawn", "tag": tag, "argv": argv, "env": env, "cwd": cwd}).encode()
        with self._lock:
            socket.send_fds(self.sock, [msg], [out_fd, err_fd])

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
        try:
            self.proc.kill()
            self.proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            pass
        kill_orphans()


# The zygote-to-be forked at the supervisor's start (start_zygote_early), taken by the first ZygoteSpawner.
_waiting: Optional[Tuple[int, socket.socket]] = None
# When that start began (the torch import it waits for is part of the run's start-up), taken once.
_early_at: Optional[float] = None


def take_early_start() -> Optional[float]:
    """When start_zygote_early began, once (the first run's accounts date their start from it)."""
    global _early_at
    at, _early_at = _early_at, None
    return at


def start_zygote_early(import_env: Dict[str, str]) -> None:
    """Fork the zygote from this process once torch is imported here, before any thread starts
    (ftrun.worker.zygote.fork_waiting): the supervisor's store and the zygote share one import.
    The processes this one had before are noted first: the zygote is not one of them."""
    global _waiting, _early_at
    from ftrun.worker.zygote import fork_waiting

    _early_at = time.time()
    note_inherited_children()
    _waiting = fork_waiting(import_env)


class _Forked:
    """The zygote forked by this process, with what ZygoteSpawner uses of a Popen."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: Optional[int] = None

    def wait(self, timeout: Optional[float] = None) -> int:
        if self.returncode is not None:
            return self.returncode
        try:
            fd = os.pidfd_open(self.pid)
        except ProcessLookupError:  # reaped elsewhere already
            self.returncode = 0
            return 0
        try:
            if not select.select([fd], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0)
        finally:
            os.close(fd)
        try:
            _, status = os.waitpid(self.pid, 0)
            self.returncode = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        except ChildProcessError:  # reaped elsewhere: as Popen, no status to tell
            self.returncode = 0
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class PopenSpawner:
    """Execs each worker as its own program."""

    def __init__(self, events: "queue.Queue") -> None:
        self.events = events
        note_inherited_children()
        become_subreaper()
        self.ready = threading.Event()
        self.ready.set()

    def spawn(self, tag: str, argv: List[str], env: Dict[str, str], cwd: str, out_fd: int, err_fd: int) -> None:
        # A tiny python shim sets the parent-death signal (kept across exec) and
        # execs the worker: no preexec_fn in a multi-threaded supervisor.
        shim = [sys.executable, "-S", "-c", PDEATH_SHIM, str(os.getpid())] + list(argv)
        proc = subprocess.Popen(shim, env=env, cwd=cwd, stdout=out_fd, stderr=err_fd, start_new_session=True)
        self.events.put(Spawned(tag, proc.pid))
        threading.Thread(target=self._wait, args=(tag, proc), name=f"ftrun-wait-{tag}", daemon=True).start()

    def _wait(self, tag: str, proc: subprocess.Popen) -> None:
        rc = proc.wait()
        code, sig = (rc, None) if rc >= 0 else (None, -rc)
        self.events.put(WorkerExited(tag, proc.pid, code, sig))

    def close(self) -> None:
        kill_orphans()


# (pid, start time) of the processes that were this process's children and descendants before
# it started any: a shell's process substitution (`ftrun ... > >(tee out.txt)`) is one.
_inherited: Optional[Set[Tuple[int, float]]] = None


def _key(p: psutil.Process) -> Tuple[int, float]:
    return p.pid, p.create_time()  # the start time tells a reused pid apart


def note_inherited_children() -> None:
    """Remember the processes already below this one, before it starts any worker (once):
    kill_orphans leaves them alone."""
    global _inherited
    if _inherited is not None:
        return
    _inherited = set()
    try:
        for p in psutil.Process().children(recursive=True):
            try:
                _inherited.add(_key(p))
            except psutil.Error:
                pass
    except psutil.Error:
        pass


def kill_orphans(timeout: float = 5.0) -> List[int]:
    """SIGKILL every process still below the supervisor once its workers are gone: what workers
    left behind was reparented here (subreaper). What was below it before it started anything
    is not its own, and is left to run. Call only when no worker or zygote should live.
    Returns their pids."""
    inherited = _inherited or set()
    left: List[psutil.Process] = []
    try:
        for child in psutil.Process().children():
            try:
                if _key(child) in inherited:
                    continue
                left += [child] + [p for p in child.children(recursive=True) if _key(p) not in inherited]
            except psutil.Error:
                pass
    except psutil.Error:
        return []
    for p in left:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(left, timeout=timeout)  # reaps them: they are our children now
    return [p.pid for p in left]


def signal_group(pid: Optional[int], sig: int) -> bool:
    """Send `sig` to a worker's whole process group (it leads its own session)."""
    if not pid:
        return False
    try:
        os.killpg(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def group_alive(pid: Optional[int]) -> bool:
    if not pid:
        return False
    try:
        os.killpg(pid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"
