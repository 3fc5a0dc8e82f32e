"""The run's state file (ftrun.status.state), as `ftrun status` reads it: the run's figures, every
replica's row (this node's, and under several nodes every other node's), and the goodput.

The loop says when to write (a change, or half a second at most); this module
gathers the figures and writes them. Accounting must never take the run down:
an error in the goodput is said once, and the run goes on; so is a state file that cannot be
written (a full disk), and what the pumps could not write is counted in the file.
Must never change a worker's record or the quorum, and never decide anything.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Protocol, Sequence

from ftrun.status.state import ReplicaStatus, RunStatus, write_state
from ftrun.supervisor.accounting.ledger import Ledger
from ftrun.supervisor.workers.logs import ConsoleOut
from ftrun.supervisor.workers.worker import Worker



class QuorumFields(Protocol):
    """What the state file takes from the --ft keeper (ftrun.supervisor.ft.quorum.QuorumKeeper):
    accounting sits below the keeper and names only what it reads."""

    def replica_fields(self, rank: int) -> Dict[str, Any]: ...

    def run_fields(self) -> Dict[str, Any]: ...


class NodeReplicas(Protocol):
    """What the state file takes from the node coordinator (ftrun.supervisor.nodes.coordinator)."""

    def all_replicas(self, local: List[ReplicaStatus]) -> List[ReplicaStatus]: ...


class StatusWriter:
    def __init__(self, status: RunStatus, path: Path, ledger: Ledger, console: ConsoleOut, node_rank: int) -> None:
        self.status = status
        self.path = path
        self.ledger = ledger
        self.console = console
        self.node_rank = node_rank
        self._ledger_failed = False

    def replica_status(self, w: Worker, quorum: Optional[QuorumFields]) -> ReplicaStatus:
        return ReplicaStatus(
            rank=w.rank, local_rank=w.spec.local_rank, pid=w.pid, state=w.state.value, restarts=w.restarts,
            step=w.steps, steps_per_s=round(w.steps_per_s, 3), last_heartbeat=w.last_heartbeat,
            last_step_time=w.last_step_time, cpu_percent=w.cpu_percent, rss_bytes=w.rss_bytes,
            last_failure=w.last_failure.reason if w.last_failure else None, node_rank=self.node_rank,
            next_sync=w.next_sync if w.next_sync >= 0 else None,
            **(quorum.replica_fields(w.rank) if quorum is not None else {}),
        )

    def write(self, workers: Sequence[Worker], quorum: Optional[QuorumFields],
              nodes: Optional[NodeReplicas]) -> None:
        if quorum is not None:
            # Every write, not only when the quorum changes: the figures move with every step.
            for k, v in quorum.run_fields().items():
                setattr(self.status, k, v)
        self.status.replicas = [self.replica_status(w, quorum) for w in workers]
        try:
            now = time.time()
            for w, row in zip(workers, self.status.replicas):  # --spares: a hot spare's wait is booked apart
                self.ledger.spare(w, row.spare, now)
        except Exception as e:  # noqa: BLE001
            self._failed(e)
        if nodes is not None:
            self.status.replicas = nodes.all_replicas(self.status.replicas)
        self.fill_goodput()
        self.status.not_written = self.console.trouble.fields()
        try:
            write_state(self.path, self.status)
        except OSError as e:  # a full disk under FTRUN_HOME: said once, training goes on
            self.console.trouble.failed("state", self.path.parent, e)

    def fill_goodput(self, end: bool = False) -> None:
        """The goodput figures (state, timeline, metrics; at the end the summary too)."""
        try:
            for start, stop in self.console.trouble.take_stalls():
                self.ledger.books.output_stall(start, stop)
            if end:
                self.ledger.finish(self.status, self.status.ended or time.time())
            else:
                self.ledger.fill(self.status, time.time())
        except Exception as e:  # noqa: BLE001
            self._failed(e)

    def _failed(self, e: Exception) -> None:
        if not self._ledger_failed:
            self._ledger_failed = True
            self.console.note(f"internal error in the goodput accounting ({type(e).__name__}: {e}); "
                              f"the run goes on without it", style="yellow")
