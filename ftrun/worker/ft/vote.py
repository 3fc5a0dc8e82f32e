"""One replica's vote on one round of --ft: a counter and a decision in the store.

Each member adds 1 (ok) or FAIL_VOTE (failed) to the round's counter; the add
that completes the count closes the round and its author writes the
decision (compare_set: the first decision written is the decision), which
the others read. One round trip to add, one blocking read for everyone but
the closer, O(1) store work per member. Shared by the
replicas (ft/manager.py) and scripts/bench_quorum.py, which drives it with
thousands of clients. Must never import torch beyond its store type, and
never decide anything but the round it is given.
"""

from __future__ import annotations

from typing import Any, Tuple

from ftrun import protocol as keys


def cast(store: Any, epoch: int, rnd: int, size: int, ok: bool, latest_seen: int) -> Tuple[bool, int, bool]:
    """Vote on round `rnd` of `epoch` (of `size` members); returns (commit, the epoch to be
    in from the next round, whether this vote closed the round)."""
    total = store.add(keys.count_key(epoch, rnd), 1 if ok else keys.FAIL_VOTE)
    votes, fails = keys.tally(total)
    if votes == size:
        # compare_set, not set: if this process had died right after its add, the supervisor
        # would have closed the round as failed; whichever decision is written first is the one.
        mine = f"{'fail' if fails else 'commit'} {latest_seen}"
        raw = store.compare_set(keys.decision_key(epoch, rnd), "", mine)
        decision = raw.decode() if isinstance(raw, bytes) else str(raw)
        store.set(keys.TOP, str(rnd))
        closed = True
    else:
        raw = store.get(keys.decision_key(epoch, rnd))
        decision = raw.decode() if isinstance(raw, bytes) else str(raw)
        closed = False
    what, target = decision.split()
    return what == "commit", int(target), closed
