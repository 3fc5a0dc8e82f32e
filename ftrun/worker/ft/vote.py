"""One replica's vote on one round of --ft: a counter and a decision in the store.

Each member adds OK_VOTE or FAIL_VOTE to the round's counter; the add that
completes the count closes the round and its author writes the decision
(compare_set: the first decision written is the decision), which the others
read. One round trip to add, one blocking read for everyone but the closer,
O(1) store work per member. `cast` does it in the caller's thread (a failed
round, and scripts/bench_quorum.py with thousands of clients); a `Ballot`
does it on a thread of its own with its own connection, so that a replica
whose collectives succeeded steps at once and reads the decision a step
later. Must never import torch beyond its store type, and never decide
anything but the round it is given.
"""

from __future__ import annotations

import os
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable, Optional, Tuple

from ftrun import protocol as keys

Decision = Tuple[bool, int, bool]  # (commit, the newest epoch its author had seen, whether this vote closed it)


def cast(store: Any, epoch: int, rnd: int, size: int, ok: bool, latest_seen: int) -> Decision:
    """Vote on round `rnd` of `epoch` (of `size` members) and wait for its decision."""
    t = keys.tally(store.add(keys.count_key(epoch, rnd), keys.OK_VOTE if ok else keys.FAIL_VOTE))
    if t.votes == size:
        # compare_set, not set: if this process had died right after its add, the supervisor
        # would have closed the round; whichever decision is written first is the one.
        mine = f"{'commit' if t.commit else 'fail'} {latest_seen}"
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


NICER = 5


def _yield_to_training() -> None:
    """Lower this thread's scheduling priority a little (Linux: per thread). Woken by each
    step's vote, it would otherwise take a core from the training thread at once on a busy
    machine (the tiny model's step measured 2% faster); its decision is needed a forward
    pass later, not now."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + NICER)
    except (AttributeError, OSError):  # not Linux, or not allowed: the default priority works too
        pass


class Ballot:
    """Ok votes cast off the training thread, one round at a time: `submit` returns at once,
    `ready` says whether the decision is in, `result` waits for it (raising what the store
    raised). One daemon thread rather than a ThreadPoolExecutor, whose worker threads the
    interpreter joins at exit: a worker leaving with a vote in flight would wait for its
    decision (up to the vote timeout) instead of exiting."""

    def __init__(self, connect: Callable[[], Any]) -> None:
        self._connect = connect
        self._jobs: "queue.SimpleQueue[Tuple[Future, Tuple[int, int, int, int]]]" = queue.SimpleQueue()
        self._pending: Optional[Future] = None
        self.round: Optional[Tuple[int, int]] = None  # (epoch, round) of the vote in flight
        self._thread: Optional[threading.Thread] = None

    def submit(self, epoch: int, rnd: int, size: int, latest_seen: int) -> None:
        if self.round is not None:
            raise RuntimeError("a vote is already in flight")
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ftrun-vote", daemon=True)
            self._thread.start()
        self.round = (epoch, rnd)
        self._pending = Future()
        self._jobs.put((self._pending, (epoch, rnd, size, latest_seen)))

    def ready(self) -> bool:
        return self._pending is not None and self._pending.done()

    def result(self) -> Decision:
        fut, self._pending, self.round = self._pending, None, None
        assert fut is not None, "no vote in flight"
        return fut.result()

    def _run(self) -> None:
        _yield_to_training()
        store = None
        while True:
            fut, (epoch, rnd, size, latest) = self._jobs.get()
            try:
                if store is None:
                    store = self._connect()
                fut.set_result(cast(store, epoch, rnd, size, True, latest))
            except BaseException as e:  # handed to the training thread, which decides what it means
                fut.set_exception(e)
