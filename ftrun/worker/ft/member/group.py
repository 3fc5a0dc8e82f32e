"""A process group over the replicas of one quorum, rebuilt whenever membership changes.

Backends are built directly on a PrefixStore of the supervisor's TCPStore
(gloo on CPU, NCCL with GPUs) and wrapped into a ``dist.ProcessGroup`` so that
torch's comm hooks (PowerSGD included) accept them. Every backend gets
ftrun's timeout (FTRUN_FT_TIMEOUT, 10 s), never torch's 10-minute default. A
broken group is never repaired: it is aborted (NCCL: the communicator, so no
kernel waits on a dead peer; gloo: its connections are shut down, member/lines.py,
so that no operation at either end waits for the timeout) and the next round
gets a fresh one under a fresh prefix.
Must never raise a collective error into the user's loop (callers check `ok`).
"""

from __future__ import annotations

import atexit
import datetime
import threading
import weakref
from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from ftrun.worker import settings
from ftrun.worker.ft.member.lines import GlooLines


# Every NCCL backend this process built and has not aborted yet, aborted at exit: torch warns
# at exit about each communicator nobody shut down ("destroy_process_group() was not called"),
# and these groups are ftrun's, not the script's, so the script cannot destroy them. An aborted
# backend leaves the list (abort_group), so a long run's rebuilt groups can be freed.
_NCCL: List[Any] = []


def _abort_nccl_at_exit() -> None:
    for backend in _NCCL:
        try:
            backend.abort()
        except Exception:
            pass


# Each gloo group's connections (member/lines.py), while the group lives.
_LINES: "weakref.WeakKeyDictionary[dist.ProcessGroup, GlooLines]" = weakref.WeakKeyDictionary()


def _nccl(backend: Any) -> Any:
    if not _NCCL:
        atexit.register(_abort_nccl_at_exit)
    _NCCL.append(backend)
    return backend


def _timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=settings.current().ft_timeout_s)


def _gloo(pstore: dist.Store, rank: int, size: int) -> Tuple[Any, Optional[GlooLines]]:
    """A gloo backend on a device of its own, and its lines (None: it cannot be hung up)."""
    gloo = dist.ProcessGroupGloo
    # The device torch's own constructor would make: GLOO_SOCKET_IFNAME's interface, else the
    # host's. Several interfaces are several devices, whose lines are not told apart: torch's own.
    names = settings.current().gloo_interfaces
    if len(names) > 1 or not (hasattr(gloo, "create_device") and hasattr(gloo, "_Options")):
        return gloo(pstore, rank, size, _timeout()), None
    device, lines = GlooLines.device(lambda: gloo.create_device(interface=names[0]) if names
                                     else gloo.create_default_device())
    opts = gloo._Options()
    opts._devices = [device]
    opts._timeout = _timeout()
    if lines is not None:
        lines.publish(pstore, rank)  # before connecting: every peer finds it once the group is out
    backend = gloo(pstore, rank, size, opts)
    try:
        if lines is not None and not lines.connected(pstore, rank, size):
            lines = None
    except Exception:  # noqa: BLE001 - the store moved meanwhile: the group is of no use, and waits as gloo's do
        lines = None
    return backend, lines


def build_group(store: dist.Store, prefix: str, rank: int, size: int) -> dist.ProcessGroup:
    """Connect this replica to the others of a quorum (blocks until all have arrived)."""
    pstore = dist.PrefixStore(prefix, store)
    pg = dist.ProcessGroup(pstore, rank, size)
    lines = None
    if torch.cuda.is_available():
        opts = dist.ProcessGroupNCCL.Options()
        # Twice ftrun's own deadline (settle): ftrun aborts a stuck round first, before
        # NCCL's watchdog would tear the whole process down.
        opts._timeout = 2 * _timeout()
        backend = _nccl(dist.ProcessGroupNCCL(pstore, rank, size, opts))
        kind, dev = dist.ProcessGroup.BackendType.NCCL, torch.device("cuda")
    else:
        backend, lines = _gloo(pstore, rank, size)
        kind, dev = dist.ProcessGroup.BackendType.GLOO, torch.device("cpu")
    # No _set_sequence_number_for_group(): a fresh gloo/NCCL backend starts its sequence at 0
    # already, and torch 2.14 deprecated the call, printing a warning on every rank.
    pg._register_backend(dev, kind, backend)
    pg._set_default_backend(kind)
    if lines is not None:
        _LINES[pg] = lines
    return pg


def build_group_watched(store_addr: str, prefix: str, rank: int, size: int,
                        gone: Callable[[], Optional[str]], poll_s: float = 0.005) -> dist.ProcessGroup:
    """build_group, given up at once when `gone()` names a reason (a member died), instead of
    waiting for the formation's timeout. The formation runs on its own thread and its own
    store connection (a blocked store read holds its connection); a formation given up
    finishes, or times out, on its own and is aborted: peers that formed it too fail their
    first collective on it at once instead of at the timeout."""
    host, _, port = store_addr.rpartition(":")
    box: dict = {}
    lock = threading.Lock()

    def form() -> None:
        try:
            own = dist.TCPStore(host, int(port), None, False, _timeout())
            pg = build_group(own, prefix, rank, size)
        except Exception as e:
            box["error"] = e
            return
        with lock:
            given_up = box.get("given up", False)
            if not given_up:
                box["pg"] = pg
        if given_up:
            abort_group(pg)

    t = threading.Thread(target=form, name="ftrun-group", daemon=True)
    t.start()
    while True:
        t.join(poll_s)
        if not t.is_alive():
            break
        why = gone()
        if why:
            with lock:
                box["given up"] = True
                late = box.pop("pg", None)  # formed in the meantime
            abort_group(late)
            raise RuntimeError(why)
    if "error" in box:
        raise box["error"]
    return box["pg"]


def group_device() -> torch.device:
    """Where the tensors a group of build_group() carries must live."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def abort_group(pg: Optional[dist.ProcessGroup]) -> None:
    """Tear a group down at once, here and at its peers. On NCCL this aborts the communicator,
    so no kernel stays queued behind a collective that a dead peer will never finish; on gloo
    it shuts the group's connections down (member/lines.py): every operation on it fails at
    once at both ends, whatever still holds the group or a Work of it. Safe from any thread."""
    if pg is None:
        return
    hang_up(pg)
    for dev in ("cuda", "cpu"):
        try:
            backend = pg._get_backend(torch.device(dev))
        except Exception:
            continue
        try:
            backend.abort()
        except Exception:
            pass
        if any(b is backend for b in _NCCL):
            _NCCL[:] = [b for b in _NCCL if b is not backend]


def hang_up(pg: Optional[dist.ProcessGroup]) -> None:
    """Shut a gloo group's connections down (member/lines.py), leaving the group itself to its
    holders: every operation on it then fails at once, here and at every peer, so a member blocked
    on this one (a ring all-reduce waits on its neighbours only) stops waiting now, not when this
    member drops the group or at the timeout. Nothing on NCCL or where the lines are unknown.
    Safe from any thread, and more than once."""
    lines = _LINES.get(pg) if pg is not None else None
    if lines is not None:
        lines.hang_up()


def settle(timeout_s: float) -> bool:
    """Wait, at most `timeout_s`, for the work queued on this process's GPU stream
    (the round's NCCL collectives) to finish; False if it did not. Without a GPU
    collectives complete on the host and there is nothing to wait for."""
    if not torch.cuda.is_available():
        return True
    import time

    ev = torch.cuda.Event()
    ev.record()
    deadline = time.monotonic() + timeout_s
    while not ev.query():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.0002)
    return True


def local_group() -> dist.ProcessGroup:
    """A group of one, for torch DDP's own bookkeeping: replicas talk through the comm hook only."""
    store = dist.HashStore()
    pg = dist.ProcessGroup(store, 0, 1)
    backend = dist.ProcessGroupGloo(store, 0, 1, _timeout())
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    if torch.cuda.is_available():
        nccl = _nccl(dist.ProcessGroupNCCL(dist.PrefixStore("nccl/", store), 0, 1, dist.ProcessGroupNCCL.Options()))
        pg._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.NCCL, nccl)
        pg._set_default_backend(dist.ProcessGroup.BackendType.NCCL)
    else:
        pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    return pg

