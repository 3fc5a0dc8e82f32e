"""The worker table of a node's supervisor: every worker's record, which process each one has now
(by spawner tag), and the replicas whose restart waits for their last old process.

The loop (ftrun.supervisor.loop.run) owns the table and is its only user. The table is the one
place that sets a worker's state (mark) and the one that signals workers (a stop and its grace, a
replica's kill, a hung worker's stacks and SIGKILL): the components decide, the loop tells the
table. Must never decide a restart or a stop, and never start a process (the loop spawns what
respawns() hands back).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Dict, Iterable, List, Optional

from ftrun.exits import DUMP_STACKS_SIGNAL
from ftrun.supervisor.policy.hangs import HANG_DUMP_GRACE_S
from ftrun.supervisor.workers import replica as replica_rules
from ftrun.supervisor.workers.logs import ConsoleOut, RankLog
from ftrun.supervisor.workers.spawn import WorkerExited, Spawned, signal_group
from ftrun.supervisor.workers.worker import Worker, WorkerSpec, WorkerState


class WorkerTable:
    def __init__(self, node_rank: int, nproc: int, log_dir: Path) -> None:
        self.workers = [Worker(WorkerSpec(lr, node_rank * nproc + lr)) for lr in range(nproc)]
        self.logs = {w.rank: RankLog(log_dir, w.rank) for w in self.workers}
        self._by_tag: Dict[str, Worker] = {}
        self._respawning: Dict[int, bool] = {}  # replica -> restart pending until its last worker is gone

    def mark(self, w: Worker, state: WorkerState) -> None:
        """The one write of a worker's state."""
        w.state = state

    def mark_ranks(self, ranks: Iterable[int], state: WorkerState) -> None:
        wanted = set(ranks)
        for w in self.workers:
            if w.rank in wanted:
                w.state = state

    def stop(self, workers: Iterable[Worker], sig: int, grace: float, now: float) -> None:
        """A stop: `sig` to each of `workers` (one not started yet gets it once it is), SIGKILL
        after `grace` (the tick enforces each worker's deadline: kill_overdue)."""
        for w in workers:
            w.stop_requested = True
            signal_group(w.pid, sig)
            if sig != signal.SIGKILL:
                w.kill_at = now + grace if w.kill_at is None else min(w.kill_at, now + grace)

    def kill(self, workers: Iterable[Worker]) -> None:
        """SIGKILL now (a stop's grace cut short)."""
        for w in workers:
            signal_group(w.pid, signal.SIGKILL)
            w.kill_at = None

    def running(self) -> List[Worker]:
        """The workers whose current process has not been seen to exit."""
        return [w for w in self.workers if self._by_tag.get(w.tag) is w]

    def runs(self, w: Worker) -> bool:
        return self._by_tag.get(w.tag) is w

    def started(self, w: Worker, state: WorkerState, keep_steps: bool) -> None:
        """A new process of `w` is being started: its record begins a new incarnation, in `state`."""
        w.begin_incarnation(f"{w.rank}.{w.incarnation}.{time.monotonic_ns()}", state, keep_steps)
        self._by_tag[w.tag] = w

    def gone(self, w: Worker) -> None:
        self._by_tag.pop(w.tag, None)

    def replica(self, rep: int, k: int) -> List[Worker]:
        return [o for o in self.workers if o.rank // k == rep]

    def on_spawned(self, ev: Spawned, stop_sig: Optional[int]) -> bool:
        """A process started; True when it is a current worker's. One asked to stop before it
        existed gets the stop's signal (`stop_sig`) while in grace, else SIGKILL."""
        w = self._by_tag.get(ev.tag)
        if w is None:
            return False
        w.pid = ev.pid
        if w.stop_requested:
            if not signal_group(ev.pid, stop_sig if stop_sig is not None and w.kill_at else signal.SIGKILL):
                # Just forked: not yet the leader of its own session (the group signal is
                # lost) and still with the zygote's handlers (SIGINT ignored). It has run
                # nothing of the script: SIGKILL, or it would run until the grace ends.
                try:
                    os.kill(ev.pid, signal.SIGKILL)
                except OSError:
                    pass
        return True

    def on_exit(self, ev: WorkerExited) -> Optional[Worker]:
        """The current worker whose process exited (what it started is SIGKILLed); None for an old
        incarnation already accounted for. A worker asked to stop stays in the table (the stop's)."""
        w = self._by_tag.get(ev.tag)
        if w is None or ev.tag != w.tag:
            self._by_tag.pop(ev.tag, None)
            return None
        signal_group(ev.pid, signal.SIGKILL)  # nothing the worker started may outlive it
        w.pid = ev.pid
        if not w.stop_requested:
            self._by_tag.pop(ev.tag)
            w.kill_at = None
        return w

    def kill_replica(self, rep: int, k: int, state: WorkerState) -> None:
        """A failed replica's other workers: SIGKILL at once (nothing of theirs is worth a grace, and
        a collective with their dead peer would hold them, NCCL included)."""
        by_rank = {o.rank: o for o in self.replica(rep, k)}
        # The one that failed is gone already: each other one still running is stopped with it.
        stop = set(replica_rules.stopped_with(rep, k, -1, lambda r: r in by_rank and self.runs(by_rank[r])))
        for o in by_rank.values():
            if o.rank in stop:
                o.state = state
                o.stop_requested = True  # its exit is a stop, not a failure of its own
                signal_group(o.pid, signal.SIGKILL)  # one not started yet gets it once it is
            elif o.alive:
                o.state = state

    def restart_later(self, rep: int) -> None:
        self._respawning[rep] = True

    def respawns(self, k: int) -> List[Worker]:
        """The workers of every replica whose restart waited and whose last old process is gone,
        each with the replica's next incarnation: the loop starts them."""
        out: List[Worker] = []
        for rep in [r for r in self._respawning if not any(self.runs(o) for o in self.replica(r, k))]:
            del self._respawning[rep]
            workers = self.replica(rep, k)
            inc = replica_rules.next_incarnation(o.incarnation for o in workers)  # one for the whole replica
            for o in workers:
                o.incarnation = inc
            out += workers
        return out

    def kill_overdue(self, now: float) -> None:
        """SIGKILL every worker past its deadline (a stop's grace, a hung worker's stacks dump)."""
        for w in self.workers:
            if w.kill_at and now >= w.kill_at:
                signal_group(w.pid, signal.SIGKILL)
                w.kill_at = None

    def hung(self, w: Worker, reason: str, now: float, stacks: Path, console: ConsoleOut) -> None:
        """A hung worker dumps its Python stacks (to `stacks`), then gets SIGKILL."""
        console.note(f"rank {w.rank} (pid {w.pid}) is {reason}: killing it; its Python stacks go to {stacks}",
                     style="bold red")
        w.hang_reason = reason
        w.state = WorkerState.HUNG
        if w.pid:
            try:
                os.kill(w.pid, DUMP_STACKS_SIGNAL)
            except OSError:
                pass
        w.kill_at = now + HANG_DUMP_GRACE_S
