"""Process-level settings shared by every worker process, however it was started.

Linux's parent-death signal (so a worker never outlives the process that
started it), the child subreaper (so what a worker leaves behind stays under ftrun), the signal that asks a worker to dump its Python stacks, and the
process titles that make workers findable by name in ps, top and pgrep -f.
Must never import torch or anything from the supervisor.
"""

from __future__ import annotations

import os
from typing import List

# DUMP_STACKS_SIGNAL: the bootstrap installs faulthandler on it.
from ftrun.exits import DUMP_STACKS_SIGNAL, EXIT_FAILED  # noqa: F401
# The prctl calls live in ftrun.prctl (the supervisor makes them too); the zygote imports them from here.
from ftrun.prctl import become_subreaper, set_parent_death_signal  # noqa: F401


def exit_if_orphaned(expected_parent: int) -> None:
    """Close the race between fork and prctl: the parent may already be gone."""
    if os.getppid() != expected_parent:
        os._exit(EXIT_FAILED)


def set_title(title: str) -> None:
    """What ps, top, pgrep -f and psutil show for this process (best effort: a title is a nicety)."""
    try:
        from setproctitle import setproctitle
    except ImportError:
        return
    setproctitle(title)


def worker_title(rank: str, argv: List[str]) -> str:
    """`ftrun[rank 3] python train.py --lr 0.1`: the script and arguments as the user typed them."""
    return f"ftrun[rank {rank}] python {' '.join(argv)}"
