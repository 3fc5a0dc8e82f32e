"""Goodput: where a run's replica-time went, worked out from what the supervisor saw and when.

The accountant is told what happened and at what time (a replica spawned, stepped, failed,
hung, came back, finished; a checkpoint paused the loop; a group restart lost the steps
since the script's own checkpoint) and answers with the breakdown: goodput, the share of
the run's replica-time spent on committed steps, and the rest by cause (Cause, below).

Each replica is a lane that is, at every moment from the run's start to its end, in one
LaneState; every second of every lane lands in exactly one bucket, so the buckets add up
to the run's replica-time. A training lane's time between two of its steps is productive,
unless the gap is a stall (well beyond the run's usual step time): then the excess goes to
the cause whose window it overlaps (a hang until its detection, a failure until its replica
is back, a checkpoint's pause, a worker's full output pipe), or to waiting when none does.

A hot spare (--spares) is no training replica: its lane's time while it waits (and its own
start-up or restart before the keeper held it back) is booked apart, as spare time, and is not
in the replica-time goodput is the share of. Promoted, it takes over the open failure of the
replica whose place it takes: its heal is that failure's cost, and its first step brings it back.

Must never read the clock, the store or files, nor touch processes: time is an argument
of every call, and the supervisor (ftrun.supervisor.accounting.ledger) does the IO.
"""

from __future__ import annotations

import enum
import statistics
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Deque, Dict, List, Optional, Tuple

PRODUCTIVE = "productive"
SPARE_S = "spare"  # the books' bucket of hot spares' waiting time: apart from the replica-time
# A gap between steps is a stall once it exceeds the steps it holds by this many usual step times,
# and by STALL_MIN_S at least: below that it is the jitter of a busy machine, not lost time.
STALL_FACTOR = 1.0
STALL_MIN_S = 0.2
# Recent per-step times kept per lane for the usual step time (the median of every lane's): few
# enough that it follows the run's pace within a few reports when that changes (a machine less
# loaded); 64 for all lanes together lagged some 20 steps behind, and a survivor's stall at a kill
# was judged by the slower steps before and counted as steps.
STEP_SAMPLES = 8
MAX_SEGMENTS = 4000        # per lane, for the report; older ones are merged away beyond it
MAX_FAILURES = 1000


class Cause(str, enum.Enum):
    """Where replica-time that did not go to committed steps went (docs: goodput)."""

    STARTUP = "startup"          # from ftrun's start to each replica's first step
    FAILURES = "failures"        # detection, restart, heal, and steps discarded or redone
    HANGS = "hangs"              # a hung replica (and those waiting for it) until the hang is detected
    CHECKPOINTS = "checkpoints"  # the loop paused while a checkpoint was staged
    WAITING = "waiting"          # stalls with no failure, hang or checkpoint behind them
    OUTPUT = "output"            # stalls while a worker waited on its full output pipe (ftrun fell behind)
    END = "end"                  # from a replica's last step to the run's end


class LaneState(str, enum.Enum):
    """What a replica's lane is doing (the report draws one colour per state)."""

    STARTING = "starting"    # spawned (or about to be), no step yet
    TRAINING = "training"    # stepping
    HEALING = "healing"      # --ft: restarted, taking the state from a peer, not yet stepping
    AWAY = "away"            # failed or stopped, not yet started again
    HUNG = "hung"            # made no progress until the hang was detected and it was killed
    SPARE = "spare"          # --spares: a hot spare waiting out of the quorum (booked apart, not replica-time)
    GONE = "gone"            # no replica here any more: its restart budget was spent
    DONE = "done"            # finished; waits for the run's end


@dataclass
class FailureRecord:
    """One failure, as the state file and the report show it."""

    time: float                 # when the supervisor saw it (wall clock)
    rank: int
    replica: int
    cause: str                  # the reason, as a person reads it ("killed by SIGKILL ...")
    kind: str                   # exit, signal, hang or node: the metrics' label
    detect_s: float             # from the failure (or the hung replica's last progress) to its detection
    back_s: Optional[float] = None   # from the failure until its replica (or the group) stepped again
    lost_s: float = 0.0         # replica-seconds it cost, every lane's part together
    lost_steps: int = 0         # steps discarded or redone because of it

    def to_dict(self) -> Dict[str, object]:
        d = asdict(self)
        for k in ("time", "detect_s", "back_s", "lost_s"):
            if d[k] is not None:
                d[k] = round(d[k], 3)
        return d


@dataclass
class Window:
    """A stretch of time a stall that overlaps it is blamed on."""

    start: float
    end: Optional[float]        # None: still open
    cause: Cause
    failure: Optional[int] = None

    def overlaps(self, a: float, b: float) -> bool:
        return self.start < b and (self.end is None or self.end > a)


@dataclass
class Lane:
    replica: int
    since: float                        # when its current state began
    state: LaneState = LaneState.STARTING
    started_once: bool = False          # it has stepped at least once in this run
    last_step: Optional[float] = None   # when it took its latest step (TRAINING)
    steps: int = 0                      # the step count of its latest report
    failure: Optional[int] = None       # the failure it is away for (closed when it steps again)
    hung_detected: Optional[float] = None
    segments: List[Tuple[float, float, str]] = field(default_factory=list)


@dataclass
class Breakdown:
    """What the accountant answers: the run's goodput and lost time, as of `now`."""

    now: float
    replica_s: float                    # the run's replica-time so far (the training replicas': no spare's wait)
    productive_s: float
    lost_s: Dict[str, float]            # by Cause value, every cause present
    failures: List[FailureRecord]
    lanes: Dict[int, str]               # replica -> LaneState value now
    steps_taken: int                    # the run's steps (once per step, not per replica)
    steps_lost: int                     # discarded or redone
    spare_s: float = 0.0                # --spares: replica-seconds lanes spent as hot spares (not in replica_s)

    @property
    def goodput(self) -> Optional[float]:
        return self.productive_s / self.replica_s if self.replica_s > 0 else None

    def lost_by_cause(self) -> Dict[str, float]:
        return {k: round(v, 3) for k, v in self.lost_s.items()}


class Accountant:
    """The goodput books of one node's replicas (--ft replicas, or ranks of a group)."""

    def __init__(self, replicas: int, started: float, ft: bool) -> None:
        self.started = started
        self.ft = ft
        self.lanes: Dict[int, Lane] = {r: Lane(r, started) for r in range(replicas)}
        self.acc: Dict[str, float] = {PRODUCTIVE: 0.0, SPARE_S: 0.0, **{c.value: 0.0 for c in Cause}}
        self.failures: List[FailureRecord] = []
        self.windows: List[Window] = []
        self.step_times: Dict[int, Deque[float]] = {r: deque(maxlen=STEP_SAMPLES) for r in range(replicas)}
        self.ended: Optional[float] = None
        self.max_step = 0                   # --ft: the newest global step seen
        self.attempt_steps = 0              # without --ft: the current attempt's steps
        self.steps_before = 0               # without --ft: the steps of the attempts before it
        self.steps_lost = 0
        self.discarded_rounds = 0           # --ft: told by the quorum's reports
        self.clock = started                # the latest event's time (_at)

    # ------------------------------------------------------------ events
    def spawned(self, replica: int, t: float) -> None:
        """A replica's (new) process was started."""
        t = self._at(t)
        lane = self.lanes[replica]
        if lane.state in (LaneState.AWAY, LaneState.DONE, LaneState.GONE):
            self._move(lane, t, LaneState.HEALING if self.ft and lane.started_once else LaneState.STARTING)

    def progress(self, replica: int, t: float, steps: int, last_step: float, first_step: Optional[float]) -> None:
        """A progress report seen at `t`: `steps` (the incarnation's count, or the global step
        with --ft), the time of the latest step and of the incarnation's first."""
        t = self._at(t)
        lane = self.lanes[replica]
        if steps > 0 and lane.state in (LaneState.DONE, LaneState.AWAY):
            self._count_steps(steps)  # a last report, written as it exited: where it stopped
        if steps <= 0 or lane.state not in (LaneState.STARTING, LaneState.HEALING, LaneState.TRAINING,
                                            LaneState.SPARE):  # a spare promoted before the books were told
            return
        if lane.state is not LaneState.TRAINING and self.ft and not first_step:
            return  # --ft: healed to the run's step, but no step taken yet: not back
        last = min(max(last_step, lane.since), t)
        if lane.state is not LaneState.TRAINING:
            first = min(max(first_step if first_step else last, lane.since), last)
            fresh = self.ft and lane.started_once and steps < self.max_step and not any(
                o.state is LaneState.TRAINING for o in self.lanes.values())
            self._move(lane, first, LaneState.TRAINING)
            lane.started_once = True
            lane.last_step, lane.steps = last, steps
            self.acc[PRODUCTIVE] += last - first
            if lane.failure is not None:
                self._back(lane.failure, first)
                lane.failure = None
            if fresh:  # --ft: no replica held the trained state; the run went back to a checkpoint or to 0
                self._redo(self.max_step - steps, len(self.failures) - 1 if self.failures else None)
            self._count_steps(steps)
            return
        if steps == lane.steps:
            return
        if steps < lane.steps or last <= lane.last_step:
            lane.steps, lane.last_step = steps, max(last, lane.last_step)
            return
        self._book_steps(lane, lane.last_step, last, steps - lane.steps)
        lane.last_step, lane.steps = last, steps
        self._count_steps(steps)

    def failed(self, replica: int, t: float, rank: int, cause: str, kind: str,
               detect_s: Optional[float] = None) -> int:
        """A replica failed (seen at `t`); the index of its FailureRecord. Without --ft the
        failure stops every lane: stopped() for the others names this record."""
        t = self._at(t)
        lane = self.lanes[replica]
        hung_at = lane.since if lane.state is LaneState.HUNG else None
        if detect_s is None:
            detect_s = (lane.hung_detected - hung_at) if hung_at is not None and lane.hung_detected else 0.0
        rec = FailureRecord(time=t, rank=rank, replica=replica, cause=cause, kind=kind, detect_s=max(0.0, detect_s))
        if len(self.failures) < MAX_FAILURES:
            self.failures.append(rec)
        idx = len(self.failures) - 1
        for w in self.windows:  # the stalls its hang caused are its cost too
            if w.cause is Cause.HANGS and hung_at is not None and w.start == hung_at and w.failure is None:
                w.failure = idx
        begin = hung_at if hung_at is not None else (lane.last_step if lane.state is LaneState.TRAINING else t)
        self.windows.append(Window(begin, None, Cause.FAILURES, idx))
        self._leave(lane, t, idx)
        return idx

    def stopped(self, replica: int, t: float, failure: Optional[int] = None) -> None:
        """A replica was stopped by ftrun: for a group restart after `failure` (it comes back),
        or for the run's end (a signal, the budget spent)."""
        t = self._at(t)
        lane = self.lanes[replica]
        if lane.state in (LaneState.AWAY, LaneState.GONE, LaneState.DONE):
            return
        if failure is None:
            self._finish_lane(lane, t)
        else:
            self._leave(lane, t, failure)

    def hung(self, replica: int, t: float, since: float) -> None:
        """A replica was found hung at `t`, having made no progress since `since`."""
        t = self._at(t)
        lane = self.lanes[replica]
        if lane.state in (LaneState.AWAY, LaneState.GONE, LaneState.DONE, LaneState.HUNG):
            return
        if lane.state is LaneState.SPARE:
            self._move(lane, t, LaneState.STARTING)  # its wait up to now was a spare's
        # Hung from its last progress; a training lane's time since its last step is the hang's too.
        mark = lane.last_step if lane.state is LaneState.TRAINING else lane.since
        start = min(t, max(since, mark))
        self._accrue(Cause.HANGS if lane.state is LaneState.TRAINING else self._cause_of_state(lane), start - mark)
        self._segment(lane, start)
        lane.state, lane.since, lane.hung_detected = LaneState.HUNG, start, t
        self.windows.append(Window(start, t, Cause.HANGS))

    def given_up(self, replica: int, t: float) -> None:
        """Its restart budget is spent: the lane holds no replica from now on."""
        t = self._at(t)
        lane = self.lanes[replica]
        if lane.state is not LaneState.GONE:
            self._move(lane, t, LaneState.GONE)

    def spare(self, replica: int, t: float, waiting: bool) -> None:
        """--spares: the keeper holds the replica back as a hot spare (`waiting`), or no longer (it was
        promoted into a quorum in a failed replica's place, or it left). A replica held back after its
        start-up or restart: that stretch was a spare's too. A promoted spare heals for the failure
        whose place it takes (the oldest still open), and its first step brings that failure back."""
        t = self._at(t)
        lane = self.lanes[replica]
        if waiting and lane.state in (LaneState.STARTING, LaneState.HEALING):
            if lane.failure is not None:  # a spare's own failure (or one no spare here took over): back as a spare
                self._back(lane.failure, t)
            self._move(lane, t, LaneState.SPARE, spare=True)
            lane.failure = None
        elif not waiting and lane.state is LaneState.SPARE:
            self._move(lane, t, LaneState.HEALING)
            open_ = [o for o in self.lanes.values() if o.failure is not None and o.state is not LaneState.TRAINING
                     and o.failure < len(self.failures) and self.failures[o.failure].back_s is None]
            if open_:
                first = min(open_, key=lambda o: o.failure or 0)
                lane.failure, first.failure = first.failure, None

    def done(self, replica: int, t: float) -> None:
        """The replica finished (exit 0)."""
        t = self._at(t)
        self._finish_lane(self.lanes[replica], t)

    def checkpoint(self, start: float, pause_s: float) -> None:
        """A checkpoint paused the loop from `start` for `pause_s` seconds."""
        if pause_s > 0:
            self.windows.append(Window(start, start + pause_s, Cause.CHECKPOINTS))

    def output_stall(self, start: float, end: float) -> None:
        """A worker's output pipe was full from `start` to `end`: it may have waited to print
        (ftrun's log or console fell behind)."""
        if end > start:
            self.windows.append(Window(start, end, Cause.OUTPUT))

    def group_restart(self, failure: int, lost_steps: int) -> None:
        """Without --ft: the attempt that `failure` ended lost `lost_steps` steps (those since the
        script's own checkpoint): they were counted productive as they ran, and are redone."""
        self.steps_before += self.attempt_steps
        self.attempt_steps = 0
        self._redo(lost_steps, failure)

    def rounds_discarded(self, count: int) -> None:
        """--ft: the run's discarded rounds so far (their time shows as the survivors' stalls)."""
        self.discarded_rounds = max(self.discarded_rounds, count)

    def end(self, t: float) -> None:
        t = self._at(t)
        for lane in self.lanes.values():
            if lane.state is LaneState.TRAINING:
                self._finish_lane(lane, t)
        for lane in self.lanes.values():
            self._move(lane, t, lane.state)
        self.ended = t
        for w in self.windows:
            w.end = t if w.end is None else w.end

    # ------------------------------------------------------------ the books
    def snapshot(self, now: float) -> Breakdown:
        """The breakdown as of `now` (the lanes' open stretches counted as they stand)."""
        now = self.ended if self.ended is not None else max(now, self.clock)
        acc = dict(self.acc)
        failures = [FailureRecord(**asdict(f)) for f in self.failures]
        for lane in self.lanes.values():
            if lane.state is LaneState.TRAINING:
                pending = max(0.0, now - lane.last_step)
                limit = self._stall_limit()
                if pending <= limit:
                    acc[PRODUCTIVE] += pending
                else:
                    cause, idx = self._cause_of(lane.last_step, now)
                    acc[PRODUCTIVE] += limit
                    acc[cause.value] += pending - limit
                    if idx is not None:
                        failures[idx].lost_s += pending - limit
            elif lane.state is LaneState.SPARE:
                acc[SPARE_S] += max(0.0, now - lane.since)
            else:
                spent = max(0.0, now - lane.since)
                acc[self._cause_of_state(lane).value] += spent
                if lane.failure is not None and self._cause_of_state(lane) is Cause.FAILURES:
                    failures[lane.failure].lost_s += spent
        replica_s = max(0.0, max(0.0, now - self.started) * len(self.lanes) - acc[SPARE_S])
        lost = {c.value: acc[c.value] for c in Cause}
        return Breakdown(now=now, replica_s=replica_s, productive_s=acc[PRODUCTIVE], lost_s=lost, failures=failures,
                         lanes={r: lane.state.value for r, lane in self.lanes.items()},
                         steps_taken=self.steps_taken, steps_lost=self.steps_lost + self.discarded_rounds,
                         spare_s=acc[SPARE_S])

    @property
    def steps_taken(self) -> int:
        return self.max_step if self.ft else self.steps_before + self.attempt_steps

    def step_time(self) -> Optional[float]:
        """The run's usual time per step (median of the recent ones), None before any."""
        samples = [dt for lane in self.step_times.values() for dt in lane]
        return statistics.median(samples) if samples else None

    def segments(self, now: float) -> Dict[int, List[Tuple[float, float, str]]]:
        """Each lane's states over time, the open one up to `now` (for the report)."""
        now = self.ended if self.ended is not None else now
        out = {}
        for r, lane in self.lanes.items():
            segs = list(lane.segments)
            if now > lane.since:
                segs.append((lane.since, now, lane.state.value))
            out[r] = segs
        return out

    # ------------------------------------------------------------ inside
    def _at(self, t: float) -> float:
        """An event's time on the books' clock: the wall clock may step back (NTP), the books never do."""
        self.clock = max(self.clock, t)
        return self.clock

    def _stall_limit(self) -> float:
        typical = self.step_time()
        return max(STALL_MIN_S, STALL_FACTOR * typical) if typical else STALL_MIN_S

    def _book_steps(self, lane: Lane, a: float, b: float, n: int) -> None:
        """`n` steps between the lane's step at `a` and its step at `b`."""
        gap = b - a
        typical = self.step_time()
        expected = min(gap, n * typical) if typical else gap
        excess = gap - expected
        if typical is not None and excess > self._stall_limit():
            cause, idx = self._cause_of(a, b)
            self.acc[PRODUCTIVE] += expected
            self._accrue(cause, excess, idx)
        else:
            self.acc[PRODUCTIVE] += gap
            self.step_times[lane.replica].append(gap / n)

    def _cause_of(self, a: float, b: float) -> Tuple[Cause, Optional[int]]:
        """What a stall from `a` to `b` is blamed on: the weightiest window it overlaps."""
        best: Optional[Window] = None
        rank = {Cause.HANGS: 4, Cause.FAILURES: 3, Cause.CHECKPOINTS: 2, Cause.OUTPUT: 1}
        for w in self.windows:
            if w.overlaps(a, b) and (best is None or rank[w.cause] > rank[best.cause]):
                best = w
        self._prune()
        return (best.cause, best.failure) if best is not None else (Cause.WAITING, None)

    def _prune(self) -> None:
        """Windows that ended before every lane's latest step can no longer be overlapped."""
        if len(self.windows) < 64:
            return
        marks = [lane.last_step if lane.state is LaneState.TRAINING else lane.since for lane in self.lanes.values()]
        oldest = min(marks, default=0.0)
        self.windows = [w for w in self.windows if w.end is None or w.end >= oldest]

    def _cause_of_state(self, lane: Lane) -> Cause:
        if lane.state is LaneState.STARTING:
            return Cause.FAILURES if lane.started_once or lane.failure is not None else Cause.STARTUP
        if lane.state is LaneState.HUNG:
            return Cause.HANGS
        if lane.state is LaneState.DONE:
            return Cause.END
        if lane.state is LaneState.TRAINING:
            return Cause.WAITING
        return Cause.FAILURES  # healing, away, gone (a spare's wait is booked apart: _move, snapshot)

    def _accrue(self, cause: Cause, seconds: float, failure: Optional[int] = None) -> None:
        if seconds <= 0:
            return
        self.acc[cause.value] += seconds
        if failure is not None and cause in (Cause.FAILURES, Cause.HANGS) and failure < len(self.failures):
            self.failures[failure].lost_s += seconds

    def _segment(self, lane: Lane, t: float, state: Optional[LaneState] = None) -> None:
        if t > lane.since:
            if len(lane.segments) >= MAX_SEGMENTS:  # merge the two oldest: the report keeps its shape
                (a, _, s), (_, b, _) = lane.segments[0], lane.segments[1]
                lane.segments[:2] = [(a, b, s)]
            lane.segments.append((lane.since, t, (state or lane.state).value))

    def _move(self, lane: Lane, t: float, state: LaneState, spare: bool = False) -> None:
        """Close the lane's current state at `t` (its time to its cause, or a spare's time when `spare`
        or it waited as one) and enter `state`."""
        t = max(t, lane.since)
        if spare or lane.state is LaneState.SPARE:
            self.acc[SPARE_S] += t - lane.since
        elif lane.state is LaneState.TRAINING:
            self._close_training(lane, t, Cause.WAITING)
        elif lane.state is LaneState.HUNG:
            detected = min(max(lane.hung_detected or t, lane.since), t)
            self._accrue(Cause.HANGS, detected - lane.since, lane.failure)
            self._accrue(Cause.FAILURES, t - detected, lane.failure)
        else:
            self._accrue(self._cause_of_state(lane), t - lane.since,
                         lane.failure if self._cause_of_state(lane) is Cause.FAILURES else None)
        self._segment(lane, t, LaneState.SPARE if spare else None)
        lane.state, lane.since = state, t
        if state is not LaneState.HUNG:
            lane.hung_detected = None

    def _close_training(self, lane: Lane, t: float, stall: Cause, failure: Optional[int] = None) -> None:
        """The lane stops training at `t`: the time since its latest step goes to `stall` (the step
        in flight is lost with a failure; the script's tail after the last step is the run's end)."""
        self._accrue(stall, t - (lane.last_step or lane.since), failure)

    def _leave(self, lane: Lane, t: float, failure: int) -> None:
        """The lane goes away for `failure` (its own, or its group's)."""
        t = max(t, lane.since)
        if lane.state is LaneState.TRAINING:
            self._close_training(lane, t, Cause.FAILURES, failure)
            self._segment(lane, t)
            lane.state, lane.since = LaneState.AWAY, t
        else:
            lane.failure = failure if lane.state is LaneState.HUNG else lane.failure
            self._move(lane, t, LaneState.AWAY)
        lane.failure = failure
        lane.hung_detected = None

    def _finish_lane(self, lane: Lane, t: float) -> None:
        t = max(t, lane.since)
        if lane.state is LaneState.TRAINING:
            self._close_training(lane, t, Cause.END)
            self._segment(lane, t)
            lane.state, lane.since = LaneState.DONE, t
        elif lane.state is not LaneState.DONE:
            self._move(lane, t, LaneState.DONE)

    def _back(self, failure: int, t: float) -> None:
        rec = self.failures[failure] if failure < len(self.failures) else None
        if rec is not None and rec.back_s is None:
            rec.back_s = max(0.0, t - rec.time)
        for w in self.windows:
            if w.failure == failure and w.end is None:
                w.end = t

    def _redo(self, steps: int, failure: Optional[int]) -> None:
        """`steps` steps were lost and must be redone: their time moves from productive to failures."""
        if steps <= 0:
            return
        self.steps_lost += steps
        lanes = max(1, sum(1 for lane in self.lanes.values() if lane.started_once))
        seconds = min(self.acc[PRODUCTIVE], steps * (self.step_time() or 0.0) * lanes)
        self.acc[PRODUCTIVE] -= seconds
        self._accrue(Cause.FAILURES, seconds, failure)
        if failure is not None and failure < len(self.failures):
            self.failures[failure].lost_steps += steps

    def _count_steps(self, steps: int) -> None:
        if self.ft:
            self.max_step = max(self.max_step, steps)
        else:
            self.attempt_steps = max(self.attempt_steps, steps)
