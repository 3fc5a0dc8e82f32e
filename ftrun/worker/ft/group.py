"""A process group over the replicas of one epoch, rebuilt whenever membership changes.

Backends are built directly on a PrefixStore of the supervisor's TCPStore
(gloo on CPU, NCCL with GPUs) and wrapped into a ``dist.ProcessGroup`` so that
torch's comm hooks (PowerSGD included) accept them. A broken group is never
repaired: the next round gets a fresh one under a fresh prefix.
Must never raise a collective error into the user's loop (callers check `ok`).
"""

from __future__ import annotations

import datetime
import os
from typing import Optional

import torch
import torch.distributed as dist


def _timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=float(os.environ.get("FTRUN_FT_TIMEOUT", "10")))


def build_group(store: dist.Store, prefix: str, rank: int, size: int) -> dist.ProcessGroup:
    """Connect this replica to the others of an epoch (blocks until all have arrived)."""
    pstore = dist.PrefixStore(prefix, store)
    pg = dist.ProcessGroup(pstore, rank, size)
    if torch.cuda.is_available():
        opts = dist.ProcessGroupNCCL.Options()
        backend = dist.ProcessGroupNCCL(pstore, rank, size, opts)
        kind, dev = dist.ProcessGroup.BackendType.NCCL, torch.device("cuda")
    else:
        backend = dist.ProcessGroupGloo(pstore, rank, size, _timeout())
        kind, dev = dist.ProcessGroup.BackendType.GLOO, torch.device("cpu")
    backend._set_sequence_number_for_group()
    pg._register_backend(dev, kind, backend)
    pg._set_default_backend(kind)
    return pg


def local_group() -> dist.ProcessGroup:
    """A group of one, for torch DDP's own bookkeeping: replicas talk through the comm hook only."""
    store = dist.HashStore()
    pg = dist.ProcessGroup(store, 0, 1)
    backend = dist.ProcessGroupGloo(store, 0, 1, _timeout())
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    if torch.cuda.is_available():
        nccl = dist.ProcessGroupNCCL(dist.PrefixStore("nccl/", store), 0, 1, dist.ProcessGroupNCCL.Options())
        pg._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.NCCL, nccl)
        pg._set_default_backend(dist.ProcessGroup.BackendType.NCCL)
    else:
        pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    return pg


class EpochGroup:
    """The current group, or None while it could not be built."""

    def __init__(self) -> None:
        self.pg: Optional[dist.ProcessGroup] = None
        self.size = 0
        self.rank = 0
