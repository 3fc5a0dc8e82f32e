"""The simulator's checkpointer: what the member's driver and its stop paths (member/driver.py,
member/stop.py) ask of ftrun's Checkpointer (ft/checkpoint/schedule.py), over one in-memory folder
the run shares. A save writes a step's marker (the saving worker's lineage, step and digest, and
the rounds it had stepped on whose decision it had not read) under the step's partial name, and
one rename publishes it once the write is done; a worker killed meanwhile leaves the partial
folder. A resume loads the first folder the product's rule lists (ft/checkpoint/names.py's
resume_order: published folders only, newest first). It decides nothing: when a save is due and
who writes are the driver's (member/core.py's save_is_due, the quorum's first replica, a stop
quorum's writer), which folder a resume takes is names.resume_order's; a simulated folder is never
damaged, so the fall-back to an older one is not exercised.
Must never be imported by the product.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from ftrun.worker.ft.checkpoint import names

WRITE_S = (0.005, 0.08)  # a save's write, from its start to its publication (virtual)
# (lineage, step, digest, ((quorum, round), steps taken) of the rounds stepped on undecided)
Marker = Tuple[int, int, str, Tuple[Tuple[Tuple[int, int], int], ...]]


@dataclass(frozen=True)
class SimSettings:
    every: int
    root: Path = Path("checkpoints")
    keep: int = 0


@dataclass(frozen=True)
class SimResumed:
    step: int


class NeverMismatch(Exception):
    """A simulated checkpoint always fits the run."""


class SimCheckpointer:
    """One per simulated worker, as ftrun's is one per worker."""

    mismatch = NeverMismatch

    def __init__(self, worker: Any, folder: Dict[str, Marker], every: int) -> None:  # worker: sim/worker.SimWorker
        self.w = worker
        self.folder = folder
        self.settings = SimSettings(every)
        self.result: Optional[Tuple[int, bool]] = None
        self.attempts = 0
        self.last_failure: Optional[str] = None
        self.saves = 0
        self._writing: Any = None  # the save in flight's signal: set once it is published

    def save(self, state: Any, step: int, kind: str = "periodic") -> None:
        self.wait()
        if self.result == (step, True):
            return  # this step is saved already
        w = self.w
        marker: Marker = (w.lineage, step, w.digest, tuple(sorted(w.stepped.items())))
        partial = names.partial_name(step, f"r{w.rank}")
        self.folder[partial] = marker
        self.attempts = self.attempts + 1 if self.result is not None and self.result[0] == step else 1
        self.saves += 1
        done = self._writing = w.signal()
        sched = w.sched

        def write() -> None:  # the writer thread: killed with its process, it leaves the partial folder
            sched.sleep(WRITE_S[0] + (WRITE_S[1] - WRITE_S[0]) * sched.rng.random())
            self.folder[names.step_name(step)] = self.folder.pop(partial)
            self.result = (step, True)
            w.w.log.append(f"{sched.now:.3f}s rank {w.rank} published checkpoint step {step} ({kind})")
            done.set()

        sched.spawn(write, "ftrun-checkpoint", w.proc)

    def staged(self) -> None:
        """Nothing to copy: the marker was taken at the save."""

    def wait(self) -> None:
        if self._writing is not None:
            self._writing.wait()
            self._writing = None

    def resume(self, state: Any, total: Optional[int] = None) -> Optional[SimResumed]:
        for step, name in names.resume_order(list(self.folder)):
            self.w.loaded(self.folder[name])
            return SimResumed(step)
        return None
