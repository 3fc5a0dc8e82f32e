"""Durable replica state for --ft: the save schedule, and the resume when no replica holds state.

Saving. Every N committed steps the replica at index 0 of the quorum writes
the state a heal would send (registered models, optimizers and extra state)
with torch.distributed.checkpoint (DCP), and the global step with it:
- asynchronous: the state is copied into host memory (staging buffers kept
  from one save to the next: one extra copy of this worker's state, never
  more) by a background thread while the round's forward and backward run,
  which never change parameters or optimizer state; the loop waits for the
  copy only before the round's optimizer step (`staged()`), if it is not
  done by then. What may change earlier is copied at once
  (ft/checkpoint/state.py). Then ftrun's writer thread writes the copy
  (ft/checkpoint/writer.py). A save first waits for the previous one if it
  is still writing.
- atomic and pruned: ft/checkpoint/folder.py (a partial folder, published by
  one rename once complete; the newest `keep` good ones kept, damaged ones
  moved aside).
- never fatal: a save that fails is one line, counted in the store for
  `ftrun status` (ft/checkpoint/status.py); training goes on, and the next
  save tries again.
- sharded replicas (FSDP2): each worker writes its own shard, in parallel, as
  DTensors whose global layout DCP records, so a checkpoint loads at another
  replica count and, where DCP can reshard, another --replica-size. The
  replica's workers coordinate the write over a gloo group of their own, made
  for it (DCP's collectives run in the writer thread, never on the group the
  training uses).

Loading (the source of a fresh quorum, before it sends its state): the newest
checkpoint that is whole and whose checksums hold (ft/checkpoint/read.py) is
read into the replica's own tensors in place; a damaged one is moved aside
with one line, and any other failure to load one falls back to the previous
one, with one line. One whose tensors or optimizer classes do not fit this run
raises CheckpointMismatch. Loading never communicates: each worker reads its
own shard, so the workers of a replica cannot wait on each other here.

Must never communicate across replicas, never import the supervisor, never
put anything but a few words in the store, and never load a partial folder.
"""

from __future__ import annotations

import shutil
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

from ftrun.worker.ft.checkpoint import read as disk
from ftrun.worker.ft.checkpoint.folder import Folder
from ftrun.worker.ft.checkpoint.read import Damaged, complete_checkpoints, one_line
from ftrun.worker.ft.checkpoint.state import StateDicts, new_stager, stager_reusable
from ftrun.worker.ft.checkpoint.status import StoreStatus
from ftrun.worker.ft.checkpoint.writer import SAVE_ERRORS, Job, Writer, inner_error
from ftrun.worker.settings import CheckpointSettings as Settings
from ftrun.worker.settings import current

__all__ = ["SAVE_ERRORS", "Checkpointer", "CheckpointMismatch", "Resumed", "Settings"]


warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled, unavailable or uninitialized")


class CheckpointMismatch(RuntimeError):
    """The checkpoint holds another model or optimizer than this run's: no retry helps."""


@dataclass
class Resumed:
    step: int
    path: Path
    info: Dict[str, Any]


class Checkpointer:
    """One per worker; saves only when the manager says this replica writes."""

    mismatch = CheckpointMismatch  # what resume() raises for a checkpoint of another run (member/stop.py)

    def __init__(self, settings: Settings, rank: int, shard: int, k: int, log: Callable[[str], None],
                 detail: Optional[Callable[[str], None]] = None) -> None:
        worker = current()
        self.settings = settings
        self.rank, self.shard, self.k = rank, shard, k
        self._log = log
        self._stager: Any = None
        # Whether one stager may stage every save (stager_reusable; None: not known yet).
        self._reuse: Optional[bool] = False if worker.checkpoint_fresh_stager else None
        self._staging: Optional[Future] = None  # the copy into host memory of the save in flight
        self._job: Optional[Job] = None          # the save in flight
        self._dicts = StateDicts()
        self._verify_mode = worker.checkpoint_verify
        self._run_id = worker.run_id
        self._folder = Folder(settings.root, settings.keep, self._verify_mode != "0", rank, log)
        self._status = StoreStatus()
        self._writer = Writer(self._folder, self._status, rank, shard, k, log, detail or log)
        self.saves = 0
        import torch.distributed.checkpoint  # noqa: F401 - now, not inside the first save's pause

    @classmethod
    def from_env(cls, rank: int, shard: int, k: int, log: Callable[[str], None],
                 detail: Optional[Callable[[str], None]] = None) -> Optional["Checkpointer"]:
        """`log`: lines a person must see (a save not written); `detail`: the log file's (a save written)."""
        settings = current().checkpoint
        return cls(settings, rank, shard, k, log, detail) if settings else None

    @property
    def result(self) -> Optional[Tuple[int, bool]]:
        """(step, written) of the last save, as every worker of the writing replica knows it."""
        return self._writer.result

    @property
    def last_failure(self) -> Optional[str]:
        return self._writer.last_failure

    @property
    def attempts(self) -> int:
        """How often the step of the last save has been tried (0: no save yet)."""
        return self._job.attempt if self._job is not None else 0

    # ------------------------------------------------------------ saving
    def save(self, state: Any, step: int, kind: str = "periodic") -> None:
        """Start staging this worker's state and hand the write to the writer thread. Every
        worker of the writing replica calls this at the same round boundary (a sharded
        replica's workers coordinate DCP's write). A failure is one line; training goes on."""
        t0 = time.monotonic()
        prev = self._job if self._job is not None and self._job.step == step else None
        if prev is not None and kind == "final":
            prev.kind = "final"  # a loop of ft.DataLoader learns that a round top's save was its last only after it
        self.wait()
        if not state.models and not state.optimizers:
            return
        if prev is not None and self.result == (step, True):
            return  # this step is saved already
        job = Job(step, self._folder.partial(step, self._run_id), time.time(), kind,
                  optimizers=disk.optimizer_names(state.optimizers),
                  verify=self._folder.verify and (self._verify_mode != "alternate"
                                                  or (step // self.settings.every) % 2 == 1))
        try:
            self._writer.make_group()
            if self.shard == 0:
                # Left over by this run (or a run of its id) killed while writing this step.
                # The replica's other workers write nothing before the workers agreed to write
                # (the writer's first collective), which the first one does after this.
                shutil.rmtree(job.partial, ignore_errors=True)
                job.partial.mkdir(parents=True, exist_ok=True)
            if self._stager is not None and not self._reuse:
                self._stager.close()  # the previous save is written (wait(), above)
                self._stager = None
            if self._stager is None:
                if self._reuse is None:
                    self._reuse = stager_reusable(new_stager())
                self._stager = new_stager()
            sd = self._dicts.copy_what_may_change(self._dicts.state_dict(state), state)
            job.staging = self._stager.stage(sd)
        except SAVE_ERRORS as e:  # the writer says it (and, sharded, tells the replica's other workers)
            job.error = e
        if prev is not None:
            job.attempt = prev.attempt + 1  # the same save tried again
        self._staging = job.staging
        self._job = job
        job.pause = time.monotonic() - t0
        self.saves += 1
        self._writer.submit(job)

    def staged(self) -> None:
        """Before anything may change the state a save is copying (the round's optimizer step):
        wait for the copy, if it is still running."""
        self._writer.say_held()  # a failed save of the last round top: the loop went on
        staging, self._staging = self._staging, None
        if staging is None:
            return
        t0 = time.monotonic()
        try:
            staging.result()
        except SAVE_ERRORS:  # the writer reports it
            pass
        if self._job is not None:
            self._job.pause += time.monotonic() - t0

    def wait(self) -> None:
        """Until the previous save is written and published (or failed, and said so)."""
        self._writer.wait()
        self._writer.say_held()
        self._staging = None

    # ------------------------------------------------------------ loading
    def resume(self, state: Any, total: Optional[int] = None) -> Optional[Resumed]:
        """Load the newest checkpoint that is whole and undamaged into this worker's own tensors;
        None if there is none (the run starts from its first step). CheckpointMismatch if it
        holds another model or optimizer. `total`: the steps the loop asks for."""
        import torch.distributed.checkpoint as dcp

        root = self.settings.root
        say = self._log if self.shard == 0 else (lambda _m: None)
        found = complete_checkpoints(root)
        if not found:
            say(f"rank {self.rank}: no checkpoint in {root} yet: starting from the first step")
            return None
        target: Optional[Dict[str, Any]] = None
        touched = False
        passed = 0
        for step, path in found:
            verdict = disk.check(path, step, checksums=self._folder.verify)
            if isinstance(verdict, Damaged):
                passed += 1
                if self.shard == 0 and not verdict.io_error:
                    self._folder.move_aside(path, verdict.why)
                else:
                    say(f"rank {self.rank}: checkpoint {path} could not be checked ({verdict.why}); skipping it")
                continue
            info, metadata = verdict.info, verdict.metadata
            if target is None:
                target = self._dicts.load_target(state)
            disk.drop_states_not_saved(target, metadata)
            disk.drop_fields_added_since(target, metadata)
            # Another optimizer class first: its missing fields (betas, a step) would name a symptom, not it.
            misfit = disk.other_optimizer(info, state.optimizers) or disk.misfit(target, metadata, state.extras)
            if misfit:
                raise CheckpointMismatch(f"checkpoint {path} does not fit this run: {misfit}. Another model or "
                                         f"optimizer wrote it; give this run its own --checkpoint-dir")
            try:
                touched = True
                loaded = {k: v for k, v in target.items() if k != "extras"}
                loaded["extras"] = {n: sd for n, sd in target["extras"].items() if disk.has_extra(metadata, n)}
                dcp.load(loaded, storage_reader=disk.reader(str(path)), planner=disk.planner(), no_dist=True)
                self._dicts.apply(state, loaded)
            except SAVE_ERRORS as e:  # CheckpointException included: the previous one may load
                passed += 1
                say(f"rank {self.rank}: checkpoint {path} could not be read ({one_line(inner_error(e))}); trying the "
                    f"one before it")
                continue
            self._folder.remember(path)
            for name in state.extras:
                if name not in loaded["extras"]:
                    say(f"rank {self.rank}: registered state {name!r} is not in checkpoint {path}: it keeps "
                        f"its initial state")
            age = time.time() - float(info.get("time", time.time()))
            past = (f"; that is past the {total} steps the loop asks for (ft.steps({total})): nothing is left to "
                    f"train, the loop ends at once" if total is not None and step > total else "")
            say(f"rank {self.rank}: resumed from checkpoint {path} at step {step} (written {_age(age)} ago){past}")
            self._status.report({**info, "path": str(path)})
            return Resumed(step, path, info)
        if touched:
            # Some tensors may hold part of a checkpoint that failed to load: never train on that.
            raise RuntimeError(f"no checkpoint in {root} could be read, and a failed read left part of one in "
                               f"this replica's tensors")
        say(f"rank {self.rank}: none of the {passed} checkpoint(s) in {root} could be used (damaged or unreadable): "
            f"starting from the first step")
        return None


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{max(0.0, seconds):.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
