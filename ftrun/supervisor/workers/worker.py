"""One supervised worker: its fixed spec and the record of its current incarnation.

States are explicit (WorkerState, below); the supervisor loop is
the only writer. Must never start processes or send signals itself.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import List, Optional

from ftrun.exits import EXIT_FAILED, EXIT_SIGNAL_BASE


class WorkerState(str, enum.Enum):
    """A worker process's life, as the supervisor's loop moves it (and `ftrun status` shows it)."""

    STARTING = "starting"      # spawned, no heartbeat yet
    RUNNING = "running"        # heartbeating
    HUNG = "hung"              # no optimizer step for --step-timeout: being killed
    RESTARTING = "restarting"  # died, a new incarnation is about to start
    RECOVERING = "recovering"  # with --ft: restarted and receiving state from a peer
    FAILED = "failed"          # died and will not be restarted
    DONE = "done"              # exited 0
    STOPPED = "stopped"        # stopped by ftrun (shutdown, group restart)


@dataclass(frozen=True)
class WorkerSpec:
    local_rank: int
    rank: int


@dataclass
class Failure:
    """Why an incarnation ended badly, as a person should read it."""

    rank: int
    pid: Optional[int]
    exit_code: Optional[int]
    signal: Optional[int]
    reason: str
    when: float
    stderr_tail: List[str] = field(default_factory=list)
    log_path: Optional[str] = None
    # A traceback's exception and innermost line, when it came before the incarnation's first
    # step: the same twice in a row is a deterministic error, not retried (policy/restart.py).
    signature: Optional[str] = None
    # A restart the other replicas' decision of a round forced on a sound process (policy/peer_restarts.py):
    # charged to no budget, never the run's first failure.
    by_peers: bool = False

    @property
    def status_code(self) -> int:
        """What ftrun exits with when this failure ends the run (shell convention for signals)."""
        if self.signal:
            return EXIT_SIGNAL_BASE + self.signal
        return self.exit_code if self.exit_code else EXIT_FAILED


@dataclass
class Worker:
    spec: WorkerSpec
    state: WorkerState = WorkerState.STARTING
    incarnation: int = 0          # TORCHELASTIC_RESTART_COUNT of the current process
    restarts: int = 0             # how many times this worker was restarted
    tag: str = ""                 # the spawner's handle of the current incarnation
    pid: Optional[int] = None
    started: float = field(default_factory=time.time)
    # progress, from the store
    steps: int = 0
    last_step_time: Optional[float] = None
    first_step_seen: bool = False
    last_activity: Optional[float] = None   # forward passes, torch.save/load: progress that is not a step
    finished_at: Optional[float] = None     # when this incarnation exited 0
    _activity_seen: Optional[int] = None
    last_heartbeat: Optional[float] = None
    steps_per_s: float = 0.0
    next_sync: int = -1           # --hook diloco or localsgd: the step of its next sync (-1: none)
    # when hung: SIGKILL deadline after the stack dump was requested
    kill_at: Optional[float] = None
    hang_reason: Optional[str] = None
    stop_requested: bool = False
    cpu_percent: Optional[float] = None   # psutil, sampled once a second
    stopped_since: Optional[float] = None  # its process state has been "stopped" since
    idle_since: Optional[float] = None     # it has used (almost) no CPU since
    rss_bytes: Optional[int] = None
    last_failure: Optional[Failure] = None
    rejoin_s: Optional[float] = None  # --ft: from its last failure to taking part again
    pumps: list = field(default_factory=list)

    def begin_incarnation(self, tag: str, state: WorkerState, keep_steps: bool) -> None:
        """Forget everything about the previous process of this worker."""
        self.tag = tag
        self.state = state
        self.pid = None
        self.started = time.time()
        self.first_step_seen = False
        self.last_step_time = None
        self.last_activity = None
        self.finished_at = None
        self._activity_seen = None
        self.last_heartbeat = None
        self.steps_per_s = 0.0
        self.next_sync = -1
        self.kill_at = None
        self.hang_reason = None
        self.stop_requested = False
        self.cpu_percent = None
        self.stopped_since = None
        self.idle_since = None
        self.rss_bytes = None
        if not keep_steps:
            self.steps = 0

    def note_activity(self, activity: int, now: float) -> None:
        """The progress report's activity count (ftrun.wire.ProgressReport): a change is progress."""
        if activity != self._activity_seen:
            self._activity_seen = activity
            self.last_activity = now

    def note_process(self, stopped: bool, idle: bool, now: float) -> None:
        """One sample of the process (once a second): stopped, idle, or neither."""
        self.stopped_since = (self.stopped_since or now) if stopped else None
        self.idle_since = (self.idle_since or now) if idle else None

    def stopped_for(self, now: float) -> float:
        return now - self.stopped_since if self.stopped_since is not None else 0.0

    def idle_for(self, now: float) -> float:
        return now - self.idle_since if self.idle_since is not None else 0.0

    def since_progress(self, now: float) -> float:
        """Seconds since the last optimizer step or other progress (forward pass, save, load)."""
        return now - max(self.last_step_time or 0.0, self.last_activity or 0.0)

    @property
    def rank(self) -> int:
        return self.spec.rank

    @property
    def alive(self) -> bool:
        return self.state in (WorkerState.STARTING, WorkerState.RUNNING, WorkerState.HUNG, WorkerState.RECOVERING)
