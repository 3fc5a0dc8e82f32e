"""Reading a checkpoint folder safely: is it whole, do its checksums hold, does it fit this run.

A published checkpoint (DIR/step-N/) holds DCP's data files, DCP's `.metadata`
and ftrun's `ftrun.json`. It is whole when ftrun.json and .metadata can be
read, name the step, and every data file is at least as long as .metadata
says. It is undamaged when, in addition, the checksums written at save hold:
- every item of a data file is one `torch.save` archive (a zip), whose every
  record carries the CRC-32 torch computes as it writes (on by default, and
  always in ftrun's writer thread: the setting is per thread); ftrun.json says
  so ("records"). Reading each record through `zipfile` checks it, so a
  changed byte anywhere in a tensor, or in the archive's own structure, is
  found. The save costs nothing more than DCP's own write. (torch itself never
  checks these CRCs when it loads.)
- ftrun.json holds the CRC-32 of `.metadata` (which says where each tensor is).
A checkpoint written without them (a benchmark's FTRUN_CHECKPOINT_VERIFY=0)
is checked for being whole only; one written before ftrun's checksums (format
1) has its records' CRCs checked where they are not 0.
A checkpoint that fails a check is `Damaged`; `io_error` says when the check
could not read a file at all (a storage hiccup, not a verdict on its bytes).

`.metadata` is unpickled with a short list of DCP's own classes, and every
other object with weights_only=True. Must never communicate, never write
into a checkpoint folder, and never import the supervisor.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from ftrun.wire import first_line
from ftrun.worker.ft.checkpoint.names import resume_order

META = "ftrun.json"            # written last, by the replica's first worker: the step, checksums, the write's cost
DAMAGED_SUFFIX = ".damaged"    # step-N.damaged: moved aside, never read again, never pruned
CHUNK = 1 << 22                # bytes read at a time while checking


@dataclass(frozen=True)
class Damaged:
    why: str
    io_error: bool = False     # a file could not be read (EIO, ESTALE...): the bytes may well be fine


@dataclass(frozen=True)
class Whole:
    info: Dict[str, Any]       # ftrun.json
    metadata: Any              # DCP's Metadata


def complete_checkpoints(root: Path) -> List[Tuple[int, Path]]:
    """(step, folder) of every published checkpoint under `root`, newest first."""
    try:
        entries = list(os.scandir(root))
    except OSError:
        return []
    dirs = {e.name: e.path for e in entries if e.is_dir(follow_symlinks=False)}
    return [(step, Path(dirs[name])) for step, name in resume_order(dirs)]


def check(path: Path, step: int, checksums: bool = True) -> Union[Whole, Damaged]:
    """Whether the checkpoint in `path` is whole and (with `checksums`) undamaged."""
    try:
        info = json.loads((path / META).read_text())
    except OSError as e:
        return Damaged(f"{META} cannot be read: {one_line(e)}", io_error=not isinstance(e, FileNotFoundError))
    except ValueError as e:
        return Damaged(f"{META} cannot be read: {one_line(e)}")
    if not isinstance(info, dict) or info.get("step") != step:
        return Damaged(f"{META} does not say step {step}")
    sums = info.get("checksums") if isinstance(info.get("checksums"), dict) else {}
    try:
        raw = (path / ".metadata").read_bytes()
    except OSError as e:
        return Damaged(f".metadata cannot be read: {one_line(e)}", io_error=not isinstance(e, FileNotFoundError))
    if checksums and "metadata_crc32" in sums and zlib.crc32(raw) != sums["metadata_crc32"]:
        return Damaged(".metadata does not match its checksum")
    try:
        metadata = load_metadata(io.BytesIO(raw))
    except Exception as e:  # noqa: BLE001 - anything a damaged pickle raises
        return Damaged(f".metadata cannot be read: {one_line(e)}")
    items: Dict[str, List[Tuple[int, int]]] = {}
    try:
        for item in metadata.storage_data.values():
            items.setdefault(item.relative_path, []).append((item.offset, item.length))
    except AttributeError:
        return Damaged(".metadata is not DCP's")
    for name, spans in items.items():
        try:
            size = (path / name).stat().st_size
        except OSError as e:
            return Damaged(f"a data file is missing: {one_line(e)}", io_error=not isinstance(e, FileNotFoundError))
        need = max(o + n for o, n in spans)
        if size < need:
            return Damaged(f"{name} is truncated ({size} bytes, its metadata needs {need})")
    if not checksums:
        return Whole(info, metadata)
    old = info.get("format", 1) < 2  # before ftrun's checksums: torch's CRCs where they are not 0
    for name, spans in sorted(items.items()):
        try:
            if old or sums.get("records"):
                with open(path / name, "rb") as f:
                    for offset, length in sorted(set(spans)):
                        bad = _archive_damage(f, offset, length, strict=not old)
                        if bad:
                            return Damaged(f"{name} is damaged at byte {offset} or after ({bad})")
        except OSError as e:
            return Damaged(f"{name} cannot be read: {one_line(e)}", io_error=True)
    return Whole(info, metadata)


def _archive_damage(f: Any, offset: int, length: int, strict: bool) -> Optional[str]:
    """Why the torch.save archive at [offset, offset+length) of `f` is damaged, or None: every
    record is read through zipfile, which checks its CRC-32. A record whose CRC is 0 was
    written with torch's CRCs off: in a checkpoint older than ftrun's checksums (not
    `strict`) it is taken as unchecked."""
    try:
        with zipfile.ZipFile(_Slice(f, offset, length)) as z:
            for rec in z.infolist():
                if rec.CRC == 0 and not strict and rec.file_size:
                    continue
                with z.open(rec) as r:
                    while r.read(CHUNK):
                        pass
    except OSError:
        raise  # the file could not be read: not a verdict on its bytes
    except Exception as e:  # noqa: BLE001 - BadZipFile, or whatever a damaged header leads zipfile to
        return one_line(e)
    return None


class _Slice(io.RawIOBase):
    """A read-only window [offset, offset+length) of an open file, seekable (zipfile seeks)."""

    def __init__(self, f: Any, offset: int, length: int) -> None:
        super().__init__()
        self.f, self.offset, self.length, self.pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self.pos, os.SEEK_END: self.length}[whence]
        self.pos = max(0, base + pos)
        return self.pos

    def readinto(self, b: Any) -> int:
        n = min(len(b), self.length - self.pos)
        if n <= 0:
            return 0
        self.f.seek(self.offset + self.pos)
        got = self.f.readinto(memoryview(b)[:n]) or 0
        self.pos += got
        return got


# ---------------------------------------------------------------- DCP's metadata and reader, restricted

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


def load_metadata(f: Any) -> Any:
    metadata = _MetadataUnpickler(f).load()
    from torch.distributed.checkpoint.metadata import Metadata

    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError(f"it holds {type(metadata).__name__}, not DCP's Metadata")
    return metadata


def reader(path: str) -> Any:
    """DCP's FileSystemReader, reading .metadata with the restricted unpickler."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            with open(Path(str(self.path)) / ".metadata", "rb") as f:
                metadata = load_metadata(f)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return Reader(path)


def planner() -> Any:
    """DCP's load planner, but values that are not tensors load with weights_only=True."""
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._nested_dict import set_element

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return Planner()


# ---------------------------------------------------------------- does it fit this run

def has_extra(metadata: Any, name: str) -> bool:
    prefix = f"extras.{name}"
    return any(k == prefix or k.startswith(prefix + ".") for k in metadata.state_dict_metadata)


def drop_states_not_saved(target: Dict[str, Any], metadata: Any) -> None:
    """Optimizer state the checkpoint does not have for a parameter (one that never had a
    gradient when it was written) is state this run must not have either."""
    prefix = "optim.state."
    saved = {k[len(prefix):].rsplit(".", 1)[0] for k in metadata.state_dict_metadata if k.startswith(prefix)}
    states = (target.get("optim") or {}).get("state") or {}
    for fqn in [f for f in states if f not in saved]:
        del states[fqn]


# Fields ftrun added to its own registered state after checkpoints were written without them
# (ft.DataLoader's dataset fingerprint); their readers take a default when one is missing.
ADDED_FIELDS = ("fingerprint",)


def drop_fields_added_since(target: Dict[str, Any], metadata: Any) -> None:
    """A checkpoint an earlier ftrun wrote lacks the fields added to ftrun's own state since: they
    are left out of what is loaded, so the checkpoint still fits (the loader keeps its own)."""
    saved = metadata.state_dict_metadata
    for name, sd in (target.get("extras") or {}).items():
        if name.startswith("ftrun.") and isinstance(sd, dict) and has_extra(metadata, name):
            for field in [f for f in ADDED_FIELDS if f in sd and f"extras.{name}.{f}" not in saved]:
                del sd[field]


def optimizer_names(optimizers: List[Any]) -> List[str]:
    return [f"{type(o).__module__}.{type(o).__qualname__}" for o in optimizers]


def other_optimizer(info: Dict[str, Any], optimizers: List[Any]) -> Optional[str]:
    """Why the checkpoint's optimizers are not this run's (their classes), or None. Adam and
    AdamW hold the same tensors, and a resume would quietly hand one the other's settings
    (AdamW's decoupled weight decay among them). Checkpoints that do not say are not judged."""
    saved = info.get("optimizers")
    if not isinstance(saved, list):
        return None
    mine = optimizer_names(optimizers)
    if saved == mine:
        return None
    short = lambda names: ", ".join(n.rsplit(".", 1)[-1] for n in names) or "none"  # noqa: E731
    return f"it was written with optimizer {short(saved)}, this run uses {short(mine)}"


def misfit(target: Dict[str, Any], metadata: Any, extras: Dict[str, Any]) -> Optional[str]:
    """The first difference between this run's state and the checkpoint's (names, shapes,
    dtypes; tensors or not), in words; None if it fits. Registered extra state present on
    only one side is not a misfit (it is said when loading)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    flat, _ = flatten_state_dict(target)
    saved = metadata.state_dict_metadata
    both = {n for n in extras if has_extra(metadata, n)}

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


def one_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    name = type(e).__name__
    if not lines:
        return name
    # KeyError(<class 'type'>) reads "<class 'type'>" alone: the kind of error says what it was.
    return first_line(lines[0] if lines[0].startswith(name) else f"{name}: {lines[0]}")
