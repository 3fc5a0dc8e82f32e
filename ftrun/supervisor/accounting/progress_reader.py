"""Reading the workers' progress reports (ftrun.wire.ProgressReport) from the store.

Every progress key is seeded before its worker starts, so a multi_get never waits for
one; each tick the reader hands the loop the reports that changed since it last read,
of each worker's current incarnation, decoded by the one codec. note_steps() keeps a
worker's step count and step rate from whatever reported it (a progress key, or under
--ft the quorum's info).
Must never decide anything from a report (hangs, restarts, states are the loop's) and
never wait on the store beyond its bounded client timeout.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

from ftrun.keys import progress_key
from ftrun.supervisor.store import STORE_TIMEOUT_S, RunStore
from ftrun.supervisor.workers.worker import Worker
from ftrun.wire import NO_PROGRESS, ProgressReport, Raw

Reports = List[Tuple[Worker, ProgressReport]]


class ProgressReader:
    """The progress reports of this node's workers. `where` gives the store they report to: the
    node's own when its node relays (ftrun.supervisor.relay), else the run's."""

    def __init__(self, where: Callable[[], Optional[RunStore]]) -> None:
        self._where = where
        self._seen: Dict[int, Raw] = {}  # rank -> the raw report last decoded

    def forget(self, rank: int) -> None:
        """A new incarnation of `rank` starts: its next report is news, whatever it says."""
        self._seen.pop(rank, None)

    def seed(self, ranks: Sequence[int]) -> None:
        """Create every rank's key (a key a worker already wrote is left alone)."""
        reports = self._where()
        reports.wait(STORE_TIMEOUT_S)  # the node's store, built alongside the run's: up by now
        for rank in ranks:
            try:
                reports.store.compare_set(progress_key(rank), "", NO_PROGRESS.encode())
            except Exception:
                pass

    def read_new(self, workers: Sequence[Worker]) -> Reports:
        """The reports that changed since the last read, of live workers' current incarnations;
        none when the store cannot be read now."""
        reports = self._where()
        if reports is None or reports.store is None:
            return []
        try:
            values = reports.multi_get([progress_key(w.rank) for w in workers])
        except Exception:
            return []
        out: Reports = []
        for w, raw in zip(workers, values):
            if raw == self._seen.get(w.rank):
                continue
            self._seen[w.rank] = raw
            report = ProgressReport.decode(raw)
            if report is not None and report.incarnation == w.incarnation and w.alive:
                out.append((w, report))
        return out

    def read_last(self, workers: Sequence[Worker]) -> Optional[Reports]:
        """The report each worker wrote as it exited (ftrun.worker.progress), of its last
        incarnation and after at least one step; None when the keys or the store are gone."""
        st = self._where()
        if st is None or st.store is None:
            return None
        wanted = [progress_key(w.rank) for w in workers]
        try:
            if not st.store.check(wanted):
                return None
            values = st.multi_get(wanted)
        except Exception:  # the store (node 0's) is gone: the last figures read stand
            return None
        out: Reports = []
        for w, raw in zip(workers, values):
            report = ProgressReport.decode(raw)
            if report is not None and report.incarnation == w.incarnation and report.steps > 0:
                out.append((w, report))
        return out


def note_steps(w: Worker, steps: int, now: float) -> bool:
    """`w`'s step count as last reported; True when it moved (the state file is then stale)."""
    if steps == w.steps or steps <= 0:
        return False
    if w.last_step_time and steps > w.steps:
        dt = max(1e-3, now - w.last_step_time)
        rate = (steps - w.steps) / dt
        w.steps_per_s = rate if w.steps_per_s == 0 else 0.7 * w.steps_per_s + 0.3 * rate
    w.steps = steps
    w.last_step_time = now
    w.first_step_seen = True
    return True
