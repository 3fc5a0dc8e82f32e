"""The supervisor's goodput books: what its loop sees, turned into the accountant's events,
and the answer put where people and monitoring look.

The loop calls one method per thing it saw (a worker spawned, reported progress, failed,
hung, finished; a checkpoint was published; a group restart began); this module maps
workers to lanes (a --ft replica of K workers is one lane, a rank without --ft is one),
estimates the steps a group restart lost (those since the script's last save, from the
step counts the workers report), and hands the accountant (ftrun.supervisor.accounting.goodput)
times. At every state write it fills the state file's goodput, lost_s and failures,
samples the timeline (written beside the state for `ftrun report`) and gives the
metrics endpoint (--metrics-port) a new view; at the end it prints the summary.
Must never import torch, touch processes, or read the store: the loop passes what it read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from ftrun.status.state import RunStatus
from ftrun.supervisor.accounting.goodput import Accountant, Breakdown, LaneState
from ftrun.supervisor.accounting.timeline import Checkpoints, StepSeries, write_timeline
from ftrun.supervisor.workers.worker import Failure, Worker
from ftrun.wire import FirstFailure, ProgressReport

TIMELINE_EVERY_S = 5.0
STATE_FAILURES = 100  # the newest failures in the state file (the timeline keeps up to 1000)
CAUSE_WORDS = {"startup": "start-up", "failures": "failures", "hangs": "hangs", "checkpoints": "checkpoints",
               "waiting": "waiting", "output": "output waits", "end": "the run's end"}


class Ledger:
    def __init__(self, cfg: Any, started: float, folder: Path, console: Any) -> None:
        self.cfg = cfg
        self.k = cfg.replica_size if cfg.ft else 1
        self.lanes = max(1, cfg.nproc // self.k)
        self.first_replica = cfg.node_rank * self.lanes
        self.books = Accountant(self.lanes, started, cfg.ft)
        self.folder = folder
        self.console = console
        self.started = started
        self.series = StepSeries()
        self.checkpoints = Checkpoints()
        self.restarts = 0
        self.reported: Dict[int, Tuple[int, int]] = {}  # rank -> (steps, steps at its latest save) this attempt
        self.group_failure: Optional[int] = None        # without --ft: the failure the group stops for
        self._timeline_at = 0.0
        self.metrics: Any = None
        self._last: Optional[Breakdown] = None
        self.spawned_any = False  # a run that failed to join started nothing: no summary to say
        self.closed = False

    # ------------------------------------------------------------ the loop's events
    def lane(self, w: Worker) -> int:
        return w.spec.local_rank // self.k

    def _leads(self, w: Worker) -> bool:
        """The replica's first worker speaks for its lane's progress (its mates step with it)."""
        return w.spec.local_rank % self.k == 0

    def spawned(self, w: Worker, now: float) -> None:
        self.spawned_any = True
        if not self._leads(w):
            return
        if self.cfg.ft and w.incarnation > 0:
            self.restarts += 1
        self.books.spawned(self.lane(w), now)

    def progress(self, w: Worker, report: ProgressReport, now: float) -> None:
        """A progress report (ftrun.worker.progress) of `w`'s current incarnation."""
        self.reported[w.rank] = (report.steps, report.saved_steps)
        if self._leads(w):
            self.books.progress(self.lane(w), now, report.steps, report.last_step_time,
                                report.first_step_time or None)

    def failed(self, w: Worker, failure: Failure, now: float, seen: Optional[float] = None) -> None:
        """A worker failed (its replica's lane, with --ft; the group stops for it, without);
        `seen`: when its exit was reaped, so the loop's latency is the time to detect it."""
        if self.cfg.ft and self.books.lanes[self.lane(w)].state is LaneState.AWAY:
            return  # a mate of a replica that already failed
        kind = "hang" if w.hang_reason else ("signal" if failure.signal else "exit")
        detect = None if w.hang_reason else max(0.0, now - seen) if seen else 0.0
        idx = self.books.failed(self.lane(w), failure.when, rank=w.rank, cause=failure.reason, kind=kind,
                                detect_s=detect)
        if not self.cfg.ft:
            self._stop_group(idx, failure.when)

    def remote_failure(self, info: FirstFailure, now: float) -> None:
        """Without --ft: another node's failure stops this node's group too."""
        if self.group_failure is not None:
            return
        idx = self.books.failed(0, now, rank=info.rank, cause=info.reason,
                                kind="remote", detect_s=0.0)
        self.books.failures[idx].replica = -1
        self._stop_group(idx, now)

    def _stop_group(self, idx: int, now: float) -> None:
        self.group_failure = idx
        for lane in range(self.lanes):
            self.books.stopped(lane, now, failure=idx)

    def hung(self, w: Worker, now: float, limit: float) -> None:
        """`w` was found hung at `now` by a rule that looks `limit` seconds back."""
        self.books.hung(self.lane(w), now, since=now - limit)

    def given_up(self, w: Worker, now: float) -> None:
        self.books.given_up(self.lane(w), now)

    def spare(self, w: Worker, waiting: Optional[bool], now: float) -> None:
        """--spares: whether the keeper holds `w`'s replica back as a hot spare now (None: no spares,
        or no live incarnation: its exit is booked by done or failed)."""
        if waiting is not None and self._leads(w):
            self.books.spare(self.lane(w), now, waiting)

    def done(self, w: Worker, now: float) -> None:
        if self._leads(w):
            self.books.done(self.lane(w), now)

    def stopped(self, w: Worker, now: float) -> None:
        """ftrun stopped `w` (a signal, the run's end, its replica's or group's failure)."""
        self.books.stopped(self.lane(w), now, failure=self.group_failure if not self.cfg.ft else None)

    def group_restart(self, now: float, elsewhere: Optional[ProgressReport] = None) -> None:
        """Without --ft, the next attempt starts: the last one lost the steps since the script's
        own last save (all of them when it saved nothing), estimated from the step counts.
        `elsewhere`: rank 0's last report, read by a node that does not run it (scripts save there)."""
        steps = max((s for s, _ in self.reported.values()), default=0)
        saved = max((v for _, v in self.reported.values()), default=-1)
        if elsewhere is not None:
            saved = max(saved, elsewhere.saved_steps)
        lost = max(0, steps - max(saved, 0))
        if self.group_failure is not None:
            self.books.group_restart(self.group_failure, lost)
        self.restarts += 1
        self.reported.clear()
        self.group_failure = None

    def checkpoint(self, info: Dict[str, Any]) -> None:
        """A checkpoint was published (its info from the store, as `ftrun status` shows it)."""
        entry = self.checkpoints.add(info)
        if entry is None:
            return
        pause = entry.get("pause_s") if isinstance(entry.get("pause_s"), (int, float)) else 0.0
        write = entry.get("write_s") if isinstance(entry.get("write_s"), (int, float)) else 0.0
        self.books.checkpoint(float(entry["time"]) - float(write), float(pause))

    # ------------------------------------------------------------ where it is shown
    def fill(self, status: RunStatus, now: float) -> None:
        """The state file's figures (every state write), the timeline sample, the metrics' view."""
        if status.steps_discarded:
            self.books.rounds_discarded(int(status.steps_discarded))
        b = self.books.snapshot(now)
        self._last = b
        status.goodput = round(b.goodput, 4) if b.goodput is not None else None
        status.lost_s = b.lost_by_cause()
        status.replica_s = round(b.replica_s, 3)
        status.spare_s = round(b.spare_s, 3) if self.cfg.spares else None
        status.steps_lost = b.steps_lost
        status.failures = [self._record(f) for f in b.failures[-STATE_FAILURES:]]
        self.series.sample(now, b.steps_taken)
        if self.metrics is not None:
            self.metrics.collector.update(self.view(b, status))
        if now - self._timeline_at >= TIMELINE_EVERY_S:
            self.write_timeline(status, now, b)

    def _record(self, f: Any) -> Dict[str, Any]:
        d = f.to_dict()
        if d["replica"] >= 0:
            d["replica"] = self.first_replica + d["replica"]
        d["node_rank"] = self.cfg.node_rank
        return d

    def view(self, b: Breakdown, status: RunStatus) -> Any:
        from ftrun.supervisor.accounting.metrics import MetricsView

        states: Dict[str, int] = {s.value: 0 for s in LaneState}
        for s in b.lanes.values():
            states[s] += 1
        kinds: Dict[str, int] = {"exit": 0, "signal": 0, "hang": 0}
        for f in b.failures:
            if f.kind in kinds:
                kinds[f.kind] += 1
        ck = status.checkpoint or {}
        return MetricsView(
            # --ft: the quorum's count (polled more often than the progress the books see), whichever is newer
            replicas=states, steps_committed=max(b.steps_taken, status.steps_committed or 0),
            steps_discarded=b.steps_lost, failures=kinds,
            restarts=self.restarts, heal_s=tuple(f.back_s for f in b.failures if f.back_s is not None),
            goodput=b.goodput, lost_s=dict(b.lost_s), spare_s=b.spare_s if self.cfg.spares else None,
            checkpoint_s={k[:-2]: float(ck[k]) for k in ("write_s", "pause_s") if isinstance(ck.get(k), (int, float))})

    def write_timeline(self, status: RunStatus, now: float, b: Optional[Breakdown] = None) -> None:
        b = b or self.books.snapshot(now)
        self._timeline_at = now
        data = {
            "run_id": self.cfg.run_id, "node_rank": self.cfg.node_rank, "nnodes": self.cfg.nnodes,
            "script": status.script, "argv": status.argv, "ft": self.cfg.ft, "replica_size": self.k,
            "started": self.started, "now": b.now, "ended": status.ended,
            "exit_code": status.exit_code, "exit_summary": status.exit_summary,
            "lanes": [{"replica": self.first_replica + r,
                       "ranks": [self.cfg.node_rank * self.cfg.nproc + r * self.k + i for i in range(self.k)],
                       "segments": [[round(a, 3), round(e, 3), s] for a, e, s in segs]}
                      for r, segs in self.books.segments(now).items()],
            "failures": [self._record(f) for f in b.failures],
            "steps": [[round(t, 3), n] for t, n in self.series.points] + [[round(b.now, 3), b.steps_taken]],
            "checkpoints": list(self.checkpoints.items),
            "goodput": b.goodput, "replica_s": b.replica_s, "productive_s": b.productive_s,
            "lost_s": dict(b.lost_s), "spare_s": b.spare_s, "steps_taken": b.steps_taken, "steps_lost": b.steps_lost,
            "step_s": self.books.step_time(),
        }
        try:
            write_timeline(self.folder, data)
        except OSError as e:  # a full disk must not stop the run: said once; the state file has the figures
            self.console.trouble.failed("state", self.folder, e)

    def start_metrics(self) -> Optional[str]:
        """Serve --metrics-port; its URL, or None (with a line saying why) when it cannot listen."""
        if self.cfg.metrics_port is None:
            return None
        host, port = self.cfg.metrics_port
        try:
            from ftrun.supervisor.accounting.metrics import MetricsServer

            self.metrics = MetricsServer(host, port, self.cfg.run_id, self.cfg.node_rank)
        except OSError as e:
            self.console.note(f"--metrics-port {host}:{port}: cannot listen ({e.strerror or e}); the run goes on "
                              f"without metrics", style="bold yellow")
            return None
        return self.metrics.url

    def finish(self, status: RunStatus, now: float) -> None:
        """The run ended: close the books, write the timeline, stop serving metrics, say the summary
        (once: a failed run says it before its failure report; a run that started no worker, never)."""
        if self.closed:
            self.fill(status, now)
            self.write_timeline(status, now)  # the state's final words (exit status, summary)
            return
        self.closed = True
        self.books.end(now)
        self.fill(status, now)
        self.write_timeline(status, now)
        if self.metrics is not None:
            self.metrics.close()
        b = self._last
        if b is not None and b.replica_s > 0 and self.spawned_any:
            for line in summary_lines(b, self.lanes):
                self.console.note(line, style="bold blue")


def _s(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 600 else f"{seconds / 60:.1f} min"


def summary_lines(b: Breakdown, lanes: int) -> List[str]:
    """Two or three lines: the goodput, the time lost by cause, and the failures with how fast
    each came back. Hot spares' waiting time is said apart: it is not replica-time."""
    wall = (b.replica_s + b.spare_s) / max(1, lanes)
    apart = f", less {_s(b.spare_s)} waiting as hot spares" if b.spare_s >= 0.05 else ""
    head = (f"goodput {100 * (b.goodput or 0):.1f}%: {_s(b.productive_s)} of {_s(b.replica_s)} "
            f"replica-time ({lanes} replica{'s' if lanes != 1 else ''} x {_s(wall)}{apart}) went to committed steps")
    lost = [(c, s) for c, s in b.lost_s.items() if s >= 0.05]
    lines = [head, "lost: " + (", ".join(f"{CAUSE_WORDS.get(c, c)} {_s(s)}" for c, s in
                                        sorted(lost, key=lambda cs: -cs[1])) if lost else "nothing")]
    if b.failures:
        shown = []
        for f in b.failures[:4]:
            who = f"rank {f.rank}" if f.rank >= 0 else "a rank"
            back = f"back in {f.back_s:.2f} s" if f.back_s is not None else "never back"  # the run has ended
            shown.append(f"{who} {_short(f.cause)} at {_s(f.time - (b.now - wall))}, {back}")
        more = f"; and {len(b.failures) - 4} more" if len(b.failures) > 4 else ""
        steps = sum(f.lost_steps for f in b.failures)
        lines.append(f"{len(b.failures)} failure{'s' if len(b.failures) != 1 else ''}"
                     f"{f' ({steps} steps redone)' if steps else ''}: " + "; ".join(shown) + more)
    return lines


def _short(reason: str) -> str:
    """'killed by SIGKILL (signal 9; often the ...)' -> 'killed by SIGKILL'."""
    return reason.split(" (", 1)[0].split(": ", 1)[0][:80]

