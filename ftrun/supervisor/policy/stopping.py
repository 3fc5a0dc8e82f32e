"""Stopping the workers: the stopping component of the supervisor's loop.

Stopping is a state of the loop, not a wait of its own: the workers are
signalled, the loop goes on taking events (their exits, a second signal that
ends the grace) and enforcing the SIGKILL deadline, and once the last of them
has exited it carries out what the stop was for (end the run, report the
failure, restart the group). A stopping signal with --ft and --checkpoint-dir
first has the replicas save the last committed step (SaveBeforeStop).
The Stopper owns the stop under way (a WorkerStop), the save before it, and the
signal that asked for it, and says what the loop does next (StopRun, EndGrace,
AskSave); the loop (ftrun.supervisor.loop.run) carries it out: its worker table
signals the workers, and it asks the quorum keeper for the save. Must never
signal a worker, never call the keeper, never wait on the queue nor block (a
stop is advanced one turn of the loop at a time), and never be called from
outside the loop's thread but for on_signal (a signal handler).
"""

from __future__ import annotations

import enum
import queue
import signal
import time
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

from ftrun.config import RunConfig
from ftrun.exits import EXIT_FAILED, EXIT_SIGNAL_BASE
from ftrun.supervisor.accounting import checkpoints
from ftrun.supervisor.workers.spawn import SpawnerDied
from ftrun.supervisor.workers.logs import ConsoleOut
from ftrun.supervisor.workers.worker import Failure, Worker

# After SIGKILL a process is gone within milliseconds unless the kernel holds it (uninterruptible
# I/O); past this much longer the stop stops waiting for it.
KILL_WAIT_S = 10.0


class AfterStop(enum.Enum):
    """What the loop does once every worker being stopped has exited."""

    EXIT = "end the run"                                 # with WorkerStop.code
    REPORT = "end the run with the failure report"       # of WorkerStop.failure
    RESTART_GROUP = "start the next attempt"             # once every node has stopped (attempt_barrier)


@dataclass
class WorkerStop:
    """A stop under way: the workers signalled and not yet exited, and what comes next.

    Each worker's SIGKILL deadline is its own `kill_at` (the tick enforces it)."""

    pending: Dict[str, Worker]    # spawner tag -> worker whose exit has not been seen
    sig: int                      # the signal they were sent (a late-started one gets it too)
    then: AfterStop
    code: int                     # EXIT: ftrun's exit status; RESTART_GROUP: the failure's, for the barrier
    give_up_at: float             # grace + KILL_WAIT_S: the rest are counted as gone
    failure: Optional[Failure] = None  # REPORT


@dataclass(frozen=True)
class StopRun:
    """An action for the loop: stop every worker of this node with `sig`, SIGKILL after `grace`, then
    `then` (`code`: ftrun's exit status, or the failure's for a group restart). `summary`: the run's
    one line for `ftrun status`, when it changes; `reform`/`store_lost`: c10d, the round ends so that
    the nodes re-form the run (its store moves first)."""

    sig: int
    grace: float
    then: AfterStop
    code: int
    failure: Optional[Failure] = None
    summary: Optional[str] = None
    reform: bool = False
    store_lost: bool = False


@dataclass(frozen=True)
class EndGrace:
    """An action for the loop: the grace of the stop under way ends; SIGKILL every worker it waits for."""


@dataclass(frozen=True)
class AskSave:
    """An action for the loop: a stopping signal (`signum`) with --ft and --checkpoint-dir; ask the
    quorum keeper to have the replicas save the last committed step, and tell the Stopper who writes
    it (Stopper.save_or_stop)."""

    signum: int


def forwarded_signals(cfg: RunConfig) -> List[int]:
    """torchrun's --signals-to-handle: the signals that stop the workers (sent on to them)."""
    return [getattr(signal, name) for name in cfg.signals_to_handle]


class Stopper:
    """The stop under way, the save before it, and the stopping signal."""

    def __init__(self, cfg: RunConfig, console: ConsoleOut, events: "queue.SimpleQueue") -> None:
        self.cfg = cfg
        self.console = console
        self._events = events
        self.signalled: Optional[int] = None     # the last stopping signal received
        self.current: Optional[WorkerStop] = None
        self.saving: Optional[checkpoints.SaveBeforeStop] = None

    def on_signal(self, signum, _frame) -> None:
        # A handler runs between any two bytecodes of the main thread, which may hold a lock
        # at that moment: only an attribute write and SimpleQueue.put (documented reentrant)
        # are safe here. threading.Event.set() deadlocked when the signal came inside Event.wait.
        self.signalled = signum
        self._events.put(("signal", signum))

    def wait_signal(self, timeout: float) -> Optional[int]:
        """For waits outside the loop (nodes joining, restart barriers): wait up to `timeout`
        (a poll interval); the stopping signal if one came. The loop's own queue is left alone."""
        if self.signalled is None:
            time.sleep(timeout)
        return self.signalled

    # ------------------------------------------------------------ signals
    def on_stop_signal(self, signum: int, can_save: bool) -> Union[StopRun, EndGrace, AskSave, None]:
        """A stopping signal, taken from the loop's queue: the stop it asks for, the end of the grace
        of the stop under way, or a save first (`can_save`: --ft with --checkpoint-dir on the node
        keeping the quorum, and no replica has ended its loop)."""
        self.signalled = signum
        name = signal.Signals(signum).name
        st = self.current
        if st is None and self.saving is not None:
            self.console.note(f"received {name} again: stopping without waiting for the checkpoint", style="bold yellow")
            self.saving = None
            return StopRun(signum, self.cfg.shutdown_timeout, AfterStop.EXIT, EXIT_SIGNAL_BASE + signum)
        if st is None and can_save and self.cfg.checkpoint_dir:
            return AskSave(signum)
        if st is None:
            return self._stop_all(signum)
        # Already stopping: the signal ends the grace, and asks for no new attempt.
        instead = ""
        if st.then is AfterStop.RESTART_GROUP:
            st.then, st.code, instead = AfterStop.EXIT, EXIT_SIGNAL_BASE + signum, "no restart; "
        in_grace = any(w.kill_at for w in st.pending.values())
        if in_grace or instead:
            self.console.note(f"received {name}: {instead}{'no more grace, killing the workers now' if in_grace else ''}"
                              .rstrip("; "), style="bold yellow")
        return EndGrace()

    def _stop_all(self, signum: int) -> StopRun:
        self.console.note(f"received {signal.Signals(signum).name}: stopping all workers "
                          f"(grace {self.cfg.shutdown_timeout:g} s)", style="bold yellow")
        return StopRun(signum, self.cfg.shutdown_timeout, AfterStop.EXIT, EXIT_SIGNAL_BASE + signum)

    def save_or_stop(self, signum: int, writer: Optional[int]) -> Optional[StopRun]:
        """After AskSave, the keeper's answer: the replica that writes the last committed step (the
        replicas save, then stop), or None when there is nothing to save (no quorum yet, nobody
        holds the trained state, the store is gone): the stop at once."""
        if writer is None:
            return self._stop_all(signum)
        now = time.time()
        grace = self.cfg.shutdown_timeout
        self.saving = checkpoints.SaveBeforeStop(signum, now, now + grace)
        self.console.note(f"received {signal.Signals(signum).name}: saving a checkpoint of the last committed step "
                          f"(replica {writer}), then stopping all workers (at most {grace:g} s in all: "
                          f"--shutdown-timeout)", style="bold yellow")
        return None

    def check_saving(self, store, any_alive: bool) -> Optional[StopRun]:
        """While the replicas save before stopping: the stop, once that is over."""
        sv = self.saving
        now = time.time()
        try:
            said = sv.outcome(store, now, any_alive)
        except Exception:  # noqa: BLE001 - the store went away: nothing is coming
            said = ("the run's store went away before the checkpoint was written; stopping all workers", "bold red")
        if said is None:
            return None
        self.saving = None
        self.console.note(said[0], style=said[1])
        return StopRun(sv.sig, max(min(1.0, self.cfg.shutdown_timeout), sv.deadline - now), AfterStop.EXIT,
                       EXIT_SIGNAL_BASE + sv.sig)

    def spawner_died(self, ev: SpawnerDied, workers: Sequence[Worker]) -> Tuple[Optional[StopRun], List[Worker]]:
        """The spawner died: the stop that follows, and the workers being stopped that are gone with it."""
        st = self.current
        if st is None and not any(w.alive for w in workers):
            return None, []
        if st is None:
            lost = ", ".join(str(w.rank) for w in workers if w.tag in ev.lost) or "none"
            self.console.note(f"internal error: {ev.reason}; workers lost with it: rank {lost}; stopping",
                              style="bold red")
            return StopRun(signal.SIGTERM, self.cfg.shutdown_timeout, AfterStop.EXIT, EXIT_FAILED), []
        # Mid-stop: the workers being stopped died with it (parent-death signal; the spawner
        # SIGKILLs what is left), and one whose start was still in flight will never report.
        if st.then is AfterStop.RESTART_GROUP:
            self.console.note(f"internal error: {ev.reason}; no worker can be started: stopping", style="bold red")
            self.exit_instead(EXIT_FAILED)
        return None, list(st.pending.values())

    # ------------------------------------------------------------ the stop
    def begin(self, running: Iterable[Worker], how: StopRun) -> List[Worker]:
        """Enter the stopping state for every worker of `running` (those with a process: a stop is
        always the whole node's): the workers the loop's table signals (`how.sig`, SIGKILL after the grace)."""
        now = time.time()
        pending = {w.tag: w for w in running}
        self.current = WorkerStop(pending, how.sig, how.then, how.code, now + how.grace + KILL_WAIT_S, how.failure)
        return list(pending.values())

    def exit_instead(self, code: int) -> None:
        """The stop under way ends the run with `code`, whatever it was for."""
        self.current.then, self.current.code = AfterStop.EXIT, code

    def waiting_for(self) -> List[Worker]:
        """The workers the stop under way waits for (none when no stop is under way)."""
        return list(self.current.pending.values()) if self.current is not None else []

    def gone(self, w: Worker) -> None:
        """A worker being stopped is gone (its exit seen, or counted as gone)."""
        if self.current is not None:
            self.current.pending.pop(w.tag, None)

    def overdue(self, now: float) -> List[Worker]:
        """The workers still running past the stop's last deadline, SIGKILL notwithstanding."""
        st = self.current
        if not st.pending or now < st.give_up_at:
            return []
        ranks = ", ".join(str(w.rank) for w in st.pending.values())
        self.console.note(f"rank {ranks} still running {KILL_WAIT_S:g} s past the grace, SIGKILL notwithstanding; "
                          f"no longer waiting", style="bold red")
        return list(st.pending.values())

    def finished(self) -> Optional[WorkerStop]:
        """The stop, once its last worker is gone (the stopping state is then left); else None."""
        st = self.current
        if st.pending:
            return None
        self.current = None
        return st
