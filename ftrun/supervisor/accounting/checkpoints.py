"""The supervisor's side of --checkpoint-dir: what `ftrun status` and the run's last lines say
of its checkpoints, and the save that a stop signal asks for before the workers stop.

The workers write and read the checkpoints (ftrun.worker.ft.checkpoint.schedule) and leave a few words in
the store: the newest good one (keys.CHECKPOINT, with the count of failed saves when it was
published), the last failed save (keys.CHECKPOINT_FAILURE) and, after a stop signal, how the
save before stopping went (keys.STOP_SAVE). This module turns them into the status record,
lines and decisions.
Must never import torch, never touch the checkpoint folder (its lock is
ftrun.supervisor.loop.folder_lock), and never do more than one read of the store per call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from ftrun.keys import CHECKPOINT, CHECKPOINT_FAILURE, STOP_SAVE


def _json_dict(raw: Any) -> Dict[str, Any]:
    try:
        value = json.loads(raw) if raw else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class CheckpointWatch:
    """The run's checkpoints as the store says: the newest good one and the saves failed since."""

    def __init__(self) -> None:
        self._seen: Tuple[Any, Any] = (None, None)

    def poll(self, store: Any) -> Optional[Dict[str, Any]]:
        """The status record when the words in the store changed, else None. `store` is the
        supervisor's RunStore."""
        s = store.store
        raw = store.multi_get([CHECKPOINT])[0] if s.check([CHECKPOINT]) else None
        failed = store.multi_get([CHECKPOINT_FAILURE])[0] if s.check([CHECKPOINT_FAILURE]) else None
        if (raw, failed) == self._seen:
            return None
        self._seen = (raw, failed)
        return record(_json_dict(raw), _json_dict(failed))


def record(good: Dict[str, Any], bad: Dict[str, Any]) -> Dict[str, Any]:
    """`ftrun status`'s checkpoint: the newest good one, the failed saves in all and since it."""
    ck: Dict[str, Any] = {k: good.get(k) for k in ("step", "path", "bytes", "write_s", "pause_s", "time")}
    before = int(good.get("failed") or 0)
    total = max(before, int(bad.get("failed") or 0))
    ck["failed_total"] = total
    ck["failed_since"] = total - before
    if bad and (not good or bad.get("time", 0) > good.get("time", 0)):
        ck["last_failure"] = {k: bad.get(k) for k in ("step", "why", "final", "time")}
    return ck


def last_lines(ck: Optional[Dict[str, Any]]) -> List[Tuple[str, str]]:
    """(line, style) for the end of a run where saves failed: the last step's save that could
    not be written, how many failed, and the newest good checkpoint."""
    if not ck or not ck.get("failed_total"):
        return []
    n = ck["failed_total"]
    good = (f"the newest good checkpoint is step {ck['step']} ({ck['path']})" if ck.get("step") is not None
            else "no checkpoint was written")
    last = ck.get("last_failure") or {}
    lines = []
    if last.get("final"):
        lines.append((f"the checkpoint of the last step ({last.get('step')}) could not be written: "
                      f"{last.get('why')}; {good}. The training itself ended normally", "bold red"))
    lines.append((f"{n} checkpoint save{'s' if n != 1 else ''} failed in this run; {good}", "bold yellow"))
    return lines


@dataclass
class SaveBeforeStop:
    """A stop signal under --ft with --checkpoint-dir: the replicas stop at one round boundary
    and one of them saves the last committed step (QuorumKeeper.stop); the workers are
    signalled once it says how that went, or at the deadline (--shutdown-timeout after the
    signal), or once no worker is left to write."""

    sig: int
    started: float
    deadline: float

    def outcome(self, store: Any, now: float, workers_alive: bool) -> Optional[Tuple[str, str]]:
        """None while the save may still come; else the (line, style) to stop the workers with."""
        word = _json_dict(store.multi_get([STOP_SAVE])[0]) if store.store.check([STOP_SAVE]) else None
        return stop_outcome(word, now, self.started, self.deadline, workers_alive)


def stop_outcome(word: Optional[Dict[str, Any]], now: float, started: float, deadline: float,
                 workers_alive: bool) -> Optional[Tuple[str, str]]:
    """The stop-save's outcome from the writer's word (keys.STOP_SAVE, None while unsaid): None
    while the save may still come (no word, before the deadline, a worker left to write it);
    else the (line, style) to stop the workers with. The supervisor and the simulator both
    wait on it."""
    if word is None and now < deadline and workers_alive:
        return None
    took = now - started
    if word and word.get("nothing"):  # the keeper's word: the loop had ended (ft/keeper/core.py stop_quorum)
        return f"no checkpoint before stopping: {word.get('why')}; stopping all workers", "bold yellow"
    if word and word.get("ok"):
        return (f"checkpoint of step {word.get('step')} written to {word.get('path')} in {took:.1f} s; stopping "
                f"all workers", "bold yellow")
    if word:
        return (f"the checkpoint of step {word.get('step')} failed before stopping: {word.get('why')}; stopping "
                f"all workers", "bold red")
    if now >= deadline:
        return (f"no checkpoint was written within --shutdown-timeout ({deadline - started:g} s; give "
                f"the save more time with a longer one); stopping all workers", "bold red")
    return ("no worker is left to write the checkpoint before stopping; stopping", "bold red")
