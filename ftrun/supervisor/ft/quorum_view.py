"""--ft: what the loop takes from the quorum keeper each tick: the keeper's own polls (and the node
relay's), the step each replica committed, which restarted replicas are training again.

The keeper (ftrun.supervisor.ft.quorum) decides the quorum; QuorumView turns its view into the worker
records' states and the console's lines, and returns what the loop does about it (QuorumNews).
It owns only what it said once (a failing poll, a script without ftrun.ft). A script that never
joins a quorum is found here (plain_script); the loop turns the run to group restarts.
Must never start, stop or signal a worker, and never be called from outside the loop's thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, List, Optional, Sequence, Tuple

from ftrun.supervisor.accounting.progress_reader import ProgressReader, note_steps
from ftrun.supervisor.workers.logs import ConsoleOut
from ftrun.supervisor.workers.worker import Worker, WorkerState
from ftrun.wire import one_line

if TYPE_CHECKING:  # the loop's keeper; imported for the annotation only
    from ftrun.supervisor.ft.quorum import QuorumKeeper


@dataclass(frozen=True)
class QuorumNews:
    """What a poll of the quorum asks of the loop: the state file is out of date (`changed`), the run
    goes on with group restarts (`to_group`: its script never joins a quorum), the workers now
    training in a quorum (`training`: their state becomes running)."""

    changed: bool = False
    to_group: bool = False
    training: Tuple[int, ...] = ()


class QuorumView:
    """The --ft part of the supervisor's tick."""

    def __init__(self, console: ConsoleOut, k: int) -> None:
        self.console = console
        self.k = k
        self._failing = False      # a failed poll, said once until a poll works again
        self._told_plain = False   # a script without ftrun.ft, said once
        # rank -> the newest quorum when its restarted replica was first seen away: a fresh quorum
        # published since means it came back from a checkpoint (or from nothing), not from a peer,
        # even when a re-paced quorum of the same members followed before it was seen training.
        self._away_from: dict[int, int] = {}

    def poll(self, q: QuorumKeeper, relay: Any, workers: Sequence[Worker], progress: ProgressReader, now: float,
             several_nodes: bool, quorum_id: Optional[int]) -> QuorumNews:
        try:
            if relay is not None:
                relay.poll(now)
            q.poll(now)
        except Exception as e:  # the store went away: the loop's other checks will say so
            if not self._failing:
                self._failing = True
                self.console.note(f"quorum poll failed: {one_line(e)}", style="yellow")
            return QuorumNews()
        self._failing = False
        changed = False
        training: List[int] = []
        for rank, inc in q.take_rejoined():  # a worker became its next incarnation in place: its process lives on
            for w in workers:
                if w.rank == rank and w.alive:
                    w.incarnation = inc
                    progress.forget(rank)
        for line in q.take_history():
            self.console.note(line, style="cyan")
        for w in workers:
            info = q.info.get(w.rank)
            if w.alive and info is not None and info.of(w.incarnation) and w.first_step_seen:
                # Fresher than the progress key (read a few times a second): the step now.
                if note_steps(w, info.step, now):
                    changed = True
        for w in workers:
            if w.state in (WorkerState.RECOVERING, WorkerState.STARTING, WorkerState.RUNNING) and w.alive:
                in_quorum = q.in_quorum(w.rank)
                if w.state == WorkerState.RECOVERING and not in_quorum:
                    self._away_from.setdefault(w.rank, q.quorum_id)
                if in_quorum and w.state != WorkerState.RUNNING:
                    if w.state == WorkerState.RECOVERING and w.last_failure is not None:
                        took = now - w.last_failure.when
                        w.rejoin_s = took
                        who = (f"rank {w.rank}" if self.k == 1 else
                               f"replica {w.rank // self.k} (rank {w.rank} failed)")
                        away_from = self._away_from.pop(w.rank, q.quorum_id - 1)
                        if any(f > away_from for f in q.fresh_quorums):
                            self.console.note(f"{who} is training again {took:.2f} s after it failed; no replica "
                                              f"held the trained state: {q.fresh_start}", style="green")
                        else:
                            self.console.note(f"{who} is training again, healed from a peer "
                                              f"{took:.2f} s after it failed", style="green")
                    training.append(w.rank)
                    changed = True
        if self.plain_script(q, workers, several_nodes):
            return QuorumNews(True, to_group=True, training=tuple(training))
        return QuorumNews(changed or quorum_id != q.quorum_id, training=tuple(training))  # the run's figures are taken at every write

    def plain_script(self, q: Any, workers: Sequence[Worker], several_nodes: bool) -> bool:
        """A worker that steps without ever asking to join a quorum runs a script without ftrun.ft:
        none of its replicas can heal from a peer, and one restarted alone could not join the
        script's own process group. Such a run gets what it gets without --ft, group restarts
        (every worker with its own default group again), said once. Several nodes keep replica
        restarts (their group restarts are agreed at the start), with the line. A script whose
        framework (a Trainer, a Lightning strategy) already said why it cannot heal gets no line
        of ftrun.ft's advice. True when the quorum is to be given up."""
        if self._told_plain or q is None:
            return False
        plain = [w.rank for w in workers if w.first_step_seen and not q.info.get(w.rank)]
        if not plain:
            return False
        self._told_plain = True
        if self.console.framework_said:
            # Its framework's line said why, with the advice that fits a Trainer or a Lightning
            # script (ftrun.ft's does not); several nodes keep replica restarts, which it cannot use.
            if several_nodes:
                self.console.note(f"--ft: rank {plain[0]} trains in its framework's own group (said above), which a "
                                  f"replica restarted alone cannot join: drop --ft for group restarts",
                                  style="bold yellow")
            return not several_nodes
        how = ("a failure restarts all workers, as without --ft" if not several_nodes else
               "drop --ft for group restarts")
        self.console.note(f"--ft: rank {plain[0]} trains without ftrun.ft (it never asked to join a quorum), so a "
                          f"failed replica cannot heal from a peer: {how} (wrap the model, optimizer and loop with "
                          f"ftrun.ft for replica restarts; see scripts/train_ft.py)", style="bold yellow")
        return not several_nodes
