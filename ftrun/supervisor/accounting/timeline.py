"""A run's timeline, as `ftrun report` draws it: steps over time, checkpoints, and its file.

The supervisor samples the run's step count about once a second and notes each
checkpoint; the lanes and failures come from the goodput accountant. Everything is
kept bounded for runs of weeks: the step series halves its resolution whenever it
fills. The timeline is written beside the run's state (timeline.json, 0600,
replaced atomically) every few seconds and at the end.
Must never import torch, and never write outside the run's folder.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

MAX_POINTS = 2000
MAX_CHECKPOINTS = 1000
SAMPLE_S = 1.0
TIMELINE_FILE = "timeline.json"
FORMAT = 1


class StepSeries:
    """(time, steps) samples at least `every` seconds apart, at most MAX_POINTS of them:
    when full, every other sample goes and the spacing doubles."""

    def __init__(self, every: float = SAMPLE_S) -> None:
        self.every = every
        self.points: List[Tuple[float, int]] = []

    def sample(self, t: float, steps: int) -> None:
        if self.points and t - self.points[-1][0] < self.every:
            if steps != self.points[-1][1] and len(self.points) == 1:
                self.points.append((t, steps))  # the first step's moment is worth a sample of its own
            return
        self.points.append((t, steps))
        if len(self.points) >= MAX_POINTS:
            self.points = self.points[::2] + ([self.points[-1]] if len(self.points) % 2 == 0 else [])
            self.every *= 2


class Checkpoints:
    """The checkpoints the run published, once each (step, when, how long it wrote and paused)."""

    def __init__(self) -> None:
        self.items: List[Dict[str, Any]] = []

    def add(self, info: Dict[str, Any]) -> Optional[Dict[str, Any]]:
        """Note a published checkpoint; the entry when it is new, else None."""
        entry = {k: info.get(k) for k in ("step", "time", "write_s", "pause_s", "bytes")}
        if not all(isinstance(entry[k], (int, float)) and not isinstance(entry[k], bool) for k in ("step", "time")):
            return None
        if self.items and (self.items[-1]["step"], self.items[-1]["time"]) == (entry["step"], entry["time"]):
            return None
        if len(self.items) >= MAX_CHECKPOINTS:
            del self.items[0]
        self.items.append(entry)
        return entry


def write_timeline(folder: Path, data: Dict[str, Any]) -> None:
    """Replace FOLDER/timeline.json with `data` atomically (0600)."""
    path = folder / TIMELINE_FILE
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        blob = json.dumps({"format": FORMAT, **data}, separators=(",", ":")).encode()
        if os.write(fd, blob) != len(blob):
            raise OSError(28, "short write (disk full?)")
        os.close(fd)
        fd = -1
        os.replace(tmp, path)
    except OSError:
        if fd >= 0:
            os.close(fd)
        try:
            tmp.unlink()  # a full disk leaves no half-written file behind
        except OSError:
            pass
        raise


def read_timeline(folder: Path) -> Optional[Dict[str, Any]]:
    """The timeline in `folder`, or None when there is none; ValueError when it is damaged."""
    path = folder / TIMELINE_FILE
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ValueError(f"{path} cannot be read ({e.strerror or e})") from None
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("lanes"), list):
        raise ValueError(f"{path} is not a run's timeline")
    problem = _damage(data)
    if problem:
        raise ValueError(f"{path} is damaged: {problem}")
    return data


def _num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x and abs(x) != float("inf")


def _damage(data: Dict[str, Any]) -> Optional[str]:
    """What in a timeline the report could not draw, or None."""
    if not _num(data.get("started")):
        return "'started' is not a time"
    for i, lane in enumerate(data["lanes"]):
        if not isinstance(lane, dict) or not isinstance(lane.get("replica"), int) \
                or not isinstance(lane.get("ranks"), list) or not isinstance(lane.get("segments"), list):
            return f"lanes[{i}] is not a lane"
        for seg in lane["segments"]:
            if not (isinstance(seg, list) and len(seg) == 3 and _num(seg[0]) and _num(seg[1])
                    and isinstance(seg[2], str)):
                return f"lanes[{i}] holds a segment that is not [start, end, state]"
    for key, shape in (("steps", lambda p: isinstance(p, list) and len(p) == 2 and _num(p[0]) and _num(p[1])),
                       ("failures", lambda f: isinstance(f, dict) and _num(f.get("time"))),
                       ("checkpoints", lambda c: isinstance(c, dict) and _num(c.get("time")))):
        items = data.get(key, [])
        if not isinstance(items, list) or not all(shape(x) for x in items):
            return f"'{key}' holds an entry that is not one"
    return None
