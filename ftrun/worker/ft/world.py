"""What a script's own `init_process_group()` does under --ft (whole-model replicas).

A group of every worker is formed once, by all of them at the start. A replica
that restarts later cannot join it again: its peers formed it long ago and
never come back to a new one, so the call would wait until torch's timeout
and the replica would never rejoin. ftrun.ft needs no default group. So, on a
worker's first incarnation the call goes through and rank 0 says, once, that
the script should drop it; on a restarted incarnation the call is skipped
with one line, and the replica heals like any other (a later use of the
default group then fails with torch's own "not initialized" error).
Must never skip the call on a first incarnation, and never import the supervisor.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any


def _log(msg: str) -> None:
    sys.stderr.write(f"ftrun.ft: {msg}\n")
    sys.stderr.flush()


def install() -> None:
    """Wrap torch.distributed.init_process_group in a --ft worker whose replica is one worker."""
    import torch.distributed as dist

    real = dist.init_process_group
    rank = os.environ.get("RANK", "?")
    restarted = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") not in ("", "0")

    @functools.wraps(real)
    def init_process_group(*args: Any, **kwargs: Any) -> None:
        world = os.environ.get("WORLD_SIZE", "?")
        if restarted:
            _log(f"rank {rank}: skipped the script's init_process_group(): this replica restarted and cannot join "
                 f"the group of all {world} workers the others formed at the start (remove the call: ftrun.ft "
                 f"needs no default group)")
            return None
        real(*args, **kwargs)
        if rank == "0":
            _log(f"rank 0: the script called init_process_group() over all {world} workers: a replica that restarts "
                 f"cannot join that group again, so ftrun skips the call there and the default group is missing on "
                 f"it (remove the call: ftrun.ft needs no default group)")
        return None

    dist.init_process_group = init_process_group
