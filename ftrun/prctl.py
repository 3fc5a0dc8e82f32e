"""What ftrun asks of Linux's prctl() for its processes, from either side.

The parent-death signal (a worker never outlives the process that started it) and
the child subreaper (what a worker leaves behind is reparented to ftrun, not to
init). The supervisor and the zygote are subreapers, every worker has the signal:
both sides call these, so they live outside both. Must never import anything of
ftrun's, nor torch; on another system each call does nothing.
"""

from __future__ import annotations

import ctypes
import signal

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def set_parent_death_signal(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send `sig` to this process when its parent dies."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: nothing to do
        pass


def become_subreaper() -> None:
    """Orphaned descendants (a worker's child that called setsid() and outlived it) are
    reparented to this process instead of init, so they stay findable and killable."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: orphans go to init, as before
        pass
