"""`python -m ftrun.worker.bootstrap [-m] SCRIPT ARGS...`: run a user's script as a worker.

Reads the environment once (ftrun.worker.settings), installs what ftrun adds to a worker
(progress reports, stack dumps on request, the DDP comm hook, its children's death with it), then
runs the script exactly as `python SCRIPT ARGS` (or `python -m MODULE`) would: same
sys.argv, sys.path[0], __main__ and exit status. A failure is printed as python prints it, but
for a collective that failed because a peer went away (an expected event): its traceback goes
to the rank's log only.
Must never change what the script computes, and never import the supervisor.
"""

from __future__ import annotations

import atexit
import faulthandler
import os
import re
import runpy
import sys
import threading
import time
import traceback
from typing import List, Optional

from ftrun.exits import EXIT_FAILED, EXIT_SIGINT, EXIT_USAGE
from ftrun.prctl import set_parent_death_signal
from ftrun.worker import settings
from ftrun.worker.proc import DUMP_STACKS_SIGNAL, set_title, worker_title


def _prepare_stdio() -> None:
    # Lines reach the supervisor's console as they are written, not at exit.
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(line_buffering=True)
        except (AttributeError, ValueError):
            pass


_stacks = None  # the open file faulthandler writes into: it must stay open as long as the process


def _stacks_file():
    """Where ftrun's request for this worker's stacks (a hang) writes them: the file ftrun named
    (its log folder: a dump is for the log, not the console), else stderr."""
    global _stacks
    path = settings.current().stacks_file
    if path and _stacks is None:
        try:
            _stacks = open(path, "a", buffering=1)
        except OSError:
            _stacks = None
    return _stacks if _stacks is not None else sys.stderr


def _children_die_with_it() -> None:
    """A process this worker forks from its main thread (a DataLoader's workers) gets the
    parent-death signal: it dies with the worker at once, instead of noticing a moment later
    that the worker is gone (a loader worker's resource sharer then printed a traceback of the
    connection its dead parent reset). Only the worker's own children, forked by its main
    thread: the signal follows the thread that forked, and a loader iterated in another thread
    must not lose its workers when that thread ends."""
    me = os.getpid()
    forking = [False]

    def before() -> None:
        forking[0] = os.getpid() == me and threading.current_thread() is threading.main_thread()

    def child() -> None:
        if forking[0]:
            set_parent_death_signal()
            if os.getppid() != me:  # the worker died before the signal was set
                os._exit(EXIT_FAILED)

    os.register_at_fork(before=before, after_in_child=child)


def install() -> None:
    """Everything ftrun adds inside a worker, before the user's code runs."""
    s = settings.current()
    _prepare_stdio()
    _children_die_with_it()
    faulthandler.register(DUMP_STACKS_SIGNAL, file=_stacks_file(), all_threads=True)
    from ftrun.worker import progress

    progress.start_from_env()
    if s.ft and s.replica_size == 1:
        from ftrun.worker.ft.api import world
        from ftrun.worker.frameworks import accelerate, fabric, hf, lightning

        world.install()
        lightning.install()  # FTStrategy for an unmodified Lightning script, as it imports Lightning
        hf.install()  # the Hugging Face Trainer's part, as the script imports transformers
        accelerate.install()  # a line for a plain Accelerator (ftrun.accelerate.Accelerator heals)
        fabric.install()  # a line for a plain Fabric (ftrun.fabric.Fabric heals)
    if s.ft:
        from ftrun.worker.ft.api import data_checks

        data_checks.install()
    # With --ft the hook goes through ftrun.ft's DDP (over the live replicas), not plain DDP.
    if s.hook and not s.ft:
        from ftrun.worker.inject import install_from_env

        install_from_env()


def _user_traceback(exc: BaseException) -> None:
    """Print the traceback as `python script.py` would: without ftrun's frames."""
    tb = exc.__traceback__
    here = os.path.dirname(os.path.abspath(__file__))
    while tb is not None and (tb.tb_frame.f_code.co_filename.startswith(here)
                              or tb.tb_frame.f_code.co_filename.endswith(("runpy.py", "<frozen runpy>"))):
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb)


# The lines around the traceback of a collective that failed because a peer went away (a peer's
# death is expected: ftrun says it in its own words). ftrun.supervisor.workers.logs keeps what is
# between them in the rank's log, off the console.
PEER_LOST_BEGIN = "ftrun: rank {rank}: a peer went away mid-collective ({error}); its traceback follows, for the log"
PEER_LOST_END = "ftrun: rank {rank}: end of the traceback of the collective a peer left"
# What torch's collectives and store say when the process at the other end is gone (gloo's
# transport, the c10d store, NCCL); a timeout is not one of them (a hung peer is not a dead one).
_PEER_GONE = re.compile(r"Connection reset by peer|Connection closed by peer|Broken pipe|Connection refused|"
                        r"failed to recv, got 0 bytes|remote process exited|NCCL communicator was aborted")


def _peer_lost(exc: BaseException) -> bool:
    """Whether the script failed only because a peer process went away: every exception of its
    chain is one of torch's collectives (or its store) failing so. A real error of the script's
    own, even one raised while handling such a failure, is not."""
    dist = sys.modules.get("torch.distributed")
    dist_error = getattr(dist, "DistError", ()) if dist is not None else ()
    seen = 0
    e: Optional[BaseException] = exc
    while e is not None and seen < 16:
        text = str(e)
        if not (isinstance(e, RuntimeError) and (isinstance(e, dist_error) or "gloo/transport/" in text)
                and _PEER_GONE.search(text)):
            return False
        e = e.__cause__ if e.__cause__ is not None else None if e.__suppress_context__ else e.__context__
        seen += 1
    return True


def _failed(exc: BaseException) -> None:
    """The script's failure on stderr as python prints it; the traceback of a collective a peer
    left goes to the rank's log only, between PEER_LOST_BEGIN and PEER_LOST_END."""
    if not _peer_lost(exc):
        _user_traceback(exc)
        return
    rank = settings.current().rank_text
    # The error's first sentence, without the library's source path: "Read error [addr]:port:
    # Connection reset by peer".
    text = re.sub(r"^\[[^\]]*\]\s*", "", str(exc).strip())
    error = (text.splitlines() or [type(exc).__name__])[0].split(". ")[0][:200]
    sys.stderr.write(PEER_LOST_BEGIN.format(rank=rank, error=error) + "\n")
    _user_traceback(exc)
    sys.stderr.write(PEER_LOST_END.format(rank=rank) + "\n")
    sys.stderr.flush()


def _record_error(exc: BaseException) -> None:
    """The failure, structured, in TORCHELASTIC_ERROR_FILE as torch's @record would write it
    (ftrun.wire.WorkerError), for the supervisor to read instead of the traceback's words. A
    file the script's own @record wrote (it re-raises after writing) is left as it is."""
    path = settings.current().error_file
    if not path or os.path.exists(path):
        return
    from ftrun.wire import WorkerError

    tb = exc.__traceback__
    here = os.path.dirname(os.path.abspath(__file__))
    frames = [f for f in traceback.extract_tb(tb) if not f.filename.startswith(here)
              and not f.filename.endswith(("runpy.py", "<frozen runpy>"))]
    where = f'File "{frames[-1].filename}", line {frames[-1].lineno}, in {frames[-1].name}' if frames else ""
    # As the traceback's own exception line: the first unindented line (a SyntaxError's comes
    # after its quoted source).
    lines = [line for part in traceback.format_exception_only(type(exc), exc) for line in part.splitlines()]
    message = next((line.strip() for line in lines if line.strip() and not line[0].isspace()), type(exc).__name__)
    error = WorkerError(message, where, "".join(traceback.format_exception(type(exc), exc, tb)), int(time.time()))
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "w") as f:
            f.write(error.encode())
        os.replace(path + ".tmp", path)
    except OSError:  # a full disk: the supervisor reads the traceback from the log instead
        pass


# The one line an interrupted worker writes instead of a traceback (ftrun.supervisor.workers.logs keeps it
# in the rank's log, off the console: ftrun's own line says that the run was interrupted).
INTERRUPTED_LINE = "ftrun: rank {rank}: stopped by SIGINT (KeyboardInterrupt) in {where}"


def _interrupted(exc: BaseException) -> None:
    """Ctrl-C reaches a worker through ftrun (each runs in a session of its own), at every rank
    at once: one line says where this one was, the innermost frame of the user's own code
    (not the standard library's, an installed package's or ftrun's), instead of a traceback
    per rank."""
    import sysconfig

    ftrun_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    libraries = tuple(p for p in {sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib",
                                                                         "platlib")} if p)
    user = ours = None
    tb = exc.__traceback__
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if not name.startswith(ftrun_dir) and not name.endswith("runpy.py"):
            ours = tb
            if not name.startswith(libraries):
                user = tb
        tb = tb.tb_next
    frame = user or ours
    where = (f"{frame.tb_frame.f_code.co_filename} line {frame.tb_lineno} ({frame.tb_frame.f_code.co_name})"
             if frame is not None else "ftrun's code")
    sys.stderr.write(INTERRUPTED_LINE.format(rank=settings.current().rank_text, where=where) + "\n")


def main(argv: Optional[List[str]] = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    as_module = bool(args) and args[0] == "-m"
    if as_module:
        args = args[1:]
    if not args:
        sys.stderr.write("usage: python -m ftrun.worker.bootstrap [-m] SCRIPT [ARGS...]\n")
        sys.exit(EXIT_USAGE)
    target, script_args = args[0], args[1:]
    # The environment, read once: a zygote's fork gave this process the worker's own by now.
    s = settings.load()
    set_title(worker_title(s.rank_text, (["-m"] if as_module else []) + args))
    install()
    code = 0
    try:
        if as_module:
            sys.argv = [target] + script_args
            # As python -m: the working directory first, so a project's own packages are found.
            sys.path[0:1] = [os.getcwd()]
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [target] + script_args
            sys.path[0:1] = [os.path.dirname(os.path.abspath(target))]
            runpy.run_path(target, run_name="__main__")
    except SystemExit as exc:
        code = _exit_status(exc.code)
    except KeyboardInterrupt:
        _interrupted(sys.exc_info()[1])
        code = EXIT_SIGINT
    except BaseException as exc:  # noqa: BLE001 - the script's own failure, reported as python would
        _failed(exc)
        _record_error(exc)
        code = 1
    fast_exit(code)


def _exit_status(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    sys.stderr.write(f"{code}\n")
    return 1


def fast_exit(code: int) -> None:
    """Exit as Python would (non-daemon threads joined, atexit handlers run, streams
    flushed) but skip tearing down every module: with torch loaded that alone
    takes about half a second per worker, paid on every exit and restart."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # what interpreter exit does first
    except Exception:
        pass
    try:
        atexit._run_exitfuncs()
    except Exception:
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)

if __name__ == "__main__":
    main()
