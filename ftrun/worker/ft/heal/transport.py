"""Training state from one replica to the replicas that heal, over a process group.

The source broadcasts, over a group of itself and the healers, first a small
skeleton (the state with every tensor replaced by its index, and each
tensor's shape, dtype and device kind), then the bytes of every tensor:
large tensors straight from and into their own storage in slices of at most
`chunk` bytes, small ones packed into one staging buffer of at most `chunk`
bytes. A healer receives into its own tensors in place wherever it already
has one of the right shape and dtype (the model's parameters and buffers,
an optimizer that already has state) and allocates the rest once, at its
final size: the extra memory on either side is one staging buffer, never a
second copy of the model. Several healers are served by the same broadcast.
A DTensor (a shard of a sharded replica) travels as its local tensor: each
worker sends and receives its own shard, into the healer's own shard.
The skeleton is loaded with weights_only=True.
Must never put training state in the store, and never import the supervisor.
"""

from __future__ import annotations

import collections
import io
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from ftrun.wire import first_line
from ftrun.worker.ft.member.group import settle

CHUNK_BYTES = 64 << 20
_SLOT = "__ftrun_tensor__"

Path = Tuple[Any, ...]


def _children(spec: pytree.TreeSpec) -> List[pytree.TreeSpec]:
    return spec.children() if callable(getattr(spec, "children", None)) else spec.children_specs


class StateMismatch(RuntimeError):
    """The state a peer sent cannot be taken here (its header does not load, or its tensors
    do not fit this replica's model and optimizer): no retry will change that."""


@dataclass
class TransferStats:
    bytes: int = 0
    seconds: float = 0.0
    in_place: int = 0      # tensors received straight into the healer's own storage
    allocated: int = 0     # tensors the healer had to allocate (e.g. a fresh optimizer's state)

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's own shard (its storage, not a copy); any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        with torch.no_grad():
            return t.to_local()
    return t


def _key(entry: Any) -> Any:
    """A pytree key entry as the plain key or index it stands for."""
    for attr in ("key", "idx", "name"):  # MappingKey, SequenceKey, GetAttrKey (a namedtuple's field)
        if hasattr(entry, attr):
            return getattr(entry, attr)
    return entry


def tensor_leaves(obj: Any, root: Path = ()) -> List[Tuple[Path, torch.Tensor]]:
    """Every tensor in `obj` (nested containers) with its path of plain keys and indices below `root`."""
    leaves, _ = pytree.tree_flatten_with_path(obj)
    return [(root + tuple(_key(k) for k in kp), v) for kp, v in leaves if isinstance(v, torch.Tensor)]


def _wire_spec(spec: pytree.TreeSpec) -> pytree.TreeSpec:
    """The same tree in the containers a skeleton travels in (dict, list, tuple), which
    weights_only loads: an OrderedDict or defaultdict goes as a dict, a namedtuple or
    torch.Size as a tuple, a deque as a list."""
    if spec.is_leaf():
        return spec
    children = [_wire_spec(c) for c in _children(spec)]
    kind = spec.type
    if kind is dict or kind is collections.OrderedDict:
        return pytree.TreeSpec(dict, list(spec.context), children)
    if kind is collections.defaultdict:
        return pytree.TreeSpec(dict, list(spec.context[1]), children)
    if kind is list or kind is collections.deque:
        return pytree.TreeSpec(list, None, children)
    if kind is tuple or kind is collections.namedtuple or (isinstance(kind, type) and issubclass(kind, tuple)):
        return pytree.TreeSpec(tuple, None, children)
    return pytree.TreeSpec(kind, spec.context, children)  # another registered container: as it is


def _flatten(obj: Any) -> Tuple[Any, List[torch.Tensor]]:
    """The skeleton of `obj` (each tensor replaced by a slot naming its index in the list), and
    its tensors, in slot order, as they travel."""
    leaves, spec = pytree.tree_flatten(obj)
    tensors: List[torch.Tensor] = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            t = _local(leaf)
            # Sparse (or other non-strided) tensors travel dense: bytes are sent, not layouts.
            tensors.append(t if t.layout == torch.strided else t.to_dense())
            leaves[i] = {_SLOT: len(tensors) - 1}
    return pytree.tree_unflatten(leaves, _wire_spec(spec)), tensors


def _is_slot(node: Any) -> bool:
    return type(node) is dict and len(node) == 1 and _SLOT in node


def _local_tensors(local: Any) -> Dict[Path, torch.Tensor]:
    """This replica's own tensors by path, each as it receives (a DTensor's own shard)."""
    return {path: _local(t) for path, t in tensor_leaves(local)}


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.rpartition(".")[2], None)
    if not isinstance(dtype, torch.dtype):
        raise StateMismatch(f"a peer sent a tensor of unknown dtype {name!r}")
    return dtype


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's storage (no copy)."""
    return t.reshape(-1).view(torch.uint8)


class _Channel:
    """Broadcasts from group rank 0 over `pg`, staging through one buffer on the group's device."""

    def __init__(self, pg: dist.ProcessGroup, device: torch.device, chunk: int) -> None:
        self.pg, self.device, self.chunk = pg, device, chunk
        self.staging = torch.empty(chunk, dtype=torch.uint8, device=device)
        self.sent = 0

    def bcast(self, t: torch.Tensor) -> None:
        self.pg.broadcast(t, 0).wait()
        self.sent += t.numel() * t.element_size()

    def bcast_bytes(self, view: torch.Tensor) -> None:
        """Broadcast a flat uint8 view in slices of at most `chunk` bytes, in place."""
        for a in range(0, view.numel(), self.chunk):
            self.bcast(view[a:a + self.chunk])


def _direct(t: torch.Tensor, device: torch.device) -> bool:
    return t.is_contiguous() and t.device == device


def _settled(timeout_s: float) -> None:
    # On NCCL a broadcast whose peer died never fails: it never finishes. Every host
    # read of received data, and the end of a transfer, waits with a deadline instead.
    if not settle(timeout_s):
        raise RuntimeError(f"the transfer did not finish within {timeout_s:g} s")


def send_state(pg: dist.ProcessGroup, state: Any, device: torch.device, chunk: int = CHUNK_BYTES,
               after_first_chunk: Optional[Callable[[], None]] = None, timeout_s: float = 10.0) -> TransferStats:
    """Broadcast `state` (nested dicts/lists of tensors and plain values) from this rank (0 of `pg`)."""
    t0 = time.perf_counter()
    skel, flat = _flatten(state)
    meta = [(str(t.dtype), tuple(t.shape), t.device.type) for t in flat]
    buf = io.BytesIO()
    torch.save({"skeleton": skel, "meta": meta}, buf)
    head = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
    ch = _Channel(pg, device, chunk)
    ch.bcast(torch.tensor([head.numel()], dtype=torch.int64, device=device))
    ch.bcast_bytes(head.to(device))
    hook = after_first_chunk

    def tick() -> None:
        nonlocal hook
        if hook is not None:
            h, hook = hook, None
            h()

    used = 0
    pending: List[torch.Tensor] = []

    def flush() -> None:
        nonlocal used
        if used:
            ch.bcast(ch.staging[:used])
            tick()
        used = 0
        pending.clear()

    for t in flat:
        n = t.numel() * t.element_size()
        if n == 0:
            continue
        if n > chunk // 4 and _direct(t, device):
            flush()
            ch.bcast_bytes(_bytes_of(t.detach()))
            tick()
            continue
        src = _bytes_of(t.detach().contiguous())
        for a in range(0, n, chunk):
            piece = src[a:a + chunk]
            if used + piece.numel() > chunk:
                flush()
            ch.staging[used:used + piece.numel()].copy_(piece)
            used += piece.numel()
    if used and hook is not None:
        tick()  # the whole state in one chunk: `after_first_chunk` holds the transfer open before it, not after its end
    flush()
    _settled(timeout_s)
    return TransferStats(bytes=ch.sent, seconds=time.perf_counter() - t0)


def receive_state(pg: dist.ProcessGroup, local: Any, device: torch.device, chunk: int = CHUNK_BYTES,
                  on_write: Optional[Callable[[], None]] = None,
                  timeout_s: float = 10.0) -> Tuple[Any, TransferStats, set]:
    """Receive the state the source broadcasts; tensors land in `local`'s tensors where they fit.

    Returns (state, stats, paths received in place). `on_write` is called before the
    first byte is written into a tensor of `local` (the caller's model is changed from then on).
    """
    t0 = time.perf_counter()
    ch = _Channel(pg, device, chunk)
    size = torch.zeros(1, dtype=torch.int64, device=device)
    ch.bcast(size)
    _settled(timeout_s)
    n = int(size.item())
    if not 0 < n < (1 << 34):
        raise RuntimeError(f"ftrun.ft: a peer announced a state header of {n} bytes")
    head = torch.empty(n, dtype=torch.uint8, device=device)
    ch.bcast_bytes(head)
    _settled(timeout_s)
    try:
        header = torch.load(io.BytesIO(head.cpu().numpy().tobytes()), weights_only=True)
    except Exception as e:  # weights_only refused it, or it is not a torch.save stream at all
        raise StateMismatch(f"the state header a peer sent does not load with weights_only=True: "
                            f"{first_line(str(e))}") from None
    skel, meta = header["skeleton"], header["meta"]
    received = _Skeleton(skel, len(meta))
    own = _local_tensors(local)
    stats = TransferStats()
    in_place = set()
    tensors: List[torch.Tensor] = []
    local_cuda = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    for path, (dtype_name, shape, dev_type) in zip(received.paths, meta):
        dtype = _dtype(dtype_name)
        mine = own.get(path)
        if mine is not None and mine.dtype == dtype and tuple(mine.shape) == tuple(shape) and mine.is_contiguous():
            tensors.append(mine.detach())
            in_place.add(path)
            stats.in_place += 1
        else:
            where = local_cuda if dev_type == "cuda" and local_cuda is not None else torch.device("cpu")
            tensors.append(torch.empty(shape, dtype=dtype, device=where))
            stats.allocated += 1
    notified = False
    used = 0
    pending: List[Tuple[torch.Tensor, int, int]] = []  # (dest bytes view, offset in staging, length)

    def flush() -> None:
        nonlocal used, notified
        if used:
            ch.bcast(ch.staging[:used])
            if not notified and on_write is not None:
                notified = True
                on_write()
            for dst, off, length in pending:
                dst.copy_(ch.staging[off:off + length])
        used = 0
        pending.clear()

    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if nbytes == 0:
            continue
        if nbytes > chunk // 4 and _direct(t, device):
            flush()
            if not notified and on_write is not None:
                notified = True
                on_write()
            ch.bcast_bytes(_bytes_of(t))
            continue
        dst = _bytes_of(t)
        for a in range(0, nbytes, chunk):
            piece = dst[a:a + chunk]
            if used + piece.numel() > chunk:
                flush()
            pending.append((piece, used, piece.numel()))
            used += piece.numel()
    flush()
    _settled(timeout_s)
    stats.bytes = ch.sent
    stats.seconds = time.perf_counter() - t0
    return received.fill(tensors), stats, in_place


class _Skeleton:
    """A received skeleton, flattened once: the path of every slot, and the state it fills in."""

    def __init__(self, skel: Any, count: int) -> None:
        self.leaves, self.spec = pytree.tree_flatten_with_path(skel, is_leaf=_is_slot)
        found = {int(v[_SLOT]): tuple(_key(k) for k in kp) for kp, v in self.leaves if _is_slot(v)}
        if sorted(found) != list(range(count)):
            raise StateMismatch("a peer sent a state header whose tensor slots do not match its tensor list")
        self.paths = [found[i] for i in range(count)]  # in slot order (the order the source sent them)

    def fill(self, tensors: List[torch.Tensor]) -> Any:
        return pytree.tree_unflatten([tensors[v[_SLOT]] if _is_slot(v) else v for _, v in self.leaves], self.spec)
