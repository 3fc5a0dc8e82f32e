"""What a script's own `init_process_group()` and `destroy_process_group()` do under --ft
(whole-model replicas).

A group of every worker is formed once, by all of them at the start. A replica
that restarts later cannot join it again: its peers formed it long ago and
never come back to a new one, so the call would wait until torch's timeout
and the replica would never rejoin. ftrun.ft needs no default group. So, on a
worker's first incarnation the call goes through and rank 0 says, once, that
the script should drop it (a script that imported ftrun.ft: a plain one gets
group restarts, where the call goes through every time); on a restarted
incarnation the call is skipped with one line, and the replica heals like
any other (a later use of the
default group then fails with torch's own "not initialized" error). The
script's `destroy_process_group()` of the group it asked for is then a no-op,
so the pair works on every incarnation. ftrun's own calls (ft.device_mesh())
go to torch's function itself (`torch_init_process_group`), never through this.
The patch is listed, with how to undo it, in ftrun/worker/patches.py.
Must never skip the call on a first incarnation, and never import the supervisor.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable, Optional

from ftrun.worker import patches, settings


def _log(msg: str) -> None:
    sys.stderr.write(f"ftrun.ft: {msg}\n")
    sys.stderr.flush()


_torch_init: Optional[Callable[..., Any]] = None  # torch's own, once install() wrapped it
_skipped = False  # this incarnation skipped the script's call: it has no default group of its own


def torch_init_process_group() -> Callable[..., Any]:
    """torch.distributed.init_process_group itself, for ftrun's own calls."""
    import torch.distributed as dist

    return _torch_init or dist.init_process_group


def install() -> None:
    """Wrap torch.distributed's init_process_group and destroy_process_group in a --ft worker
    whose replica is one worker."""
    global _torch_init
    import torch.distributed as dist

    real = _torch_init = dist.init_process_group
    real_destroy = dist.destroy_process_group
    s = settings.current()
    rank = s.rank_text
    world = "?" if s.world_size is None else str(s.world_size)
    restarted = s.restart_count != 0

    @functools.wraps(real)
    def init_process_group(*args: Any, **kwargs: Any) -> None:
        global _skipped
        if restarted:
            _skipped = True
            _log(f"rank {rank}: skipped the script's init_process_group(): this replica restarted and cannot join "
                 f"the group of all {world} workers the others formed at the start (remove the call: ftrun.ft "
                 f"needs no default group)")
            return None
        real(*args, **kwargs)
        # A script that has not imported ftrun.ft is a plain one: ftrun restarts its whole group
        # (ftrun.supervisor.ft.quorum_view), each incarnation with this call going through.
        if rank == "0" and "ftrun.ft" in sys.modules:
            _log(f"rank 0: the script called init_process_group() over all {world} workers: a replica that restarts "
                 f"cannot join that group again, so ftrun skips the call there and the default group is missing on "
                 f"it (remove the call: ftrun.ft needs no default group)")
        return None

    @functools.wraps(real_destroy)
    def destroy_process_group(group: Any = None) -> None:
        if group is None and _skipped and not dist.is_initialized():
            return None  # the group the script asked for was never made on this incarnation
        return real_destroy(group)

    patches.install("process_group", dist, "init_process_group", init_process_group)
    patches.install("process_group", dist, "destroy_process_group", destroy_process_group)
