"""Durable replica state for --ft: checkpoints on disk, and the resume when no replica holds state.

Saving. Every N committed steps the replica at index 0 of the epoch writes
the state a heal would send (registered models, optimizers and extra state)
with torch.distributed.checkpoint (DCP), and the global step with it:
- asynchronous: the state is copied into host memory (staging buffers kept
  from one save to the next: one extra copy of this worker's state, never
  more) by a background thread while the round's forward and backward run,
  which never change parameters or optimizer state; the loop waits for the
  copy only before the round's optimizer step (`staged()`), if it is not
  done by then. What may change earlier (buffers such as BatchNorm's
  statistics, registered state such as a data sampler's position, learning
  rates) is copied at once (a registered object's tensors above 1 MiB are
  staged in the background like parameters). Then `dcp.save` writes the copy
  in ftrun's writer thread (long-lived: DCP's `async_save` starts a thread
  per save, which, while the copy holds the GIL, cost the loop 10-25 ms), at
  a low CPU priority (nice 10), with fsync, and the written files leave the
  page cache. A save first waits for the previous one if it is still writing.
- atomic: everything goes into DIR/.step-N.RUN.partial/ (RUN: the run's id,
  so two runs pointed at one folder never write into each other's files),
  and one rename publishes it as DIR/step-N/ once it is complete. DCP writes
  `.metadata` last, after every worker of the replica wrote its part; then
  the replica's first worker adds ftrun.json (the step, what the write cost)
  and renames. The newest `keep` are kept; partial folders are never read.
- sharded replicas (FSDP2): each worker writes its own shard, in parallel, as
  DTensors whose global layout DCP records, so a checkpoint loads at another
  replica count and, where DCP can reshard, another --replica-size. The
  replica's workers coordinate the write over a gloo group of their own, made
  for it (DCP's collectives run in the writer thread, never on the group the
  training uses).

Loading (the source of a fresh epoch, before it sends its state): the newest
complete checkpoint that is not damaged (unreadable ftrun.json or .metadata, a
data file shorter than its metadata says) is read into the replica's own
tensors in place; a damaged one is skipped with one line. One whose tensors
do not fit this run's model and optimizer raises CheckpointMismatch. Loading
never communicates: each worker reads its own shard, so the workers of a
replica cannot wait on each other here. `.metadata` is unpickled with a short
list of DCP's own classes, and every other object with weights_only=True.

Must never communicate across replicas, never import the supervisor, never
put anything but a few words in the store, and never load a partial folder.
"""

from __future__ import annotations

import datetime
import json
import os
import pickle
import queue
import re
import shutil
import threading
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ftrun import protocol as keys

FORMAT = 1
META = "ftrun.json"            # written last, by the replica's first worker: the step and the write's cost
STEP_DIR = re.compile(r"step-(\d+)")
PARTIAL_DIR = re.compile(r"\.step-(\d+)\.[A-Za-z0-9._-]+\.partial")
# Fault injection for tests: "STEP:SECONDS" holds the write of step STEP that long before
# it is published, so a test can kill the run while a complete-looking partial folder exists.
INJECT_ENV = "FTRUN_CHECKPOINT_INJECT_DELAY"
# Tests: a fresh stager for every save, as on a torch whose stager stages only once (_stager_reusable).
FRESH_STAGER_ENV = "FTRUN_CHECKPOINT_FRESH_STAGER"
# DCP's collectives in the background thread wait at most this long for the replica's other workers.
WRITE_GROUP_TIMEOUT = datetime.timedelta(minutes=30)

warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled, unavailable or uninitialized")


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


def complete_checkpoints(root: Path) -> List[Tuple[int, Path]]:
    """(step, folder) of every published checkpoint under `root`, newest first."""
    found = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return []
    for e in entries:
        m = STEP_DIR.fullmatch(e.name)
        if m and e.is_dir(follow_symlinks=False):
            found.append((int(m.group(1)), Path(e.path)))
    return sorted(found, reverse=True)


class Checkpointer:
    """One per worker; saves only when the manager says this replica writes."""

    def __init__(self, settings: Settings, rank: int, shard: int, k: int, log: Callable[[str], None]) -> None:
        self.settings = settings
        self.rank, self.shard, self.k = rank, shard, k
        self._log = log
        self._stager: Any = None
        # Whether one stager may stage every save (_stager_reusable; None: not known yet).
        self._reuse: Optional[bool] = False if os.environ.get(FRESH_STAGER_ENV) else None
        self._writer: Optional[threading.Thread] = None
        self._jobs: "queue.SimpleQueue" = queue.SimpleQueue()
        self._group: Optional[dist.ProcessGroup] = None
        self._written = threading.Event()
        self._written.set()
        self._staging: Optional[Future] = None  # the copy into host memory of the save in flight
        self._pause = 0.0                        # how long the loop waited for the save in flight
        self._container: Optional[torch.nn.Module] = None
        self._store: Any = None
        self.saves = 0
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
    def save(self, state: Any, step: int) -> None:
        """Start staging this worker's state and hand the write to the writer thread. Every
        worker of the writing replica calls this at the same round boundary (a sharded
        replica's workers coordinate DCP's write). A failure is one line; training goes on."""
        t0 = time.monotonic()
        self.wait()
        if not state.models and not state.optimizers:
            return
        partial = self.settings.root / f".step-{step}.{os.environ.get('FTRUN_RUN_ID') or 'run'}.partial"
        try:
            if self.shard == 0:
                # Left over by this run (or a run of its id) killed while writing this step.
                # The replica's other workers write nothing before the coordinator planned the
                # save, which it does after this (DCP's first collective).
                shutil.rmtree(partial, ignore_errors=True)
                partial.mkdir(parents=True, exist_ok=True)
            if self._stager is not None and not self._reuse:
                self._stager.close()  # the previous save is written (wait(), above)
                self._stager = None
            if self._stager is None:
                if self._reuse is None:
                    self._reuse = _stager_reusable(_new_stager())
                self._stager = _new_stager()
            if self.k > 1 and self._group is None:
                # All of this replica's workers are here at the same round: a collective call is safe.
                self._group = dist.new_group(backend="gloo", timeout=WRITE_GROUP_TIMEOUT)
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_loop, name="ftrun-checkpoint", daemon=True)
                self._writer.start()
            sd = self._copy_what_may_change(self._state_dict(state), state)
            self._written.clear()
            self._staging = self._stager.stage(sd)
        except Exception as e:  # noqa: BLE001 - a checkpoint that cannot be written must not stop training
            self._written.set()
            self._log(f"rank {self.rank}: checkpoint of step {step} not written: {_one_line(e)}")
            return
        self._pause = time.monotonic() - t0
        self.saves += 1
        self._jobs.put((self._staging, step, partial, time.time()))

    def staged(self) -> None:
        """Before anything may change the state a save is copying (the round's optimizer step):
        wait for the copy, if it is still running."""
        staging, self._staging = self._staging, None
        if staging is None:
            return
        t0 = time.monotonic()
        try:
            staging.result()
        except Exception:  # noqa: BLE001 - the writer reports it
            pass
        self._pause += time.monotonic() - t0

    def wait(self) -> None:
        """Until the previous save is written and published (or failed)."""
        self._written.wait()
        self._staging = None

    def _write_loop(self) -> None:
        """The writer thread: DCP's save of each staged copy, then its publication. It runs at a
        low priority: the write takes what the training leaves first (Linux: per thread)."""
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
        except (OSError, AttributeError):
            pass
        while True:
            staging, step, partial, started = self._jobs.get()
            try:
                self._write(staging, step, partial, started)
            finally:
                self._written.set()

    def _write(self, staging: Future, step: int, partial: Path, started: float) -> None:
        import torch.distributed.checkpoint as dcp

        try:
            dcp.save(staging.result(), storage_writer=dcp.FileSystemWriter(str(partial), sync_files=True),
                     process_group=self._group, no_dist=self.k == 1)
        except Exception as e:  # noqa: BLE001
            if self.shard == 0:
                self._log(f"rank {self.rank}: checkpoint of step {step} failed while writing: {_one_line(e)}")
            return
        if self.shard != 0:  # its part is written; the replica's first worker publishes them all
            return
        if self._inject and self._inject[0] == step:
            self._log(f"rank {self.rank}: holding checkpoint {partial} for {self._inject[1]:g} s "
                      f"(fault injection, {INJECT_ENV})")
            time.sleep(self._inject[1])
        try:
            self._publish(step, partial, started, self._pause)
        except OSError as e:  # e.g. another run published the same step into this folder meanwhile
            self._log(f"rank {self.rank}: checkpoint of step {step} not published: {_one_line(e)}")

    def _publish(self, step: int, partial: Path, started: float, pause: float) -> None:
        root = self.settings.root
        final = root / f"step-{step}"
        if not partial.is_dir():
            self._log(f"rank {self.rank}: checkpoint of step {step} was removed before it was published "
                      f"(a newer one superseded it)")
            return
        size = sum(_drop_cached(f) for f in partial.iterdir() if f.is_file())
        info = {"format": FORMAT, "step": step, "bytes": size, "write_s": round(time.time() - started, 3),
                "pause_s": round(pause, 4), "time": time.time(), "replica_size": self.k,
                "run_id": os.environ.get("FTRUN_RUN_ID", "")}
        _write_synced(partial / META, json.dumps(info).encode())
        if final.exists():  # damaged, or of an earlier attempt at this step: this one replaces it
            shutil.rmtree(final, ignore_errors=True)
        os.rename(partial, final)
        _fsync_dir(root)
        self._prune(step)
        self._log(f"rank {self.rank}: checkpoint of step {step} written to {final} ({size / 1e6:.1f} MB in "
                  f"{info['write_s']:.2f} s; the loop paused {pause:.3f} s)")
        self._report({**info, "path": str(final)})

    def _prune(self, newest: int) -> None:
        """Keep the newest `keep` published checkpoints; drop partial folders older than the newest
        published one (a killed write, or one superseded by a newer writer). A step-N folder
        without ftrun.json is not ftrun's: it is neither counted nor removed."""
        ours = [path for _, path in complete_checkpoints(self.settings.root) if (path / META).is_file()]
        for path in ours[self.settings.keep:]:
            shutil.rmtree(path, ignore_errors=True)
        try:
            entries = list(os.scandir(self.settings.root))
        except OSError:
            return
        for e in entries:
            m = PARTIAL_DIR.fullmatch(e.name)
            if m and int(m.group(1)) < newest:
                shutil.rmtree(e.path, ignore_errors=True)

    def _report(self, info: Dict[str, Any]) -> None:
        """The last checkpoint, for `ftrun status`: a few words in the store (its own connection:
        this runs in the writer thread)."""
        addr = os.environ.get("FTRUN_STORE")
        if not addr:
            return
        try:
            if self._store is None:
                host, _, port = addr.rpartition(":")
                self._store = dist.TCPStore(host, int(port), None, False, datetime.timedelta(seconds=10))
            self._store.set(keys.CHECKPOINT, json.dumps(info))
        except Exception:  # noqa: BLE001 - status only
            self._store = None

    # ------------------------------------------------------------ loading
    def resume(self, state: Any) -> Optional[Resumed]:
        """Load the newest complete, undamaged checkpoint into this worker's own tensors; None
        if there is none (the run starts from its first step). CheckpointMismatch if it holds
        another model or optimizer."""
        root = self.settings.root
        say = self._log if self.shard == 0 else (lambda _m: None)
        found = complete_checkpoints(root)
        if not found:
            say(f"rank {self.rank}: no checkpoint in {root} yet: starting from the first step")
            return None
        target: Optional[Dict[str, Any]] = None
        touched = False
        for step, path in found:
            checked = _check_complete(path, step)
            if isinstance(checked, str):
                say(f"rank {self.rank}: checkpoint {path} is damaged ({checked}); skipping it")
                continue
            info, metadata = checked
            if target is None:
                target = self._load_target(state)
            _drop_states_not_saved(target, metadata)
            misfit = _misfit(target, metadata, state)
            if misfit:
                raise CheckpointMismatch(f"checkpoint {path} does not fit this run: {misfit}. Another model or "
                                         f"optimizer wrote it; give this run its own --checkpoint-dir")
            try:
                import torch.distributed.checkpoint as dcp

                touched = True
                loaded = {k: v for k, v in target.items() if k != "extras"}
                loaded["extras"] = {n: sd for n, sd in target["extras"].items() if _has_extra(metadata, n)}
                dcp.load(loaded, storage_reader=_Reader(str(path)), planner=_Planner(), no_dist=True)
                self._apply(state, loaded)
            except CheckpointMismatch:
                raise
            except Exception as e:  # noqa: BLE001
                say(f"rank {self.rank}: checkpoint {path} could not be read ({_one_line(e)}); skipping it")
                continue
            for name in state.extras:
                if name not in loaded["extras"]:
                    say(f"rank {self.rank}: registered state {name!r} is not in checkpoint {path}: it keeps "
                        f"its initial state")
            age = time.time() - float(info.get("time", time.time()))
            say(f"rank {self.rank}: resumed from checkpoint {path} at step {step} (written {_age(age)} ago)")
            self._report({**info, "path": str(path)})
            return Resumed(step, path, info)
        if touched:
            # Some tensors may hold part of a checkpoint that failed to load: never train on that.
            raise RuntimeError(f"no checkpoint in {root} could be read, and a failed read left part of one in "
                               f"this replica's tensors")
        say(f"rank {self.rank}: no undamaged checkpoint in {root}: starting from the first step")
        return None

    def _load_target(self, state: Any) -> Dict[str, Any]:
        """This worker's own tensors for a checkpoint to be read into. A fresh optimizer first gets
        its state tensors at their final shapes (a step on zero gradients with lr 0, parameters
        unchanged), even where gradients of a discarded round are still there."""
        from ftrun.worker.ft.state import _create_optimizer_state

        for opt in state.optimizers:
            _create_optimizer_state(opt)
        return self._state_dict(state)

    def _apply(self, state: Any, loaded: Dict[str, Any]) -> None:
        """Tensors were read in place; what remains are the values that are not tensors (learning
        rates, a scheduler's counters...)."""
        from torch.distributed.checkpoint.state_dict import set_state_dict

        container = self._models(state)
        if state.optimizers:
            set_state_dict(container, tuple(state.optimizers), model_state_dict=loaded["model"],
                           optim_state_dict=loaded["optim"])
        else:
            container.load_state_dict(loaded["model"])
        for name, sd in loaded["extras"].items():
            state.extras[name].load_state_dict(sd)

    # ------------------------------------------------------------ the state, as DCP takes it
    def _models(self, state: Any) -> torch.nn.Module:
        """The registered model, or several under one root ("0.", "1.", ...) for DCP's names."""
        if len(state.models) == 1:
            return state.models[0]
        if self._container is None or len(self._container) != len(state.models):
            self._container = torch.nn.ModuleDict({str(i): m for i, m in enumerate(state.models)})
        return self._container

    def _copy_what_may_change(self, sd: Dict[str, Any], state: Any) -> Dict[str, Any]:
        """Copy now what the loop may change before the round's optimizer step: buffers (a
        forward updates BatchNorm's statistics), registered state (a data sampler moves on as
        the loop takes its batch), the optimizer's settings. Parameters and optimizer state
        only change at the optimizer step: those are staged in the background."""
        import copy

        buffers = {name for name, _ in self._models(state).named_buffers()}
        with torch.no_grad():
            sd["model"] = {k: (v.clone() if k in buffers and isinstance(v, torch.Tensor) else v)
                           for k, v in sd["model"].items()}
        if "param_groups" in sd["optim"]:
            sd["optim"] = {**sd["optim"], "param_groups": copy.deepcopy(sd["optim"]["param_groups"])}
        sd["extras"] = _copy_small(sd["extras"])
        return sd

    def _state_dict(self, state: Any) -> Dict[str, Any]:
        """{"model", "optim", "extras"}: parameters and optimizer state by parameter name (FQN),
        as DTensors for a sharded model, so DCP can lay them out for another shard count. A
        fresh optimizer gets its state tensors first (a step with zero gradients and lr 0)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        container = self._models(state)
        if state.optimizers:
            msd, osd = get_state_dict(container, tuple(state.optimizers))
        else:
            msd, osd = get_model_state_dict(container), {}
        return {"model": msd, "optim": osd, "extras": {name: obj.state_dict() for name, obj in state.extras.items()}}


# A registered object's tensors up to this size are copied at once with the rest of its state (a
# counter, an RNG state); larger ones (an EMA of the model) are staged in the background like
# parameters, so must not change in place before the round's optimizer step either.
SMALL_TENSOR_BYTES = 1 << 20


def _copy_small(obj: Any) -> Any:
    """A copy of a registered object's state, made now: containers and plain values copied,
    small tensors cloned, large tensors left for the background staging."""
    import copy

    if isinstance(obj, torch.Tensor):
        if obj.numel() * obj.element_size() <= SMALL_TENSOR_BYTES:
            with torch.no_grad():
                return obj.clone()
        return obj
    if isinstance(obj, dict):
        copied = {k: _copy_small(v) for k, v in obj.items()}
        return copied if type(obj) is dict else type(obj)(copied)  # an OrderedDict stays one
    if isinstance(obj, list):
        return [_copy_small(v) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_copy_small(v) for v in obj)
    return copy.deepcopy(obj)


# ---------------------------------------------------------------- reading a checkpoint safely

def _check_complete(path: Path, step: int):
    """(ftrun.json, DCP metadata) of a published checkpoint, or why it is damaged."""
    try:
        info = json.loads((path / META).read_text())
    except (OSError, ValueError) as e:
        return f"{META} cannot be read: {_one_line(e)}"
    if not isinstance(info, dict) or info.get("step") != step:
        return f"{META} does not say step {step}"
    try:
        metadata = _load_metadata(path / ".metadata")
    except Exception as e:  # noqa: BLE001 - anything a damaged pickle raises
        return f".metadata cannot be read: {_one_line(e)}"
    sizes: Dict[str, int] = {}
    try:
        for item in metadata.storage_data.values():
            name = item.relative_path
            if name not in sizes:
                sizes[name] = (path / name).stat().st_size
            if sizes[name] < item.offset + item.length:
                return f"{name} is truncated ({sizes[name]} bytes, its metadata needs {item.offset + item.length})"
    except OSError as e:
        return f"a data file is missing: {_one_line(e)}"
    except AttributeError:
        return ".metadata is not DCP's"
    return info, metadata


_SAFE_MODULES = ("torch.distributed.checkpoint.metadata",)
_SAFE_NAMES = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
               ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"), ("builtins", "set"),
               ("builtins", "frozenset"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
               ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"), ("torch._utils", "_rebuild_tensor_v2")}


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's metadata is a pickle: take only DCP's own record classes and torch's dtypes."""

    def find_class(self, module: str, name: str) -> Any:
        if module in _SAFE_MODULES or (module, name) in _SAFE_NAMES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"it refers to {module}.{name}, which a checkpoint's metadata never holds")


def _load_metadata(path: Path) -> Any:
    with open(path, "rb") as f:
        metadata = _MetadataUnpickler(f).load()
    from torch.distributed.checkpoint.metadata import Metadata

    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError(f"it holds {type(metadata).__name__}, not DCP's Metadata")
    return metadata


# The writer thread's CPU niceness: it takes what the training leaves (the vote's wait, Python
# between kernels) before it takes a core from the training's own threads.
WRITER_NICE = 10


def _reader_class():
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata = _load_metadata(Path(str(self.path)) / ".metadata")
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return Reader


def _planner_class():
    import io

    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._nested_dict import set_element

    class Planner(DefaultLoadPlanner):
        """DCP's planner, but values that are not tensors load with weights_only=True."""

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return Planner


def _Reader(path: str) -> Any:
    return _reader_class()(path)


def _Planner() -> Any:
    return _planner_class()()


def _has_extra(metadata: Any, name: str) -> bool:
    prefix = f"extras.{name}"
    return any(k == prefix or k.startswith(prefix + ".") for k in metadata.state_dict_metadata)


def _drop_states_not_saved(target: Dict[str, Any], metadata: Any) -> None:
    """Optimizer state the checkpoint does not have for a parameter (one that never had a
    gradient when it was written) is state this run must not have either."""
    prefix = "optim.state."
    saved = {k[len(prefix):].rsplit(".", 1)[0] for k in metadata.state_dict_metadata if k.startswith(prefix)}
    states = (target.get("optim") or {}).get("state") or {}
    for fqn in [f for f in states if f not in saved]:
        del states[fqn]


def _misfit(target: Dict[str, Any], metadata: Any, state: Any) -> Optional[str]:
    """The first difference between this run's state and the checkpoint's (names, shapes,
    dtypes; tensors or not), in words; None if it fits. Registered extra state present on
    only one side is not a misfit (it is said when loading)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    flat, _ = flatten_state_dict(target)
    saved = metadata.state_dict_metadata
    both = {n for n in state.extras if _has_extra(metadata, n)}

    def considered(key: str) -> bool:
        if not key.startswith("extras."):
            return True
        return any(key == f"extras.{n}" or key.startswith(f"extras.{n}.") for n in both)

    def what(key: str) -> str:
        part = key.split(".", 1)[0]
        return {"model": "model tensor", "optim": "optimizer entry", "extras": "registered state"}.get(part, "entry")

    for key, value in flat.items():
        if not considered(key):
            continue
        meta = saved.get(key)
        if meta is None:
            return f"this run's {what(key)} {key} is not in it"
        if isinstance(value, torch.Tensor):
            if not isinstance(meta, TensorStorageMetadata):
                return f"{what(key)} {key} is a tensor here but not in the checkpoint"
            if tuple(meta.size) != tuple(value.shape):
                return f"{what(key)} {key} is {list(meta.size)} in the checkpoint, {list(value.shape)} in this run"
            if meta.properties.dtype != value.dtype:
                return f"{what(key)} {key} is {meta.properties.dtype} in the checkpoint, {value.dtype} in this run"
        elif isinstance(meta, TensorStorageMetadata):
            return f"{what(key)} {key} is a tensor in the checkpoint but not here"
    for key in saved:
        if considered(key) and key not in flat:
            return f"it has {what(key)} {key}, which this run does not"
    return None


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


def _new_stager() -> Any:
    """DCP's stager: it copies in a thread of its own into buffers it keeps, keyed by the live
    tensors' storages, so from its second save on it copies into memory already there."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    return DefaultStager(StagingOptions(use_pinned_memory=torch.cuda.is_available(), use_shared_memory=False,
                                        use_async_staging=True, use_non_blocking_copy=False))


def _stager_reusable(stager: Any) -> bool:
    """Whether a stager stages more than once. torch 2.11's fails every stage after its first
    (KeyError: <class 'type'> in its cached deep copy; seen on CPU and CUDA): there, every save
    gets a fresh stager (its copy allocates its buffers anew). Two tiny stages tell; the
    stager tried is closed."""
    try:
        for _ in range(2):
            stager.stage({"probe": torch.zeros(1)}).result()
        return True
    except Exception:  # noqa: BLE001 - any failure means: do not reuse
        return False
    finally:
        stager.close()


def _one_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    name = type(e).__name__
    if not lines:
        return name
    # KeyError(<class 'type'>) reads "<class 'type'>" alone: the kind of error says what it was.
    return (lines[0] if lines[0].startswith(name) else f"{name}: {lines[0]}")[:200]


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{max(0.0, seconds):.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
