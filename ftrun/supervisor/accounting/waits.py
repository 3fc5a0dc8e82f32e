"""Progress for ftrun's own long waits, where a person waits: on a terminal only.

Waiting for the other nodes to join, a replica healing a large state from a peer, a
replica resuming from a checkpoint: each shows as a transient rich progress line on
stderr (a spinner, what is awaited, a bar where the count is known, the time so far)
once it has lasted SHOW_AFTER_S, and is gone when it ends. Nothing is drawn when
stderr is not a terminal (a log file, a pipe, CI), under --quiet, or with
FTRUN_PROGRESS=0: the log files never hold progress. While a line is shown, the
console's other lines print above it (ftrun.supervisor.workers.logs.ConsoleOut.live).
Must never block the supervisor's loop, decide anything, or import torch.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Mapping, Optional, Tuple

from ftrun.wire import MemberReport

SHOW_AFTER_S = 1.0
# A replica's phases (ftrun.worker.ft.manager) that are long waits a person may watch.
PHASES = {"heal": "healing from a peer", "heal-wait": "waiting to heal", "resume": "resuming from a checkpoint"}


class Waits:
    """The long waits shown now, by key; `sync` makes the display match what the caller sees."""

    def __init__(self, console: Any, enabled: Optional[bool] = None) -> None:
        self.console = console
        if enabled is None:
            enabled = (bool(getattr(console.err, "is_terminal", False)) and not getattr(console, "quiet", False)
                       and os.environ.get("FTRUN_PROGRESS", "1") != "0")
        self.enabled = enabled
        self.progress: Any = None
        self.tasks: Dict[str, Any] = {}

    def sync(self, waits: Mapping[str, Tuple[str, float, Optional[int], Optional[int]]], now: float) -> None:
        """Show exactly `waits`: key -> (what is awaited, since when (wall clock), done, total)."""
        if not self.enabled:
            return
        shown = {k: w for k, w in waits.items() if now - w[1] >= SHOW_AFTER_S}
        for key in [k for k in self.tasks if k not in shown]:
            self.progress.remove_task(self.tasks.pop(key))
        if not shown:
            self._stop()
            return
        self._start()
        for key, (text, _since, done, total) in shown.items():
            if key not in self.tasks:
                self.tasks[key] = self.progress.add_task(text, total=total, completed=done or 0)
            else:
                self.progress.update(self.tasks[key], description=text, total=total, completed=done or 0)

    def _start(self) -> None:
        if self.progress is not None:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        self.progress = Progress(SpinnerColumn(), TextColumn("ftrun: {task.description}"), BarColumn(bar_width=20),
                                 MofNCompleteColumn(), TimeElapsedColumn(), console=self.console.err,
                                 transient=True, redirect_stdout=False, redirect_stderr=False)
        with self.console.lock:
            self.console.live = True
            self.progress.start()

    def _stop(self) -> None:
        if self.progress is None:
            return
        with self.console.lock:
            self.progress.stop()
            self.console.live = False
        self.progress = None
        self.tasks.clear()

    def close(self) -> None:
        self._stop()


def replica_waits(info: Mapping[int, MemberReport], alive: Mapping[int, Optional[int]], k: int,
                  local: Any) -> Dict[str, Tuple[str, float, Optional[int], Optional[int]]]:
    """The long waits of this node's --ft replicas, from the quorum keeper's reports: a replica
    (its first worker's report) healing, waiting to heal, or resuming from a checkpoint."""
    out: Dict[str, Tuple[str, float, Optional[int], Optional[int]]] = {}
    for rank, d in info.items():
        if rank % k or rank not in local:
            continue
        phase, since = d.phase, d.phase_since
        if phase in PHASES and d.inc == alive.get(rank) and since is not None:
            who = f"rank {rank}" if k == 1 else f"replica {rank // k}"
            out[f"replica {rank}"] = (f"{who} {PHASES[phase]}", float(since), None, None)
    return out
