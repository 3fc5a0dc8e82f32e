"""The supervisor's live state of a run, and where it is kept on disk.

Each run has a private folder (0700) under the user's runtime dir; its
`state.json` (0600) is rewritten atomically by the supervisor whenever
something changes. `ftrun status` only reads these files.
This module must never import torch, and never write outside the runs folder.
"""

from __future__ import annotations

import enum
import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple


class WorkerState(str, enum.Enum):
    STARTING = "starting"      # spawned, no heartbeat yet
    RUNNING = "running"        # heartbeating
    HUNG = "hung"              # no optimizer step for --step-timeout: being killed
    RESTARTING = "restarting"  # died, a new incarnation is about to start
    RECOVERING = "recovering"  # with --ft: restarted and receiving state from a peer
    FAILED = "failed"          # died and will not be restarted
    DONE = "done"              # exited 0
    STOPPED = "stopped"        # stopped by ftrun (shutdown, group restart)


class RunPhase(str, enum.Enum):
    RUNNING = "running"
    STOPPING = "stopping"
    ENDED = "ended"


@dataclass
class ReplicaStatus:
    rank: int
    local_rank: int
    pid: Optional[int] = None
    state: str = WorkerState.STARTING.value
    restarts: int = 0
    step: int = 0                       # optimizer steps taken (or global step with --ft)
    steps_per_s: float = 0.0
    last_heartbeat: Optional[float] = None  # wall time of the last heartbeat
    last_step_time: Optional[float] = None
    cpu_percent: Optional[float] = None
    rss_bytes: Optional[int] = None
    gpu_mem_bytes: Optional[int] = None
    last_failure: Optional[str] = None
    node_rank: int = 0
    # --ft only
    in_quorum: Optional[bool] = None
    healing: Optional[bool] = None
    last_heal_s: Optional[float] = None
    ft_phase: Optional[str] = None      # join, group, heal, send, compute, vote, commit, discard, done
    hook_info: Optional[Dict[str, Any]] = None


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
    steps_committed: Optional[int] = None
    steps_discarded: Optional[int] = None
    updated: float = field(default_factory=time.time)

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "RunStatus":
        d = dict(d)
        # Fields this version does not know (a newer supervisor) are dropped, not fatal.
        rknown = set(ReplicaStatus.__dataclass_fields__)
        reps = [ReplicaStatus(**{k: v for k, v in r.items() if k in rknown}) for r in d.pop("replicas", [])]
        known = {f for f in cls.__dataclass_fields__}
        return cls(replicas=reps, **{k: v for k, v in d.items() if k in known})


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
        os.fchmod(fd, 0o600)  # O_CREAT's mode does not apply to a leftover tmp file of a recycled pid
        os.write(fd, data.encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


def read_states() -> List[RunStatus]:
    """Every run of this user on this machine that still has a state file."""
    return [status for _, status in read_state_files()]


def read_state_files() -> List[Tuple[Path, RunStatus]]:
    """(state file, status) of every run of this user on this machine, by start time."""
    root = runs_root()
    out: List[Tuple[Path, RunStatus]] = []
    if not root.is_dir():
        return out
    uid = os.getuid()
    for p in root.glob("*/state.json"):
        try:
            with open(p, "rb") as f:
                # Only files of our own: a state file planted by someone else is not one of our runs.
                if os.fstat(f.fileno()).st_uid != uid:
                    continue
                out.append((p, RunStatus.from_dict(json.loads(f.read()))))
        except (OSError, ValueError, TypeError, KeyError):
            continue  # being replaced or from another version: skip rather than fail
    out.sort(key=lambda ps: (ps[1].started, ps[1].run_id))
    return out
