"""One bounded wait on a condition: call a predicate until it holds or a deadline passes.

Every loop of the form "check, sleep a little, check again" goes through
wait_until, so each such wait says its deadline in one place and none can
sleep past it. Time comes in through `clock` and `sleep` (time.monotonic and
time.sleep unless a test gives its own).
This module must never import torch or anything of ftrun (both sides use it),
and never decide what a wait is for: the predicate does.
"""

from __future__ import annotations

import time
from typing import Callable, Optional, TypeVar

T = TypeVar("T")


def wait_until(pred: Callable[[], T], deadline: float, interval: float = 0.05,
               clock: Callable[[], float] = time.monotonic,
               sleep: Callable[[float], None] = time.sleep) -> Optional[T]:
    """Call `pred()` until it returns something true, and return that; None once `deadline`
    (a `clock()` time; math.inf: the predicate alone ends the wait) passes first.

    `pred` runs at least once, and once more at the deadline (a sleep never runs past it);
    its exceptions (and a signal handler's) end the wait."""
    if interval <= 0:
        raise ValueError(f"interval must be > 0 seconds, not {interval}")
    while True:
        got = pred()
        if got:
            return got
        left = deadline - clock()
        if left <= 0:
            return None
        sleep(min(interval, left))
