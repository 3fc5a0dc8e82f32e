"""Durable replica state for --ft: checkpoints on disk, and the resume when no replica holds state.

Saving. Every N committed steps the replica at index 0 of the epoch writes
the state a heal would send (registered models, optimizers and extra state)
with torch.distributed.checkpoint (DCP), and the global step with it:
- asynchronous: the state is copied into host memory (staging buffers kept
  from one save to the next: one extra copy of this worker's state, never
  more) by a background thread while the round's forward and backward run,
  which never change parameters or optimizer state; the loop waits for the
  copy only before the round's optimizer step (`staged()`), if it is not
  done by then. What may change earlier is copied at once
  (ft/checkpoint_state.py). Then `dcp.save` writes the copy in ftrun's writer
  thread (long-lived: DCP's `async_save` starts a thread per save, which,
  while the copy holds the GIL, cost the loop 10-25 ms), at a low CPU
  priority (nice 10), with fsync, and the written files leave the page cache.
  A save first waits for the previous one if it is still writing.
- atomic: everything goes into DIR/.step-N.RUN.partial/ and one rename
  publishes it as DIR/step-N/ once it is complete. DCP writes `.metadata`
  last, after every worker of the replica wrote its part; then the
  replica's first worker adds ftrun.json (the step, the checksums of what
  torch's own CRCs do not cover, what the write cost) and renames.
- never fatal: a save that fails (a full disk, a quota, an I/O error: DCP
  raises them as CheckpointException, a BaseException) is one line, counted
  in the store for `ftrun status`; its partial folder is removed, training
  goes on, and the next save tries again. The writer thread never dies. A
  sharded replica's workers agree before writing and after publishing (two
  tiny collectives on the write group), so they all write, or none, and all
  know the outcome (the final save is retried by all of them).
- pruned: the newest `keep` checkpoints that verify are kept
  (ft/checkpoint_read.py: checksums); a damaged one is moved aside to
  step-N.damaged, never counted and never deleted; the only good one is
  never deleted. Partial folders older than the newest published one go.
- sharded replicas (FSDP2): each worker writes its own shard, in parallel, as
  DTensors whose global layout DCP records, so a checkpoint loads at another
  replica count and, where DCP can reshard, another --replica-size. The
  replica's workers coordinate the write over a gloo group of their own, made
  for it (DCP's collectives run in the writer thread, never on the group the
  training uses).

Loading (the source of a fresh epoch, before it sends its state): the newest
checkpoint that is whole and whose checksums hold is read into the replica's
own tensors in place; a damaged one is moved aside with one line, and any
other failure to load one falls back to the previous one, with one line. One
whose tensors or optimizer classes do not fit this run raises
CheckpointMismatch. Loading never communicates: each worker reads its own
shard, so the workers of a replica cannot wait on each other here.

Must never communicate across replicas, never import the supervisor, never
put anything but a few words in the store, and never load a partial folder.
"""

from __future__ import annotations

import datetime
import errno
import json
import os
import queue
import shutil
import threading
import time
import warnings
import zlib
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ftrun import protocol as keys
from ftrun.worker.ft import checkpoint_read as disk
from ftrun.worker.ft.checkpoint_read import DAMAGED_SUFFIX, META, PARTIAL_DIR, Damaged, complete_checkpoints, one_line
from ftrun.worker.ft.checkpoint_state import StateDicts, new_stager, stager_reusable, tensor_bytes

FORMAT = 2  # 2: ftrun.json holds "checksums" and "optimizers"
# Fault injection for tests: "STEP:SECONDS" holds the write of step STEP that long before
# it is published, so a test can kill the run while a complete-looking partial folder exists.
INJECT_ENV = "FTRUN_CHECKPOINT_INJECT_DELAY"
# Tests: a fresh stager for every save, as on a torch whose stager stages only once (stager_reusable).
FRESH_STAGER_ENV = "FTRUN_CHECKPOINT_FRESH_STAGER"
# Benchmarks: "0" leaves out the checksums a save writes (the CRCs of torch's records, off in the
# writer thread's saves, and the CRC of .metadata) and the checks at load; "alternate" leaves them
# out of every other save (where step // every is even), to measure in one run what they cost.
VERIFY_ENV = "FTRUN_CHECKPOINT_VERIFY"
# DCP's collectives in the background thread wait at most this long for the replica's other workers.
WRITE_GROUP_TIMEOUT = datetime.timedelta(minutes=30)
# The writer thread's CPU niceness: it takes what the training leaves (the vote's wait, Python
# between kernels) before it takes a core from the training's own threads.
WRITER_NICE = 10

warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled, unavailable or uninitialized")
# CheckpointException derives from BaseException: `except Exception` misses it.
try:
    from torch.distributed.checkpoint.api import CheckpointException
except ImportError:  # pragma: no cover - an older torch
    class CheckpointException(BaseException):  # type: ignore[no-redef]
        pass

SAVE_ERRORS = (Exception, CheckpointException)


class CheckpointMismatch(RuntimeError):
    """The checkpoint holds another model or optimizer than this run's: no retry helps."""


@dataclass(frozen=True)
class Settings:
    root: Path
    every: int
    keep: int

    @classmethod
    def from_env(cls) -> Optional["Settings"]:
        root = os.environ.get("FTRUN_CHECKPOINT_DIR")
        if not root:
            return None
        return cls(Path(root), max(1, int(os.environ.get("FTRUN_CHECKPOINT_EVERY", "500"))),
                   max(1, int(os.environ.get("FTRUN_CHECKPOINT_KEEP", "2"))))


@dataclass
class Resumed:
    step: int
    path: Path
    info: Dict[str, Any]


@dataclass
class _Job:
    """One save, from the loop to the writer thread."""

    step: int
    partial: Path
    started: float
    kind: str                               # "periodic", "final" (the loop's last step), "stop" (a stop signal)
    verify: bool = True                     # write the checksums (VERIFY_ENV)
    optimizers: List[str] = field(default_factory=list)
    staging: Optional[Future] = None        # the copy into host memory
    error: Optional[BaseException] = None   # the save failed before its write could start


class Checkpointer:
    """One per worker; saves only when the manager says this replica writes."""

    def __init__(self, settings: Settings, rank: int, shard: int, k: int, log: Callable[[str], None]) -> None:
        self.settings = settings
        self.rank, self.shard, self.k = rank, shard, k
        self._log = log
        self._stager: Any = None
        # Whether one stager may stage every save (stager_reusable; None: not known yet).
        self._reuse: Optional[bool] = False if os.environ.get(FRESH_STAGER_ENV) else None
        self._writer: Optional[threading.Thread] = None
        self._jobs: "queue.SimpleQueue" = queue.SimpleQueue()
        self._group: Optional[dist.ProcessGroup] = None
        self._written = threading.Event()
        self._written.set()
        self._staging: Optional[Future] = None  # the copy into host memory of the save in flight
        self._pause = 0.0                        # how long the loop waited for the save in flight
        self._dicts = StateDicts()
        self._store: Any = None
        self._verify_mode = os.environ.get(VERIFY_ENV, "1")
        self._verify = self._verify_mode != "0"  # checks at load and before pruning
        # Checkpoints this process knows to be good (it published or verified them): folder ->
        # the identity of its ftrun.json, so a folder replaced since is judged again.
        self._good: Dict[str, Tuple[int, int]] = {}
        self.saves = 0
        # (step, written) of the last save, as every worker of the writing replica knows it.
        self.result: Optional[Tuple[int, bool]] = None
        self.last_failure: Optional[str] = None
        inject = os.environ.get(INJECT_ENV, "")
        step, _, seconds = inject.partition(":")
        self._inject = (int(step), float(seconds)) if step.isdigit() and seconds else None
        import torch.distributed.checkpoint  # noqa: F401 - now, not inside the first save's pause

    @classmethod
    def from_env(cls, rank: int, shard: int, k: int, log: Callable[[str], None]) -> Optional["Checkpointer"]:
        settings = Settings.from_env()
        return cls(settings, rank, shard, k, log) if settings else None

    def due(self, step: int, total: Optional[int]) -> bool:
        """A save after the step that brought the count to `step` (and after the last one)."""
        return step > 0 and (step % self.settings.every == 0 or (total is not None and step >= total))

    # ------------------------------------------------------------ saving
    def save(self, state: Any, step: int, kind: str = "periodic") -> None:
        """Start staging this worker's state and hand the write to the writer thread. Every
        worker of the writing replica calls this at the same round boundary (a sharded
        replica's workers coordinate DCP's write). A failure is one line; training goes on."""
        t0 = time.monotonic()
        self.wait()
        if not state.models and not state.optimizers:
            return
        job = _Job(step, self.settings.root / f".step-{step}.{os.environ.get('FTRUN_RUN_ID') or 'run'}.partial",
                   time.time(), kind, optimizers=disk.optimizer_names(state.optimizers),
                   verify=self._verify and (self._verify_mode != "alternate" or (step // self.settings.every) % 2 == 1))
        try:
            if self.k > 1 and self._group is None:
                # All of this replica's workers are here at the same round: a collective call is safe.
                self._group = dist.new_group(backend="gloo", timeout=WRITE_GROUP_TIMEOUT)
            if self.shard == 0:
                # Left over by this run (or a run of its id) killed while writing this step.
                # The replica's other workers write nothing before the workers agreed to write
                # (_write), which the first one does after this.
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
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_loop, name="ftrun-checkpoint", daemon=True)
            self._writer.start()
        self._staging = job.staging
        self._pause = time.monotonic() - t0
        self.saves += 1
        self._written.clear()
        self._jobs.put(job)

    def staged(self) -> None:
        """Before anything may change the state a save is copying (the round's optimizer step):
        wait for the copy, if it is still running."""
        staging, self._staging = self._staging, None
        if staging is None:
            return
        t0 = time.monotonic()
        try:
            staging.result()
        except SAVE_ERRORS:  # the writer reports it
            pass
        self._pause += time.monotonic() - t0

    def wait(self) -> None:
        """Until the previous save is written and published (or failed)."""
        self._written.wait()
        self._staging = None

    def _write_loop(self) -> None:
        """The writer thread: DCP's save of each staged copy, then its publication. It runs at a
        low priority: the write takes what the training leaves first (Linux: per thread). Nothing
        a save raises ends it: a dead writer would leave the next save waiting for ever."""
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

    def _write(self, job: _Job) -> None:
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
                             process_group=self._group, no_dist=self.k == 1)
                finally:
                    torch.serialization.set_crc32_options(crc)
            except SAVE_ERRORS as e:  # DCP hands every worker's failure to every worker: all agree
                why = self._why(e, sd)
        info: Optional[Dict[str, Any]] = None
        if why is None and self.shard == 0:
            if self._inject and self._inject[0] == job.step:
                self._log(f"rank {self.rank}: holding checkpoint {job.partial} for {self._inject[1]:g} s "
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
            self._log(f"rank {self.rank}: checkpoint of step {job.step} written to {info['path']} "
                      f"({info['bytes'] / 1e6:.1f} MB in {info['write_s']:.2f} s; the loop paused {info['pause_s']:.3f} s)")
            try:
                self._prune(job.step)
            except SAVE_ERRORS as e:  # the checkpoint is written: older ones stay until the next save prunes
                self._log(f"rank {self.rank}: pruning {self.settings.root} failed ({one_line(e)}); the next save "
                          f"tries again")

    def _agree(self, ok: bool) -> bool:
        """Whether every worker of this replica says ok (a collective on the write group)."""
        if self._group is None:  # it could not be made: DCP's own collectives would fail alike
            return ok
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._group)
        return bool(flag.item())

    def _publish(self, job: _Job) -> Optional[Dict[str, Any]]:
        root = self.settings.root
        final = root / f"step-{job.step}"
        if not job.partial.is_dir():
            return None
        files = {f.name: f for f in job.partial.iterdir() if f.is_file()}
        sums: Dict[str, Any] = {}
        if job.verify:  # every record of every data file carries torch's CRC-32; .metadata gets one
            sums = {"metadata_crc32": zlib.crc32((job.partial / ".metadata").read_bytes()), "records": True}
        size = sum(_drop_cached(f) for f in files.values())
        info = {"format": FORMAT, "step": job.step, "bytes": size, "write_s": round(time.time() - job.started, 3),
                "pause_s": round(self._pause, 4), "time": time.time(), "replica_size": self.k,
                "run_id": os.environ.get("FTRUN_RUN_ID", ""), "optimizers": job.optimizers, "checksums": sums}
        _write_synced(job.partial / META, json.dumps(info).encode())
        if final.exists():  # damaged, or of an earlier attempt at this step: this one replaces it
            shutil.rmtree(final, ignore_errors=True)
        os.rename(job.partial, final)
        _fsync_dir(root)
        self._remember(final)
        info["path"] = str(final)
        self._report(info)
        return info

    def _prune(self, newest: int) -> None:
        """Keep the newest `keep` checkpoints that verify; move damaged ones aside (never counted,
        never deleted); drop partial folders older than the newest published one (a killed
        write, or one superseded by a newer writer). A step-N folder without ftrun.json is not
        ftrun's: it is neither counted nor removed."""
        good = 0
        for step, path in complete_checkpoints(self.settings.root):
            if not (path / META).is_file():
                continue
            if good >= self.settings.keep:
                shutil.rmtree(path, ignore_errors=True)
                continue
            verdict = self._judge(path, step)
            if verdict is None:
                good += 1
            elif not verdict.io_error:
                self._move_aside(path, verdict.why)
        try:
            entries = list(os.scandir(self.settings.root))
        except OSError:
            return
        for e in entries:
            m = PARTIAL_DIR.fullmatch(e.name)
            if m and int(m.group(1)) < newest:
                shutil.rmtree(e.path, ignore_errors=True)

    def _judge(self, path: Path, step: int) -> Optional[Damaged]:
        """None if the checkpoint is good: known to this process, or checked now (once)."""
        if self._known_good(path):
            return None
        verdict = disk.check(path, step, checksums=self._verify)
        if isinstance(verdict, Damaged):
            return verdict
        self._remember(path)
        return None

    def _known_good(self, path: Path) -> bool:
        try:
            st = (path / META).stat()
        except OSError:
            return False
        return self._good.get(str(path)) == (st.st_ino, st.st_mtime_ns)

    def _remember(self, path: Path) -> None:
        try:
            st = (path / META).stat()
            self._good[str(path)] = (st.st_ino, st.st_mtime_ns)
        except OSError:
            pass

    def _move_aside(self, path: Path, why: str) -> None:
        """A damaged checkpoint: out of the way of every later resume and prune, kept for a look."""
        aside = path.with_name(path.name + DAMAGED_SUFFIX)
        try:
            if aside.exists():
                shutil.rmtree(aside)
            os.rename(path, aside)
        except OSError as e:
            self._log(f"rank {self.rank}: checkpoint {path} is damaged ({why}); it could not be moved aside "
                      f"({one_line(e)}), so it is skipped")
            return
        self._log(f"rank {self.rank}: checkpoint {path} is damaged ({why}); moved aside to {aside} (never read "
                  f"again: remove it once you have looked)")

    def _why(self, e: BaseException, sd: Any) -> str:
        """A failed save in ftrun's words: DCP's CheckpointException unwrapped, and whether the
        file system is full."""
        e = _inner(e)
        text = one_line(e)
        err = getattr(e, "errno", None)
        try:
            free = shutil.disk_usage(self.settings.root).free
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
            return f"the file system of {self.settings.root} is full or over quota ({room}{mine})"
        return text

    def _failed(self, job: _Job, why: str) -> None:
        """One line for a save that wrote nothing, and the counts `ftrun status` shows."""
        self.last_failure = why
        failed = None
        store = self._store_client()
        if store is not None:
            try:
                failed = int(store.add(keys.CHECKPOINT_FAILED, 1))
                store.set(keys.CHECKPOINT_FAILURE, json.dumps({"step": job.step, "why": why, "final": job.kind == "final",
                                                               "stop": job.kind == "stop", "time": time.time(),
                                                               "failed": failed}))
            except Exception:  # noqa: BLE001 - status only
                self._store = None
        newest = self._newest_good(store)
        then = {"periodic": "training goes on and the next save tries again",
                "final": "this was the loop's last step",
                "stop": "this was the save before stopping"}[job.kind]
        self._log(f"rank {self.rank}: checkpoint of step {job.step} not written: {why}; {then}; "
                  f"{'the newest good checkpoint is ' + newest if newest else 'no good checkpoint yet'}")

    def _newest_good(self, store: Any) -> Optional[str]:
        try:
            if store is not None and store.check([keys.CHECKPOINT]):
                info = json.loads(store.get(keys.CHECKPOINT))
                return f"step {info['step']} ({info['path']})"
        except Exception:  # noqa: BLE001 - only for the words
            pass
        return None

    def _store_client(self) -> Any:
        """A connection of the writer's own to the run's store (the loop's is busy voting)."""
        addr = os.environ.get("FTRUN_STORE")
        if not addr:
            return None
        if self._store is None:
            try:
                host, _, port = addr.rpartition(":")
                self._store = dist.TCPStore(host, int(port), None, False, datetime.timedelta(seconds=10))
            except Exception:  # noqa: BLE001 - status only
                return None
        return self._store

    def _report(self, info: Dict[str, Any]) -> None:
        """The newest good checkpoint, for `ftrun status`: a few words in the store, with the count
        of failed saves then (those after it are the ones since)."""
        store = self._store_client()
        if store is None:
            return
        try:
            info = {**info, "failed": int(store.add(keys.CHECKPOINT_FAILED, 0))}
            info.pop("checksums", None)
            info.pop("optimizers", None)
            store.set(keys.CHECKPOINT, json.dumps(info))
        except Exception:  # noqa: BLE001 - status only
            self._store = None

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
            verdict = disk.check(path, step, checksums=self._verify)
            if isinstance(verdict, Damaged):
                passed += 1
                if self.shard == 0 and not verdict.io_error:
                    self._move_aside(path, verdict.why)
                else:
                    say(f"rank {self.rank}: checkpoint {path} could not be checked ({verdict.why}); skipping it")
                continue
            info, metadata = verdict.info, verdict.metadata
            if target is None:
                target = self._dicts.load_target(state)
            disk.drop_states_not_saved(target, metadata)
            misfit = disk.misfit(target, metadata, state.extras) or disk.other_optimizer(info, state.optimizers)
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
                say(f"rank {self.rank}: checkpoint {path} could not be read ({one_line(_inner(e))}); trying the "
                    f"one before it")
                continue
            self._remember(path)
            for name in state.extras:
                if name not in loaded["extras"]:
                    say(f"rank {self.rank}: registered state {name!r} is not in checkpoint {path}: it keeps "
                        f"its initial state")
            age = time.time() - float(info.get("time", time.time()))
            past = (f"; that is past the {total} steps the loop asks for (ft.steps({total})): nothing is left to "
                    f"train, the loop ends at once" if total is not None and step > total else "")
            say(f"rank {self.rank}: resumed from checkpoint {path} at step {step} (written {_age(age)} ago){past}")
            self._report({**info, "path": str(path)})
            return Resumed(step, path, info)
        if touched:
            # Some tensors may hold part of a checkpoint that failed to load: never train on that.
            raise RuntimeError(f"no checkpoint in {root} could be read, and a failed read left part of one in "
                               f"this replica's tensors")
        say(f"rank {self.rank}: none of the {passed} checkpoint(s) in {root} could be used (damaged or unreadable): "
            f"starting from the first step")
        return None


def _inner(e: BaseException) -> BaseException:
    """DCP's CheckpointException wraps each worker's error: the first one says what happened."""
    for failure in (getattr(e, "failures", None) or {}).values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, BaseException):
            return inner
    return e


# ---------------------------------------------------------------- small helpers

def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _drop_cached(path: Path) -> int:
    """Take a written (and fsynced) file out of the page cache; its size. A checkpoint is read
    back only after a loss: its pages would push out data the training reads, and their
    memory, freed now, is the cheapest for the next write to take."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return 0
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except (OSError, AttributeError):
        pass
    finally:
        size = os.fstat(fd).st_size
        os.close(fd)
    return size


def _fsync_dir(path: Path) -> None:
    """Make a rename in `path` durable (the folder's entry, not just the files)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _size(n: Optional[int]) -> str:
    if n is None:
        return "?"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{max(0.0, seconds):.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
