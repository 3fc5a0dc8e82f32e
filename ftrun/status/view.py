"""`ftrun status`: read the runs' state files and show them (--json, a table, --watch, --clean).

Reads only the files the supervisors write (ftrun.status.state); decides by
itself whether a supervisor is still alive (psutil), so a run whose supervisor was
killed shows as "ended (supervisor gone)" instead of running forever, and works
out ages, stalls and uptime. The table is drawn by ftrun.status.render, and the
command (--json, a table, --watch) is ftrun.status.command's.
Must never import torch (it runs next to training and must answer in well
under 0.3 s), never signal or touch a run's processes, and never write
anything except what --clean removes: ended runs' state files.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from ftrun.errors import ConfigError
from ftrun.status.state import RunPhase, RunStatus, read_state_files, runs_root, scan_state_files

STALE_AFTER_S = 5.0      # a live supervisor that has not written for this long is worth a warning
PID_REUSE_SLACK_S = 2.0  # process start times are coarse (the boot time is whole seconds)
# Workers beat every 0.25 s and the supervisor records a beat within ~0.5 s: a running rank
# whose beat is older than this is not progressing (stopped, swapped out, stuck in a syscall).
STALLED_AFTER_S = 3.0
UNREADABLE = "unreadable"

GONE = "ended (supervisor gone)"


# ---------------------------------------------------------------------------
# Is the supervisor still there?


def supervisor_alive(status: RunStatus) -> bool:
    """True while the run's supervisor process exists and is the one that started the run."""
    pid = status.pid
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False  # someone else's process now has that pid: ours is gone
    import psutil  # only when a run may be live: `ftrun status` with no run stays fast

    try:
        started = psutil.Process(pid).create_time()
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return True  # its start cannot be known: trust the pid
    # A process that started after the run did is a recycled pid, not the supervisor.
    return started <= status.started + PID_REUSE_SLACK_S


# ---------------------------------------------------------------------------
# The data shown (the --json output is exactly this)


# What `ftrun status` works out and adds to the state file's fields (ftrun.status.state.RUN_FIELDS)
# in its --json output; the docs' reference is generated from these.
DERIVED_RUN_FIELDS: Dict[str, str] = {
    "recorded_phase": "The phase as the state file says it.",
    "supervisor_gone": "true when the run's supervisor died without writing its end (its workers died with it).",
    "shown_phase": "The phase as shown: running, ended, or 'ended (supervisor gone)'.",
    "uptime_s": "Seconds from the start to now, or to the end.",
    "updated_age_s": "Seconds since the supervisor last wrote the file.",
    "state_file": "The state file read.",
    "problem": "Only for a state file that cannot be read (phase 'unreadable'): which field is wrong.",
}
DERIVED_REPLICA_FIELDS: Dict[str, str] = {
    "heartbeat_age_s": "Seconds since the last heartbeat, or null.",
    "recorded_state": "The state as the file says it (state reads stalled where the heartbeat is over 3 s late).",
}


def snapshot(path: Path, status: RunStatus, now: float) -> Dict[str, Any]:
    """The state file's data plus what the reader works out: liveness, ages, uptime."""
    d = status.to_dict()
    alive = status.phase == RunPhase.ENDED.value or supervisor_alive(status)
    gone = status.phase != RunPhase.ENDED.value and not alive
    d["recorded_phase"] = status.phase
    if gone:
        d["phase"] = RunPhase.ENDED.value
        d["exit_summary"] = status.exit_summary or f"supervisor (pid {status.pid}) is gone; its workers went with it"
    d["supervisor_gone"] = gone
    d["shown_phase"] = GONE if gone else status.phase
    end = status.ended if status.phase == RunPhase.ENDED.value and status.ended else (status.updated if gone else now)
    d["uptime_s"] = round(max(0.0, end - status.started), 3)
    d["updated_age_s"] = round(max(0.0, now - status.updated), 3)
    d["state_file"] = str(path)
    ck = d.get("checkpoint")
    if isinstance(ck, dict) and isinstance(ck.get("time"), (int, float)):
        ck["age_s"] = round(max(0.0, now - ck["time"]), 3)
    live = not gone and status.phase != RunPhase.ENDED.value
    for r in d["replicas"]:
        hb = r.get("last_heartbeat")
        r["heartbeat_age_s"] = round(max(0.0, now - hb), 3) if isinstance(hb, (int, float)) else None
        r["recorded_state"] = r["state"]
        last, rate = r.get("last_step_time"), r.get("steps_per_s")
        if live and isinstance(last, (int, float)) and isinstance(rate, (int, float)) and rate > 0:
            # The recorded rate is an average over the steps seen: a replica with no step for t
            # seconds (well past its usual gap, and past STALLED_AFTER_S: reports come in beats)
            # goes at most one step per t now, whatever it went before.
            gap = now - last
            if gap > max(STALLED_AFTER_S, 2.0 / rate):
                r["steps_per_s"] = round(min(rate, 1.0 / gap), 3)
        if live and r["state"] == "running" and r["heartbeat_age_s"] is not None \
                and r["heartbeat_age_s"] > STALLED_AFTER_S:
            r["state"] = "stalled"
    return d


def unreadable(path: Path, problem: str) -> Dict[str, Any]:
    """What is shown for a state file that cannot be read: its folder's name and why, no guesses."""
    return {"run_id": path.parent.name, "phase": UNREADABLE, "shown_phase": UNREADABLE, "state_file": str(path),
            "problem": f"state file {path} {problem}", "replicas": []}


def collect(run_id: Optional[str] = None) -> List[Dict[str, Any]]:
    """Snapshots of every run (or of `run_id`: exact, else a unique prefix). ConfigError if no such run."""
    now = time.time()
    files, bad = scan_state_files()
    if run_id is not None:
        known = [s.run_id for _, s in files] + [p.parent.name for p, _ in bad]
        exact = [(p, s) for p, s in files if s.run_id == run_id]
        prefixed = [(p, s) for p, s in files if s.run_id.startswith(run_id)]
        bad_exact = [(p, why) for p, why in bad if p.parent.name == run_id]
        bad_prefixed = [(p, why) for p, why in bad if p.parent.name.startswith(run_id)]
        if exact or bad_exact:
            files, bad = exact, bad_exact
        elif len(prefixed) + len(bad_prefixed) == 1:
            files, bad = prefixed, bad_prefixed
        else:
            raise ConfigError(no_such_run(run_id, known))
    return [snapshot(p, s, now) for p, s in files] + [unreadable(p, why) for p, why in bad]


def no_such_run(run_id: str, known: List[str]) -> str:
    """The one line for a RUN_ID no run here has (`ftrun status` and `ftrun report` alike)."""
    from ftrun.config import closest

    if not known:
        return f"no run {run_id!r} on this machine: no ftrun run has state here ({runs_root()})"
    hint = closest(run_id, known) or f"; runs here: {', '.join(known[:8])}{' ...' if len(known) > 8 else ''}"
    return f"no run {run_id!r} on this machine{hint}"


# ---------------------------------------------------------------------------
# --clean


def clean(run_id: Optional[str] = None) -> List[Tuple[str, Optional[str]]]:
    """Remove the state of ended runs; [(run_id, folder kept because it holds logs or None)].

    Logs are never removed: they are what explains a failed run. A run folder
    left empty is removed with its state.
    """
    removed: List[Tuple[str, Optional[str]]] = []
    now = time.time()
    for path, status in read_state_files():
        if run_id is not None and status.run_id != run_id:
            continue
        snap = snapshot(path, status, now)
        if snap["phase"] != RunPhase.ENDED.value:
            if run_id is not None:
                raise ConfigError(f"run {run_id!r} is still running (supervisor pid {status.pid}); stop it before --clean")
            continue
        folder = path.parent
        for leftover in [path] + list(folder.glob("state.json.*.tmp")):
            try:
                leftover.unlink()
            except FileNotFoundError:
                pass
        try:
            folder.rmdir()
            kept = None
        except OSError:
            kept = str(folder)  # not empty: logs (or other files) stay
        removed.append((status.run_id, kept))
    return removed
