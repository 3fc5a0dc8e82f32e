"""The supervisor's live state of a run, and where it is kept on disk.

Each run has a private folder (0700) under the user's runtime dir; its
`state.json` (0600) is rewritten atomically by the supervisor whenever
something changes. `ftrun status` only reads these files.
This module must never import torch, and never write outside the runs folder.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
import tempfile
import time
import typing
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple


class RunPhase(str, enum.Enum):
    RUNNING = "running"
    ENDED = "ended"


@dataclass
class ReplicaStatus:
    rank: int
    local_rank: int
    pid: Optional[int] = None
    state: str = "starting"  # a WorkerState value (ftrun.supervisor.workers.worker)
    restarts: int = 0
    step: int = 0                       # optimizer steps taken (or global step with --ft)
    steps_per_s: float = 0.0
    last_heartbeat: Optional[float] = None  # wall time of the last heartbeat
    last_step_time: Optional[float] = None
    cpu_percent: Optional[float] = None
    rss_bytes: Optional[int] = None
    last_failure: Optional[str] = None
    node_rank: int = 0
    # --ft only
    in_quorum: Optional[bool] = None
    spare: Optional[bool] = None        # --spares: held back as a hot spare, waiting to take a replica's place
    healing: Optional[bool] = None
    last_heal_s: Optional[float] = None
    ft_phase: Optional[str] = None      # join, group, heal, send, compute, vote, commit, discard, done
    next_sync: Optional[int] = None     # --hook diloco or localsgd: the step of its next sync


@dataclass
class RunStatus:
    run_id: str
    script: str
    argv: List[str]
    started: float
    pid: int                     # the supervisor's pid
    hook: Optional[str]
    policy: str                  # "group restart" or "replica (ft)"
    max_restarts: int
    nproc: int
    nnodes: int = 1
    node_rank: int = 0
    phase: str = RunPhase.RUNNING.value
    group_restarts: int = 0
    exit_code: Optional[int] = None
    exit_summary: Optional[str] = None
    ended: Optional[float] = None
    log_dir: Optional[str] = None
    replicas: List[ReplicaStatus] = field(default_factory=list)
    # --ft only
    quorum_id: Optional[int] = None
    quorum_size: Optional[int] = None
    spares: Optional[int] = None        # --spares: replicas held back as hot spares now
    steps_committed: Optional[int] = None
    steps_discarded: Optional[int] = None
    # --checkpoint-dir: the newest good checkpoint written (or resumed from): step, path, bytes,
    # write_s, pause_s, time (wall clock when it was published); and the saves that failed:
    # failed_total, failed_since (since that one), last_failure {step, why, final, time}
    checkpoint: Optional[Dict[str, Any]] = None
    # Goodput (ftrun.supervisor.accounting.goodput): the share of this node's replica-time spent on committed
    # steps, the rest in replica-seconds by cause, and each failure (time, rank, replica, cause,
    # kind, detect_s, back_s, lost_s, lost_steps, node_rank)
    goodput: Optional[float] = None
    lost_s: Optional[Dict[str, float]] = None
    replica_s: Optional[float] = None
    spare_s: Optional[float] = None     # --spares: replica-seconds spent waiting as hot spares (not in replica_s)
    steps_lost: Optional[int] = None
    failures: List[Dict[str, Any]] = field(default_factory=list)
    metrics_url: Optional[str] = None    # --metrics-port: where the Prometheus text is served
    # What ftrun could not write while the run went on (a full disk): per kind (logs, state),
    # folder, why, failed (writes), bytes_lost (logs: the workers' output not in the files), since
    not_written: Optional[Dict[str, Any]] = None
    updated: float = field(default_factory=time.time)

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> "RunStatus":
        """A RunStatus from a state file's JSON; ValueError naming the first field that is not what it should be.

        Fields this version does not know (a newer supervisor) are dropped, not fatal."""
        if not isinstance(d, dict):
            raise ValueError(f"holds {type(d).__name__}, not a run's state")
        reps = d.get("replicas", [])
        if not isinstance(reps, list):
            raise ValueError(f"'replicas' is {_shown(reps)}, not a list")
        replicas = []
        for i, r in enumerate(reps):
            if not isinstance(r, dict):
                raise ValueError(f"replicas[{i}] is {_shown(r)}, not a mapping")
            replicas.append(ReplicaStatus(**_checked(ReplicaStatus, r, f"replicas[{i}].")))
        fields = _checked(cls, {k: v for k, v in d.items() if k != "replicas"}, "")
        return cls(replicas=replicas, **fields)


# What each field of the state file means: `ftrun status --json` prints every one of them, and
# the docs' reference is generated from these (a test checks that every field is here).
RUN_FIELDS: Dict[str, str] = {
    "run_id": "ftrun's name of the run (--run-id, or generated).",
    "script": "The script (or module with -m, executable with --no-python).",
    "argv": "ftrun's own command line, as typed.",
    "started": "When the supervisor started (Unix seconds).",
    "pid": "The supervisor's pid.",
    "hook": "The --hook and its parameters as one line, or null.",
    "policy": "'group restart', or 'replica restart (ft)' under --ft.",
    "max_restarts": "The restart budget: per group, or per replica under --ft.",
    "nproc": "Workers on this node.",
    "nnodes": "Nodes in the run.",
    "node_rank": "This node's rank.",
    "phase": "running or ended (ended too when the supervisor is gone; recorded_phase keeps the file's).",
    "group_restarts": "Group restarts so far (without --ft).",
    "exit_code": "ftrun's exit status once the run ended, else null.",
    "exit_summary": "One line saying why the run ended (the first failure), or null.",
    "ended": "When the run ended (Unix seconds), or null.",
    "log_dir": "The folder of the per-rank logs.",
    "replicas": "One object per worker of this node (the whole run's on several nodes), fields below.",
    "quorum_id": "--ft: the current quorum's id.",
    "quorum_size": "--ft: replicas in the current quorum.",
    "spares": "--ft --spares: replicas held back as hot spares now (not in the quorum, not training).",
    "steps_committed": "--ft: the run's global step (exact once the run ended).",
    "steps_discarded": "--ft: rounds voted down (a step a failure interrupted).",
    "checkpoint": "--checkpoint-dir: the newest good checkpoint written or resumed from: step, path, bytes, "
                  "write_s, pause_s, time (and age_s, added by ftrun status); the saves that failed: failed_total, "
                  "failed_since (since that one), last_failure (step, why, final: the loop's last step, time).",
    "goodput": "The share of this node's replica-time so far spent on committed steps (0..1; docs: Goodput, "
               "report and metrics).",
    "lost_s": "Replica-seconds not spent on committed steps, by cause: startup, failures, hangs, checkpoints, "
              "waiting, end.",
    "replica_s": "This node's replica-time so far: its replicas times the seconds since ftrun started, less "
                 "spare_s.",
    "spare_s": "--ft --spares: replica-seconds this node's replicas spent as hot spares (their start-up or "
               "restart until held back, and the wait), apart from replica_s and goodput.",
    "steps_lost": "Steps discarded or redone (--ft: discarded rounds; without --ft: the steps since the script's "
                  "own last save, at each group restart).",
    "failures": "Each failure (the newest 100): time, rank, replica, node_rank, cause, kind (exit, signal, hang, "
                "remote), detect_s, back_s (null while away), lost_s, lost_steps.",
    "metrics_url": "--metrics-port: where the Prometheus text is served, or null.",
    "not_written": "What ftrun could not write while the run went on (a full disk), or null: per kind (logs, "
                   "state), folder, why, failed (writes that failed), bytes_lost (logs: worker output missing from "
                   "the files; the console had it), since (Unix seconds).",
    "updated": "When the supervisor last wrote the file (Unix seconds).",
}
REPLICA_FIELDS: Dict[str, str] = {
    "rank": "Global rank.",
    "local_rank": "Rank on its node.",
    "pid": "The worker's pid (null before it started).",
    "state": "starting, running, stalled, hung, restarting, recovering, failed, done, stopped or lost.",
    "restarts": "How many times this worker was restarted.",
    "step": "Optimizer steps taken (the global step under --ft).",
    "steps_per_s": "Recent optimizer steps per second.",
    "last_heartbeat": "When its last heartbeat arrived (Unix seconds), or null.",
    "last_step_time": "When it last took an optimizer step (Unix seconds), or null.",
    "cpu_percent": "CPU use of the worker's process, % of one core.",
    "rss_bytes": "Resident memory of the worker's process.",
    "last_failure": "Why it last failed (exit status or signal, and the exception), or null.",
    "node_rank": "The node it runs on.",
    "in_quorum": "--ft: whether it takes part in the current quorum.",
    "spare": "--ft --spares: whether it is a hot spare (model built, waiting to take a failed replica's place).",
    "healing": "--ft: whether it is receiving the state from a peer.",
    "last_heal_s": "--ft: seconds its last heal took (receiving the state from a peer).",
    "ft_phase": "--ft: where it is in the round: join, group, heal, send, compute, vote, commit, discard, done.",
    "next_sync": "--hook diloco or localsgd: the step at which its next sync happens (diloco: its next fragment's), "
                 "as its own optimizer steps count, or null.",
}


def _shown(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, float) or math.isfinite(value) else str(value)
    return text if len(text) <= 30 else text[:27] + "..."


def _fits(value: Any, hint: Any) -> bool:
    """Does a JSON value fit a field's type hint (Optional, int, float, str, bool, List[str], Dict)?"""
    if hint is Any:
        return True
    origin = typing.get_origin(hint)
    if origin is typing.Union:
        return any(_fits(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        # JSON has one number type; NaN and infinity would make every age and rate meaningless.
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if hint is str:
        return isinstance(value, str)
    if origin is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, list) and all(_fits(v, item) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    return True


def _checked(cls: Any, d: Dict[str, Any], prefix: str) -> Dict[str, Any]:
    hints = typing.get_type_hints(cls)
    out: Dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name not in d:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ValueError(f"'{prefix}{f.name}' is missing")
            continue
        if f.name != "replicas" and not _fits(d[f.name], hints[f.name]):
            raise ValueError(f"'{prefix}{f.name}' is {_shown(d[f.name])}, which is not a valid {f.name}")
        out[f.name] = d[f.name]
    return out


def runs_root() -> Path:
    """The user's private folder of runs: $XDG_RUNTIME_DIR/ftrun or /tmp/ftrun-UID."""
    override = os.environ.get("FTRUN_HOME")
    if override:
        return Path(override)
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg) and os.access(xdg, os.W_OK):
        return Path(xdg) / "ftrun"
    return Path(tempfile.gettempdir()) / f"ftrun-{os.getuid()}"


def private_dir(path: Path) -> Path:
    """Create `path` (and parents) as 0700 and make sure it is ours and private."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = path.stat()
    if st.st_uid != os.getuid():
        raise PermissionError(f"{path} belongs to another user; set FTRUN_HOME to a folder of your own")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def run_dir(run_id: str) -> Path:
    private_dir(runs_root())
    return private_dir(runs_root() / run_id)


def write_state(path: Path, status: RunStatus) -> None:
    """Atomically replace `path` with the JSON of `status`, mode 0600."""
    status.updated = time.time()
    data = json.dumps(status.to_dict(), separators=(",", ":"))
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        try:
            os.fchmod(fd, 0o600)  # O_CREAT's mode does not apply to a leftover tmp file of a recycled pid
            blob = data.encode()
            if os.write(fd, blob) != len(blob):
                raise OSError(28, "short write (disk full?)")
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError:
        try:
            tmp.unlink()  # a full disk leaves no half-written file behind
        except OSError:
            pass
        raise


def run_folder_name(run_id: str, nnodes: int, node_rank: int) -> str:
    """A run's folder name on this machine: per node, so two nodes on one machine keep apart."""
    return run_id if nnodes == 1 else f"{run_id}.node{node_rank}"


def live_supervisor(path: Path) -> Optional[int]:
    """The pid of the live supervisor that writes state file `path`, or None (no file, ended, gone, unreadable)."""
    import psutil

    try:
        status = RunStatus.from_dict(json.loads(path.read_bytes()))
    except (OSError, ValueError, TypeError):
        return None
    if status.phase == RunPhase.ENDED.value or status.pid <= 0:
        return None
    try:
        proc = psutil.Process(status.pid)
        # A process younger than the run is a recycled pid, not its supervisor (2 s: coarse clocks).
        return status.pid if proc.create_time() <= status.started + 2.0 else None
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def read_states() -> List[RunStatus]:
    """Every run of this user on this machine that still has a readable state file."""
    return [status for _, status in read_state_files()]


def read_state_files() -> List[Tuple[Path, RunStatus]]:
    """(state file, status) of every run with a readable state file, by start time."""
    return scan_state_files()[0]


def scan_state_files() -> Tuple[List[Tuple[Path, RunStatus]], List[Tuple[Path, str]]]:
    """([(state file, status)] by start time, [(state file, why it cannot be read)]) of this user's runs here.

    Files are replaced atomically, so one that does not parse is damaged, not half-written: it is
    reported, never skipped in silence and never allowed to break the view."""
    root = runs_root()
    good: List[Tuple[Path, RunStatus]] = []
    bad: List[Tuple[Path, str]] = []
    if not root.is_dir():
        return good, bad
    uid = os.getuid()
    for p in sorted(root.glob("*/state.json")):
        try:
            with open(p, "rb") as f:
                # Only files of our own: a state file planted by someone else is not one of our runs.
                if os.fstat(f.fileno()).st_uid != uid:
                    continue
                raw = f.read()
        except IsADirectoryError:
            bad.append((p, "is a folder, not a file"))
            continue
        except OSError as e:
            bad.append((p, f"cannot be read ({e.strerror or e})"))
            continue
        try:
            good.append((p, RunStatus.from_dict(json.loads(raw))))
        except UnicodeDecodeError:
            bad.append((p, "is not text"))
        except json.JSONDecodeError as e:
            bad.append((p, f"is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})"))
        except (ValueError, TypeError) as e:
            bad.append((p, str(e)))
    good.sort(key=lambda ps: (ps[1].started, ps[1].run_id))
    return good, bad
