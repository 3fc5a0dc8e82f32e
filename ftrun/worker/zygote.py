"""The zygote: one process that imports torch once and forks every worker from it.

Importing torch costs about a second of CPU per process; forking a process that
has already imported it costs milliseconds. So there is one zygote per node: the
supervisor, which needs torch for its store anyway, imports it before it starts
any thread and forks the zygote from itself (fork_waiting; started as a program
of its own where that cannot be done). It forks a worker for each spawn request
and reports every child's exit status.
A restarted worker therefore starts training at once instead of importing
torch again while its peers are busy.

Rules that keep fork safe: the zygote never runs a torch op (no thread pools,
no CUDA), never opens a process group, and starts no thread. The one pool it
holds is numpy's OpenBLAS, started when torch imports numpy (one thread per
core unless OMP_NUM_THREADS says otherwise, as it does for --nproc > 1);
OpenBLAS stops it around a fork with its own fork handlers. Python 3.12 warns
at every fork of a process with threads: that warning is silenced for the
fork itself, not for the worker's own forks (DataLoader's). It never
imports the supervisor. If the supervisor goes away it kills its children and
exits (and the kernel kills it first with the parent-death signal anyway).
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys
import warnings
from typing import Dict, List, Optional, Tuple

from ftrun.exits import EXIT_FAILED, EXIT_OK
from ftrun.worker.proc import become_subreaper, set_parent_death_signal, set_title

MAX_MSG = 1 << 20
# Fault injection for tests: send one malformed message before the first exit report.
INJECT_GARBAGE_ENV = "FTRUN_INJECT_ZYGOTE_GARBAGE"


def _send(sock: socket.socket, msg: Dict) -> None:
    sock.send(json.dumps(msg).encode())


def _preimport() -> None:
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
    import torch.distributed.algorithms.ddp_comm_hooks  # noqa: F401
    import torch.nn.parallel  # noqa: F401
    import torch.optim  # noqa: F401

    import ftrun.worker.bootstrap  # noqa: F401

    try:
        import setproctitle  # noqa: F401  (each worker sets its title right after the fork)
    except ImportError:
        pass

    if os.environ.get("FTRUN_FT") == "1":
        _preimport_ddp()


def _preimport_ddp() -> None:
    """What DDP's constructor imports on first use (torch._dynamo: seconds of CPU).

    With --ft it is imported before the first fork, since every replica builds
    DDP and restarts must be fast. Otherwise only with FTRUN_ZYGOTE_WARM=1, while
    the zygote is idle (see serve())."""
    import importlib

    import torch._dynamo  # noqa: F401

    import ftrun.worker.ft.manager  # noqa: F401
    import ftrun.worker.hooks  # noqa: F401

    # The training frameworks the script imports (the supervisor read its file): a restarted
    # replica is back without importing one again. Its hooks into ftrun run at the worker's
    # start instead (ftrun.worker.frameworks.imports.after_import, for a module imported already).
    for name in filter(None, os.environ.get("FTRUN_ZYGOTE_PREIMPORT", "").split(",")):
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - not installed, or broken: the worker's own import says so
            pass


class _Child:
    """What a forked child must run, returned up to the top level."""

    def __init__(self, argv: List[str]) -> None:
        self.argv = argv


def serve(sock: socket.socket, supervisor_pid: int) -> Optional[_Child]:
    """The zygote loop. Returns only in a forked child, with what it must run."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    # The supervisor forwards signals to workers itself; Ctrl-C in the terminal
    # must not kill the zygote before the workers are shut down gracefully.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    children: Dict[int, str] = {}
    _send(sock, {"op": "ready"})
    # Without --ft the idle pre-import is off unless asked for (FTRUN_ZYGOTE_WARM=1): with it,
    # about one multi-node run in six left a worker hung in teardown at exit (not understood yet).
    warm = os.environ.get("FTRUN_FT") == "1" or os.environ.get("FTRUN_ZYGOTE_WARM", "0") != "1"
    while True:
        try:
            readable, _, _ = select.select([sock, wake_r], [], [], None if warm else 0.5)
        except InterruptedError:
            continue
        if not readable and not warm:
            warm = True
            _preimport_ddp()
            continue
        if wake_r in readable:
            try:
                while os.read(wake_r, 512):
                    pass
            except BlockingIOError:
                pass
            _reap(sock, children)
        if sock in readable:
            try:
                data, fds, _, _ = socket.recv_fds(sock, MAX_MSG, 4)
            except OSError:
                data, fds = b"", []
            if not data:
                for pid in list(children):
                    try:
                        os.killpg(pid, signal.SIGKILL)
                    except OSError:
                        pass
                os._exit(EXIT_OK)
            msg = json.loads(data)
            if msg.get("op") != "spawn":
                continue
            pid = _fork()
            if pid == 0:
                return _become_worker(msg, fds, sock, (wake_r, wake_w))
            children[pid] = msg["tag"]
            for fd in fds:
                os.close(fd)
            _send(sock, {"op": "spawned", "tag": msg["tag"], "pid": pid})


def _fork() -> int:
    """os.fork(), without Python 3.12's warning about the BLAS pool's threads (module docstring);
    the warning filters are back as they were in the parent and in the child."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*use of fork\(\) may lead to deadlocks",
                                category=DeprecationWarning)
        return os.fork()


def _reap(sock: socket.socket, children: Dict[int, str]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        tag = children.pop(pid, None)
        if tag is None:
            continue  # an orphan this subreaper adopted: not a worker, nobody to tell
        if os.environ.pop(INJECT_GARBAGE_ENV, "") == "1":
            sock.send(b"{not json")  # fault injection for tests: the supervisor must skip it and go on
        _send(sock, {"op": "exit", "pid": pid, "tag": tag, "status": status})


def _become_worker(msg: Dict, fds: List[int], sock: socket.socket, wake: tuple) -> _Child:
    zygote_pid = os.getppid()
    os.setsid()
    set_parent_death_signal()
    if os.getppid() != zygote_pid:
        os._exit(EXIT_FAILED)
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sock.close()
    for fd in wake:
        os.close(fd)
    out_fd, err_fd = fds[0], fds[1]
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    for fd in fds:
        os.close(fd)
    os.environ.clear()
    os.environ.update(msg["env"])
    os.chdir(msg["cwd"])
    _fresh_random_state()
    return _Child(msg["argv"])


def _fresh_random_state() -> None:
    """Give the worker the random state a fresh interpreter would have, as under torchrun:
    every fork inherits the zygote's, so every rank (and every restart of a rank) would draw
    the same dropout masks, augmentations and 'random per rank' data. torch's default
    generators (CPU, and CUDA lazily), Python's `random` and numpy's global state are seeded
    from the OS's entropy, as each is at an interpreter's start. A script's own manual_seed
    comes later and wins, as it does under torchrun."""
    import random

    random.seed()
    np_random = sys.modules.get("numpy.random")
    if np_random is not None:
        np_random.seed()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.seed()


def main() -> None:
    fd = int(os.environ.pop("FTRUN_ZYGOTE_FD"))
    supervisor_pid = int(os.environ.pop("FTRUN_SUPERVISOR_PID"))
    set_parent_death_signal()
    if os.getppid() != supervisor_pid:
        os._exit(EXIT_FAILED)
    _run(socket.socket(fileno=fd), supervisor_pid)


def _run(sock: socket.socket, supervisor_pid: int) -> None:
    # What a worker leaves behind comes to the zygote, which reaps it when it ends; at the
    # zygote's own end it goes on to the supervisor (a subreaper too), which kills it.
    become_subreaper()
    set_title(f"ftrun zygote {os.environ.get('FTRUN_RUN_ID', '')}".rstrip())
    _preimport()
    child = serve(sock, supervisor_pid)
    if child is None:
        return
    from ftrun.worker.bootstrap import main as bootstrap_main

    bootstrap_main(child.argv)


def fork_waiting(import_env: Dict[str, str]) -> Optional[Tuple[int, socket.socket]]:
    """Import torch here, in the supervisor, under the workers' environment, then fork the
    zygote-to-be from this process: the supervisor's store needs torch too, and one import
    serves both (about a second of CPU less per node start). Call it before this process
    starts any thread. The child waits for one message {"op": "become", "env", "cwd"} on the
    returned socket (ZygoteSpawner sends it), then runs as `python -m ftrun.worker.zygote`
    would; it never returns into the caller's frames, and exits when the socket closes first.
    Returns (the child's pid, the supervisor's end of the socket), or None in a process that
    runs threads already (a fork would copy their locks, not them): the zygote is then started
    as a program of its own."""
    import threading

    if threading.active_count() > 1:
        return None
    try:  # its set-up takes over the memory of argv and environ, which must still be the originals
        import setproctitle

        setproctitle.getproctitle()
    except ImportError:
        pass
    saved = dict(os.environ)
    os.environ.clear()  # what torch, OpenMP and OpenBLAS read as they load is the workers' setting
    os.environ.update(import_env)
    try:
        _preimport()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    supervisor_pid = os.getpid()
    pid = _fork()
    if pid != 0:
        theirs.close()
        return pid, ours
    code = EXIT_FAILED
    try:
        ours.close()
        os.setsid()
        set_parent_death_signal()
        if os.getppid() != supervisor_pid:
            os._exit(EXIT_FAILED)
        keep = theirs.fileno()  # as Popen's close_fds: nothing of the supervisor's but stdio
        os.closerange(3, keep)
        os.closerange(keep + 1, os.sysconf("SC_OPEN_MAX"))
        set_title(f"ftrun zygote {import_env.get('FTRUN_RUN_ID', '')}".rstrip())
        data = theirs.recv(MAX_MSG)
        if not data:  # the supervisor never needed a zygote
            os._exit(EXIT_OK)
        msg = json.loads(data)
        os.environ.clear()
        os.environ.update(msg["env"])
        os.chdir(msg["cwd"])
        _run(theirs, supervisor_pid)
        code = EXIT_OK
    except BaseException:  # noqa: BLE001 - said, then the exit status tells the supervisor
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


if __name__ == "__main__":
    main()
