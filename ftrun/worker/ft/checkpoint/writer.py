"""The checkpoint writer thread: DCP's write of each staged copy, its publication, and what a failure says.

The loop hands a `Job` (a save whose copy into host memory is under way) to
one long-lived thread (DCP's `async_save` starts a thread per save, which,
while the copy holds the GIL, cost the loop 10-25 ms). The thread runs at a
low CPU priority (nice 10), waits for the copy, and `dcp.save`s it into the
partial folder with fsync and torch's record CRCs (set per thread: this one
is the writer's own, whatever the script chose); the replica's first worker
then publishes it (ft/checkpoint/folder.py) and prunes.
- never fatal: a save that fails (a full disk, a quota, an I/O error: DCP
  raises them as CheckpointException, a BaseException) is one line, counted
  in the store for `ftrun status` (a save tried again counts once); its
  partial folder is removed, and the next save tries again. A periodic save's
  line is said by the loop at its next step: whether that one was the loop's
  last (then it is tried again, FINAL_SAVE_ATTEMPTS in all) only the loop knows. Nothing a save raises ends the thread: a dead writer
  would leave the next save waiting for ever.
- a sharded replica's workers agree before writing and after publishing (two
  tiny collectives on a gloo write group of their own, made by the loop at a
  round boundary), so they all write, or none, and all know the outcome.
Must never run a collective on the group the training uses, never
communicate across replicas, never raise out of the thread, and never import
the supervisor.
"""

from __future__ import annotations

import atexit
import datetime
import errno
import json
import os
import queue
import shutil
import threading
import time
import zlib
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ftrun.worker.ft.checkpoint.folder import Folder, drop_cached
from ftrun.worker.ft.checkpoint.read import one_line
from ftrun.worker.ft.checkpoint.state import tensor_bytes
from ftrun.worker.ft.checkpoint.status import StoreStatus
from ftrun.worker.settings import current

FORMAT = 2  # 2: ftrun.json holds "checksums" and "optimizers"
# Fault injection for tests: "STEP:SECONDS" holds the write of step STEP that long before
# it is published, so a test can kill the run while a complete-looking partial folder exists.
INJECT_ENV = "FTRUN_CHECKPOINT_INJECT_DELAY"
# DCP's collectives in the background thread wait at most this long for the replica's other workers.
WRITE_GROUP_TIMEOUT = datetime.timedelta(minutes=30)
# The writer thread's CPU niceness: it takes what the training leaves (the vote's wait, Python
# between kernels) before it takes a core from the training's own threads.
WRITER_NICE = 10

# The save of the loop's last step is tried this often in all, the next try after this many
# seconds times the tries so far (1 s, then 2 s: docs/guides/checkpoints.md).
FINAL_SAVE_ATTEMPTS = 3
FINAL_SAVE_RETRY_S = 1.0

# CheckpointException derives from BaseException: `except Exception` misses it.
try:
    from torch.distributed.checkpoint.api import CheckpointException
except ImportError:  # pragma: no cover - an older torch
    class CheckpointException(BaseException):  # type: ignore[no-redef]
        pass

SAVE_ERRORS = (Exception, CheckpointException)


@dataclass
class Job:
    """One save, from the loop to the writer thread."""

    step: int
    partial: Path
    started: float
    kind: str                               # "periodic", "final" (the loop's last step), "stop" (a stop signal)
    verify: bool = True                     # write the checksums (FTRUN_CHECKPOINT_VERIFY)
    optimizers: List[str] = field(default_factory=list)
    staging: Optional[Future] = None        # the copy into host memory
    error: Optional[BaseException] = None   # the save failed before its write could start
    pause: float = 0.0                      # how long the loop waited for this save
    attempt: int = 1                        # the save of this step tried again: 2, 3 (one save, not three)


class Writer:
    """The writer thread of one worker, started by its first job."""

    def __init__(self, folder: Folder, status: StoreStatus, rank: int, shard: int, k: int,
                 log: Callable[[str], None], detail: Callable[[str], None]) -> None:
        self.folder, self.status = folder, status
        self.rank, self.shard, self.k = rank, shard, k
        self._log = log
        self._detail = detail
        self._thread: Optional[threading.Thread] = None
        self._jobs: "queue.SimpleQueue[Job]" = queue.SimpleQueue()
        self.group: Optional[dist.ProcessGroup] = None
        self._written = threading.Event()
        self._written.set()
        # (step, written) of the last save, as every worker of the writing replica knows it.
        self.result: Optional[Tuple[int, bool]] = None
        self.last_failure: Optional[str] = None
        # A periodic save's failure, said by the loop at its next step (say_held): only the loop
        # learns whether that step was its last (an ft.DataLoader loop learns it after the save).
        self._held: Optional[Tuple[Job, str, Optional[str]]] = None
        self._held_lock = threading.Lock()
        inject = current().checkpoint_inject_delay
        step, _, seconds = inject.partition(":")
        self._inject = (int(step), float(seconds)) if step.isdigit() and seconds else None

    def make_group(self) -> None:
        """The replica's write group, once. All of this replica's workers call it at the same
        round: a collective call is safe there."""
        if self.k > 1 and self.group is None:
            self.group = dist.new_group(backend="gloo", timeout=WRITE_GROUP_TIMEOUT)

    def submit(self, job: Job) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="ftrun-checkpoint", daemon=True)
            self._thread.start()
            atexit.register(self.say_held)  # a script that ends (or raises) before its next step
        self._written.clear()
        self._jobs.put(job)

    def wait(self) -> None:
        """Until the previous save is written and published (or failed)."""
        self._written.wait()

    def _loop(self) -> None:
        """DCP's save of each staged copy, then its publication. It runs at a low priority: the
        write takes what the training leaves first (Linux: per thread)."""
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
        except (OSError, AttributeError):
            pass
        while True:
            job = self._jobs.get()
            try:
                self._write(job)
            except BaseException as e:  # noqa: BLE001 - a bug here must not stop checkpointing for good
                self.result = (job.step, False)
                self._log(f"rank {self.rank}: checkpoint of step {job.step} not written: {one_line(e)}")
            finally:
                self._written.set()

    def _write(self, job: Job) -> None:
        import torch.distributed.checkpoint as dcp

        why: Optional[str] = None
        sd: Any = None
        try:
            if job.error is not None:
                raise job.error
            sd = job.staging.result()
        except SAVE_ERRORS as e:
            why = self._why(e, sd)
        if self.k > 1 and not self._agree(why is None) and why is None:
            why = "another worker of this replica could not stage its part"
        crc = torch.serialization.get_crc32_options()
        if why is None:
            try:
                # The setting is per thread: this one is the writer's own, whatever the script chose.
                torch.serialization.set_crc32_options(job.verify)
                try:
                    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(job.partial), sync_files=True),
                             process_group=self.group, no_dist=self.k == 1)
                finally:
                    torch.serialization.set_crc32_options(crc)
            except SAVE_ERRORS as e:  # DCP hands every worker's failure to every worker: all agree
                why = self._why(e, sd)
        info: Optional[Dict[str, Any]] = None
        if why is None and self.shard == 0:
            if self._inject and self._inject[0] == job.step:
                self._detail(f"rank {self.rank}: holding checkpoint {job.partial} for {self._inject[1]:g} s "
                          f"(fault injection, {INJECT_ENV})")
                time.sleep(self._inject[1])
            try:
                info = self._publish(job)
                if info is None:
                    why = "its folder was removed before it was published (a newer one superseded it)"
            except SAVE_ERRORS as e:  # e.g. the disk filled up as ftrun.json was written
                why = self._why(e, sd)
        written = why is None
        if self.k > 1:  # the first worker published, or not: every worker of the replica learns which
            written = self._agree(written)
        self.result = (job.step, written)
        if not written and self.shard == 0:
            shutil.rmtree(job.partial, ignore_errors=True)
            self._failed(job, why or "the replica's first worker could not publish it")
        elif info is not None:
            self.last_failure = None
            self._detail(f"rank {self.rank}: checkpoint of step {job.step} written to {info['path']} "
                      f"({info['bytes'] / 1e6:.1f} MB in {info['write_s']:.2f} s; the loop paused {info['pause_s']:.3f} s)")
            try:
                self.folder.prune(job.step)
            except SAVE_ERRORS as e:  # the checkpoint is written: older ones stay until the next save prunes
                self._log(f"rank {self.rank}: pruning {self.folder.root} failed ({one_line(e)}); the next save "
                          f"tries again")

    def _agree(self, ok: bool) -> bool:
        """Whether every worker of this replica says ok (a collective on the write group)."""
        if self.group is None:  # it could not be made: DCP's own collectives would fail alike
            return ok
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())

    def _publish(self, job: Job) -> Optional[Dict[str, Any]]:
        if not job.partial.is_dir():
            return None
        files = [f for f in job.partial.iterdir() if f.is_file()]
        sums: Dict[str, Any] = {}
        if job.verify:  # every record of every data file carries torch's CRC-32; .metadata gets one
            sums = {"metadata_crc32": zlib.crc32((job.partial / ".metadata").read_bytes()), "records": True}
        size = sum(drop_cached(f) for f in files)
        info = {"format": FORMAT, "step": job.step, "bytes": size, "write_s": round(time.time() - job.started, 3),
                "pause_s": round(job.pause, 4), "time": time.time(), "replica_size": self.k,
                "run_id": current().run_id, "optimizers": job.optimizers, "checksums": sums}
        final = self.folder.publish(job.partial, job.step, json.dumps(info).encode())
        info["path"] = str(final)
        self.status.report(info)
        return info

    def _why(self, e: BaseException, sd: Any) -> str:
        """A failed save in ftrun's words: DCP's CheckpointException unwrapped, and whether the
        file system is full."""
        e = inner_error(e)
        text = one_line(e)
        err = getattr(e, "errno", None)
        try:
            free = shutil.disk_usage(self.folder.root).free
        except OSError:
            free = None
        need = 0
        if sd is not None:
            try:
                need = tensor_bytes(sd)
            except Exception:  # noqa: BLE001 - only for the words
                need = 0
        if err in (errno.ENOSPC, errno.EDQUOT) or (free is not None and need and free < need):
            room = f"{_size(free)} free" if free is not None else "no room"
            mine = f", this checkpoint needs about {_size(need)}" if need else ""
            # torch's own words for a short write say nothing more ("unexpected pos 704 vs 598")
            return f"the file system of {self.folder.root} is full or over quota ({room}{mine})"
        return text

    def _failed(self, job: Job, why: str) -> None:
        """One line for a save that wrote nothing, and the counts `ftrun status` shows."""
        self.last_failure = why
        newest = self.status.failed(job.step, job.kind, why, retry=job.attempt > 1)
        with self._held_lock:
            if job.kind == "periodic":
                self._held = (job, why, newest)
                return
        self._say(job, why, newest)

    def say_held(self) -> None:
        """The loop (its thread): say a periodic save's failure held back, with what comes next."""
        with self._held_lock:
            held, self._held = self._held, None
        if held is not None:
            self._say(*held)

    def _say(self, job: Job, why: str, newest: Optional[str]) -> None:
        kind = job.kind  # "final" once the loop learned that this step was its last (Checkpointer.save)
        if kind == "final" and job.attempt < FINAL_SAVE_ATTEMPTS:
            then = (f"this was the loop's last step: trying again in {FINAL_SAVE_RETRY_S * job.attempt:g} s "
                    f"(try {job.attempt + 1} of {FINAL_SAVE_ATTEMPTS})")
        elif kind == "final":
            then = f"this was the loop's last step, and its last try ({job.attempt} of {FINAL_SAVE_ATTEMPTS})"
        else:
            then = {"periodic": "training goes on and the next save tries again",
                    "stop": "this was the save before stopping"}[kind]
        self._log(f"rank {self.rank}: checkpoint of step {job.step} not written: {why}; {then}; "
                  f"{'the newest good checkpoint is ' + newest if newest else 'no good checkpoint yet'}")


def inner_error(e: BaseException) -> BaseException:
    """DCP's CheckpointException wraps each worker's error: the first one says what happened."""
    for failure in (getattr(e, "failures", None) or {}).values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, BaseException):
            return inner
    return e


def _size(n: Optional[int]) -> str:
    if n is None:
        return "?"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"
