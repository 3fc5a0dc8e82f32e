"""Stopping the workers: the loop's stopping state, and how the loop enters and leaves it.

Stopping is a state of the loop, not a wait of its own: the workers are
signalled, the loop goes on taking events (their exits, a second signal that
ends the grace) and enforcing the SIGKILL deadline, and once the last of them
has exited it carries out what the stop was for (end the run, report the
failure, restart the group). A stopping signal with --ft and --checkpoint-dir
first has the replicas save the last committed step (SaveBeforeStop).
Part of the Supervisor (a mixin: the stop reads and writes the loop's own
worker table, quorum and ledger). Must never wait on the queue nor block
(a stop is advanced one turn of the loop at a time), and never be called
from outside the loop's thread.
"""

from __future__ import annotations

import enum
import signal
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

from ftrun.config import RunConfig
from ftrun.protocol import EXIT_FAILED, EXIT_SIGNAL_BASE
from ftrun.supervisor import checkpoints
from ftrun.supervisor.spawn import ZygoteSpawner, signal_group
from ftrun.supervisor.worker import Failure, Worker, WorkerState

# After SIGKILL a process is gone within milliseconds unless the kernel holds it (uninterruptible
# I/O); past this much longer the stop stops waiting for it.
KILL_WAIT_S = 10.0


class AfterStop(enum.Enum):
    """What the loop does once every worker being stopped has exited."""

    EXIT = "end the run"                                 # with Stopping.code
    REPORT = "end the run with the failure report"       # of Stopping.failure
    RESTART_GROUP = "start the next attempt"             # once every node has stopped (attempt_barrier)


@dataclass
class Stopping:
    """The agent's stopping state: the workers signalled and not yet exited, and what comes next.

    Each worker's SIGKILL deadline is its own `kill_at` (the tick enforces it)."""

    pending: Dict[str, Worker]    # spawner tag -> worker whose exit has not been seen
    sig: int                      # the signal they were sent (a late-started one gets it too)
    then: AfterStop
    code: int                     # EXIT: ftrun's exit status; RESTART_GROUP: the failure's, for the barrier
    give_up_at: float             # grace + KILL_WAIT_S: the rest are counted as gone
    failure: Optional[Failure] = None  # REPORT


def forwarded_signals(cfg: RunConfig) -> List[int]:
    """torchrun's --signals-to-handle: the signals that stop the workers (sent on to them)."""
    return [getattr(signal, name) for name in cfg.signals_to_handle]


class StopControl:
    """The stopping part of the Supervisor's loop (ftrun.supervisor.run holds the state)."""

    def _on_stop_signal(self, signum: int) -> None:
        self.stopped_by_signal = signum
        name = signal.Signals(signum).name
        st = self.stopping
        if st is None and self.saving is not None:
            self.console.note(f"received {name} again: stopping without waiting for the checkpoint", style="bold yellow")
            self.saving = None
            self._begin_stop(signum, self.cfg.shutdown_timeout, AfterStop.EXIT, EXIT_SIGNAL_BASE + signum)
            return
        if st is None and self._save_before_stop(signum):
            return
        if st is None:
            self.console.note(f"received {name}: stopping all workers "
                              f"(grace {self.cfg.shutdown_timeout:g} s)", style="bold yellow")
            self._begin_stop(signum, self.cfg.shutdown_timeout, AfterStop.EXIT, EXIT_SIGNAL_BASE + signum)
            return
        # Already stopping: the signal ends the grace, and asks for no new attempt.
        instead = ""
        if st.then is AfterStop.RESTART_GROUP:
            st.then, st.code, instead = AfterStop.EXIT, EXIT_SIGNAL_BASE + signum, "no restart; "
        in_grace = any(w.kill_at for w in st.pending.values())
        if in_grace or instead:
            self.console.note(f"received {name}: {instead}{'no more grace, killing the workers now' if in_grace else ''}"
                              .rstrip("; "), style="bold yellow")
        self._kill_stopping_now()

    def _save_before_stop(self, signum: int) -> bool:
        """--ft with --checkpoint-dir, on the node keeping the quorum: have the replicas stop at one
        round boundary and save the last committed step before they are signalled. False when
        there is nothing to save (no epoch yet, nobody holds the trained state, the loop ended)."""
        q = self.quorum
        if not (self.cfg.checkpoint_dir and q is not None and q.leader) or \
                any(w.state == WorkerState.DONE for w in self.workers):
            return False
        try:
            writer = q.stop()
        except Exception:  # noqa: BLE001 - the store is gone: nothing can coordinate a save
            return False
        if writer is None:
            return False
        now = time.time()
        grace = self.cfg.shutdown_timeout
        self.saving = checkpoints.SaveBeforeStop(signum, now, now + grace)
        self.console.note(f"received {signal.Signals(signum).name}: saving a checkpoint of the last committed step "
                          f"(replica {writer}), then stopping all workers (at most {grace:g} s in all: "
                          f"--shutdown-timeout)", style="bold yellow")
        self._dirty = True
        return True

    def _check_saving(self) -> None:
        """While the replicas save before stopping: signal the workers once that is over."""
        sv = self.saving
        now = time.time()
        try:
            said = sv.outcome(self.store, now, any(w.alive for w in self.workers))
        except Exception:  # noqa: BLE001 - the store went away: nothing is coming
            said = ("the run's store went away before the checkpoint was written; stopping all workers", "bold red")
        if said is None:
            return
        self.saving = None
        self.console.note(said[0], style=said[1])
        self._begin_stop(sv.sig, max(min(1.0, self.cfg.shutdown_timeout), sv.deadline - now), AfterStop.EXIT,
                         EXIT_SIGNAL_BASE + sv.sig)

    def _begin_stop(self, sig: int, grace: float, then: AfterStop, code: int,
                    failure: Optional[Failure] = None) -> None:
        """Enter the stopping state: `sig` to every worker that still has a process (a stop is
        always the whole node's), SIGKILL after `grace`; the loop does `then` once all have exited."""
        now = time.time()
        pending = {w.tag: w for w in self.workers if self.by_tag.get(w.tag) is w}
        for w in pending.values():
            w.stop_requested = True
            signal_group(w.pid, sig)
            if sig != signal.SIGKILL:
                w.kill_at = now + grace if w.kill_at is None else min(w.kill_at, now + grace)
        self.stopping = Stopping(pending, sig, then, code, now + grace + KILL_WAIT_S, failure)
        self._dirty = True

    def _kill_stopping_now(self) -> None:
        """End the grace: SIGKILL every worker being stopped (one not started yet gets it once it is)."""
        for w in self.stopping.pending.values():
            signal_group(w.pid, signal.SIGKILL)
            w.kill_at = None

    def _stopped(self, w: Worker) -> None:
        """A worker being stopped is gone (its exit seen, or counted as gone)."""
        self.by_tag.pop(w.tag, None)
        if self.stopping is not None:
            self.stopping.pending.pop(w.tag, None)
        w.kill_at = None
        self.ledger.stopped(w, time.time())
        if w.state not in (WorkerState.RESTARTING, WorkerState.FAILED):
            w.state = WorkerState.STOPPED
        if self.quorum is not None:
            self.quorum.on_exit(w.rank, w.incarnation)
        for p in w.pumps:
            p.done.wait(0.5)
        self._dirty = True
        if self.respawning:
            self._respawn_replicas()

    def _advance_stop(self) -> Optional[int]:
        """After each turn while stopping: once the last worker is gone, do what the stop was
        for; ftrun's exit status when that ends the run."""
        st = self.stopping
        if st.pending and time.time() >= st.give_up_at:
            ranks = ", ".join(str(w.rank) for w in st.pending.values())
            self.console.note(f"rank {ranks} still running {KILL_WAIT_S:g} s past the grace, SIGKILL notwithstanding; "
                              f"no longer waiting", style="bold red")
            if isinstance(self.spawner, ZygoteSpawner):
                self.spawner.close()  # workers die with their zygote (parent-death signal)
                if st.then is AfterStop.RESTART_GROUP:
                    st.then, st.code = AfterStop.EXIT, EXIT_FAILED  # no zygote, no new attempt
            for w in list(st.pending.values()):
                self._stopped(w)
        if st.pending:
            return None
        self.stopping = None
        if st.then is AfterStop.RESTART_GROUP:
            return self._restart_group(st.code)
        if st.then is AfterStop.REPORT:
            return self._give_up(st.failure)
        return st.code
