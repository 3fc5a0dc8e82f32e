"""The checkpoint folder's names, and which folders a resume tries, in which order. Without torch,
so that the simulator's checkpointer (ftrun/sim) lists its folders by this very rule.
Must never import torch, and never touch the disk.
"""

from __future__ import annotations

import re
from typing import Iterable, List, Tuple

STEP_DIR = re.compile(r"step-(\d+)")
PARTIAL_DIR = re.compile(r"\.step-(\d+)\.[A-Za-z0-9._-]+\.partial")


def step_name(step: int) -> str:
    """The folder of a published checkpoint of `step`."""
    return f"step-{step}"


def partial_name(step: int, run_id: str) -> str:
    """The folder a save of `step` is written in, until one rename publishes it whole (step_name)."""
    return f".step-{step}.{run_id or 'run'}.partial"


def resume_order(names: Iterable[str]) -> List[Tuple[int, str]]:
    """(step, name) of every published checkpoint among the folder's `names`, newest first: the order
    a resume tries them in, the first whole and readable one being the run's state. A save is
    published only once written whole: a partial folder is never tried, all or nothing."""
    found = []
    for name in names:
        m = STEP_DIR.fullmatch(name)
        if m:
            found.append((int(m.group(1)), name))
    return sorted(found, reverse=True)
