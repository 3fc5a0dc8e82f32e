"""Under --ft a replica (its K workers) fails, stops and restarts as one: which of its workers are
stopped with the one that failed, and the incarnation its restart starts them with. Pure rules
of what the worker table knows, called by the table (ftrun.supervisor.loop.table) and by the
simulator's supervisor alike, so both carry out one rule.
Must never signal, start or record a process: the table does that with the answers.
"""

from __future__ import annotations

from typing import Callable, Iterable, List


def ranks_of(replica: int, k: int) -> range:
    """The global ranks of replica `replica` of K workers each (consecutive: rank // K is the replica)."""
    return range(replica * k, replica * k + k)


def stopped_with(replica: int, k: int, failed: int, runs: Callable[[int], bool]) -> List[int]:
    """The workers to SIGKILL at once when `failed`, a worker of `replica`, has failed: every other
    worker of the replica that still runs (nothing of theirs is worth a grace, and a collective
    with their dead peer would hold them, NCCL included)."""
    return [r for r in ranks_of(replica, k) if r != failed and runs(r)]


def next_incarnation(incarnations: Iterable[int]) -> int:
    """The incarnation a restarted replica's workers all start with: one past the newest any of
    them had (one booked in place by a rejoin included), so that no report or vote of an older
    process can pass for one of the new."""
    return max(incarnations) + 1
