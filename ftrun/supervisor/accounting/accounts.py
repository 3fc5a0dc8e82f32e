"""The accounting component of the supervisor's loop: the run's status (what `ftrun status`
reads), the workers' progress as they report it, the goodput ledger, the newest checkpoint and
the processes' activity, and when the state file is written.

The loop tells it what happened (a worker spawned, a summary, a group restart, the end) and
asks it to write; it owns every field of the status. Accounting must never take the run down
(ftrun.supervisor.accounting.status_writer), never change a worker's state but the first progress of a
worker without --ft (it is then running), and never decide anything else.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, List, Optional, Sequence

from ftrun.config import RunConfig
from ftrun.status.state import RunPhase, RunStatus, run_dir, run_folder_name
from ftrun.supervisor.accounting import activity
from ftrun.supervisor.accounting import checkpoints
from ftrun.supervisor.accounting.ledger import Ledger
from ftrun.supervisor.accounting.progress_reader import ProgressReader, note_steps
from ftrun.supervisor.accounting.status_writer import StatusWriter
from ftrun.supervisor.workers.logs import ConsoleOut
from ftrun.supervisor.workers.spawn import take_early_start
from ftrun.supervisor.workers.worker import Failure, Worker, WorkerState

METRICS_S = 1.0  # how often the processes' CPU and memory are sampled


class Accounting:
    """The run's status, progress, goodput and checkpoints. `reports`: where the workers report
    progress (the node's own store when it relays them, else the run's)."""

    def __init__(self, cfg: RunConfig, console: ConsoleOut, policy_name: str, log_dir: str, reports: Any) -> None:
        self.cfg = cfg
        self.console = console
        # The run's start-up began before the torch import the supervisor and the zygote share.
        self.started = take_early_start() or time.time()
        self.status = RunStatus(
            run_id=cfg.run_id, script=cfg.script, argv=list(sys.argv), started=self.started, pid=os.getpid(),
            hook=cfg.hook.describe() if cfg.hook else None, policy=policy_name,
            max_restarts=cfg.max_restarts, nproc=cfg.nproc, nnodes=cfg.nnodes, node_rank=cfg.node_rank,
            log_dir=log_dir,
        )
        rdir = run_dir(run_folder_name(cfg.run_id, cfg.nnodes, cfg.node_rank))
        self.ledger = Ledger(cfg, self.started, rdir, console)  # goodput, timeline, metrics
        self._writer = StatusWriter(self.status, rdir / "state.json", self.ledger, console, cfg.node_rank)
        self.progress = ProgressReader(reports)
        # How often the state file may be rewritten while something changes: with --ft the step
        # moves every tick, and `ftrun status` must show the current one (a write is a small file).
        self._write_s = 0.1 if cfg.ft else 0.2
        self._dirty = True
        self._store_seen = False  # the run's store was found ready (its progress keys exist)
        self._last_write = 0.0
        self._last_metrics = 0.0
        self._checkpoints = checkpoints.CheckpointWatch()
        self._sampler = activity.ProcessSampler()

    # ------------------------------------------------------------ what the loop says
    def changed(self) -> None:
        """The state file is out of date."""
        self._dirty = True

    def start_metrics(self) -> Optional[str]:
        self.status.metrics_url = self.ledger.start_metrics()
        return self.status.metrics_url

    def summary(self, text: str) -> None:
        """The run's one line for `ftrun status` (why it ends, or ended)."""
        self.status.exit_summary = text

    def policy(self, name: str) -> None:
        self.status.policy = name
        self._dirty = True

    def group_restarted(self, restarts: int) -> None:
        self.status.group_restarts = restarts

    # ------------------------------------------------------------ reading
    def store_found(self, store: Any) -> bool:
        """True the first time the run's store is found up: the loop then seeds the progress keys,
        before any read (a read of a key no worker wrote yet waits out the store's timeout)."""
        if store is None or not store.ready.is_set() or self._store_seen:
            return False
        self._store_seen = True
        if store.store is None:
            self.console.note(f"could not host the run's store: {store.error}", style="bold red")
            return False
        return True

    def read_progress(self, store: Any, workers: Sequence[Worker], ft: bool, now: float) -> List[int]:
        """The workers' new progress reports (a few times a second), once store_found() said so;
        the ranks whose first report says they run (without --ft: with it, joining a quorum does)."""
        started: List[int] = []
        if not self._store_seen or store is None or store.store is None:
            return started
        for w, report in self.progress.read_new(workers):
            w.last_heartbeat = now
            w.next_sync = report.next_sync
            w.note_activity(report.activity, now)
            self.ledger.progress(w, report, now)
            if w.state == WorkerState.STARTING and not ft:
                started.append(w.rank)
                self._dirty = True
            if note_steps(w, report.steps, now):
                self._dirty = True
        return started

    def read_last_reports(self, workers: Sequence[Worker], quorum: Any) -> None:
        """Take in the report each worker writes as it exits (ftrun.worker.progress), so the
        ended run's state says where every replica stopped, not where it was a beat earlier."""
        if not self._store_seen:
            return  # the keys were never created: a read would wait for them (for minutes)
        reports = self.progress.read_last(workers)
        if reports is None:
            return  # the store is gone: the last figures read stand
        for w, report in reports:
            w.steps = report.steps
            self.ledger.progress(w, report, time.time())
        if quorum is not None:
            try:
                quorum.poll(time.time())  # the replicas' last info: the run's final figures
            except Exception:
                pass

    def poll_checkpoint(self, store: Any) -> None:
        """The newest good checkpoint and the saves failed since, for `ftrun status`."""
        try:
            ck = self._checkpoints.poll(store)
        except Exception:
            return
        if ck is not None:
            self.status.checkpoint = ck
            self.ledger.checkpoint(ck)  # once per good checkpoint (a failed save changes nothing there)
            self._dirty = True

    # ------------------------------------------------------------ writing
    def tick(self, workers: Sequence[Worker], quorum: Any, nodes: Any, now: float) -> None:
        """Each turn: sample the processes once a second; write the state when it changed (at most
        every write interval) or half a second at most."""
        if now - self._last_metrics >= METRICS_S:
            self._last_metrics = now
            self._sampler.sample(workers, now)
            self._dirty = True
        # Step counts change every tick with --ft: `ftrun status` needs them a few times a
        # second, not at the 20 Hz the quorum is polled (each write is a JSON file).
        if self._dirty and now - self._last_write >= self._write_s or now - self._last_write >= 0.5:
            self.write(workers, quorum, nodes)

    def write(self, workers: Sequence[Worker], quorum: Any, nodes: Any) -> None:
        self._writer.write(workers, quorum, nodes)
        self._last_write = time.time()
        self._dirty = False

    def fill_goodput(self, end: bool = False) -> None:
        self._writer.fill_goodput(end)

    def ended(self, code: int, first_failure: Optional[Failure]) -> None:
        """The run is over with ftrun's exit status `code`."""
        self.status.phase = RunPhase.ENDED.value
        self.status.exit_code = code
        self.status.ended = time.time()
        if code == 0:
            self.status.exit_summary = "all workers finished"
        elif first_failure is not None:
            self.status.exit_summary = f"rank {first_failure.rank} {first_failure.reason}"
        else:
            self.status.exit_summary = f"stopped (exit {code})"
