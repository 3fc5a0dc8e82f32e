"""One replica's vote on one round of --ft: a counter and a decision in the store.

Each member adds OK_VOTE or FAIL_VOTE to the round's counter; the add that
completes the count closes the round and its author writes the decision
(compare_set: the first decision written is the decision), which the others
read. One round trip to add, one blocking read for everyone but the closer,
O(1) store work per member. `cast` does it in the caller's thread (a failed
round, and scripts/bench_quorum.py with thousands of clients); a `Ballot`
does it on a thread of its own with its own connection, so that a replica
whose collectives succeeded steps at once and reads the decision a step
later. On several nodes a member votes through its node (`Node`, see
keys.node_count_key): its add and its read of the decision are local
round trips, and the node's last voter forwards the node's count to the
run's store, so the run's store does O(1) work per node and round. Must never
import torch beyond its store type, and never decide anything but the round
it is given.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional, Tuple

from ftrun import keys, votes

# (commit, the newest quorum its author had seen, whether this vote closed it, the steps of the
# round that stand: None for all of them; see keys.kept_key)
Decision = Tuple[bool, int, bool, Optional[int]]


class StoreMovedMidVote(Exception):
    """The node's ftrun wrote that the run's store moved while this member waited for a decision
    its node's forwarder could no longer fetch, or waited to join on a store at the old address
    (member/moves.py): the member follows the store, as after a failed call."""


class Node:
    """The node a member votes through: its id, the global ranks it runs, and a client of its store."""

    def __init__(self, node: int, first: int, count: int, store: Any) -> None:
        self.id, self.first, self.count, self.store = node, first, count, store

    @staticmethod
    def from_env(connect: Callable[[str], Any]) -> Optional["Node"]:
        """The worker's node from the environment its ftrun set (None: it votes on the run's
        store itself, as on one node). `connect` turns "host:port" into a store client."""
        relayed = keys.relayed_node(os.environ)
        if relayed is None:
            return None
        node, first, count, addr = relayed
        return Node(node, first, count, connect(addr))

    def size(self, members: Any) -> int:
        """How many of a quorum's members ((rank, incarnation) pairs) vote through this node."""
        return sum(1 for r, _ in members if self.first <= r < self.first + self.count)


def _text(raw: Any) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def _close_or_read(store: Any, total: int, added: int, quorum: int, rnd: int, size: int,
                   latest_seen: int, closes: Optional[Callable[[int, int, int], bool]] = None) -> Tuple[str, bool]:
    """After an add of `added` that left the round's counter at `total`: decide the round if
    that add closed it, else wait for its decision. (decision text, whether this add closed it)."""
    t = votes.tally(total)
    if (closes or votes.closes)(total, added, size):
        # compare_set, not set: if this process had died right after its add, the supervisor
        # would have closed the round; whichever decision is written first is the one.
        mine = votes.decision_text(t.commit, latest_seen, 0 if t.commit else votes.read_kept(store, quorum, rnd))
        decision = _text(store.compare_set(keys.decision_key(quorum, rnd), "", mine))
        store.set(keys.TOP, str(rnd))
        return decision, True
    return _text(store.get(keys.decision_key(quorum, rnd))), False


def lower_kept(store: Any, quorum: int, rnd: int, taken: int) -> None:
    """Lower the round's kept count to `taken` (a failed member's steps in it), before the vote:
    compare_set in a loop, so concurrent failed members leave the lowest of their counts."""
    key, want = keys.kept_key(quorum, rnd), str(taken)
    current = _text(store.compare_set(key, "", want))
    while int(current) > taken:
        current = _text(store.compare_set(key, current, want))


def cast(store: Any, quorum: int, rnd: int, size: int, ok: bool, latest_seen: int,
         node: Optional[Node] = None, node_size: int = 0, taken: int = 0,
         closes: Optional[Callable[[int, int, int], bool]] = None) -> Decision:
    """Vote on round `rnd` of `quorum` (of `size` members) and wait for its decision; through
    `node` (of whose members `node_size` are in the quorum) when the member has one. A failed
    member says how many of the round's steps it had `taken` (in the run's store, before its vote).
    `closes`: whether an add completed a count (votes.closes; the simulator's historic bugs
    pass another)."""
    if not ok:
        lower_kept(store, quorum, rnd, taken)
    vote = votes.OK_VOTE if ok else votes.FAIL_VOTE
    if node is None:
        decision, closed = _close_or_read(store, store.add(keys.count_key(quorum, rnd), vote), vote, quorum, rnd,
                                          size, latest_seen, closes)
    else:
        local = node.store
        total = local.add(keys.node_count_key(node.id, quorum, rnd), vote)
        if (closes or votes.closes)(total, vote, node_size):  # the node's last vote: this member forwards its count
            decision, closed = forward(store, local, node.id, quorum, rnd, size, total, latest_seen, closes)
        else:
            decision, closed = _text(local.get(keys.node_decision_key(node.id, quorum, rnd))), False
            if decision == votes.NODE_LOST_DECISION:
                raise StoreMovedMidVote(f"the run's store moved while round {rnd} of quorum {quorum} was being decided")
    commit, target, kept = votes.parse_decision(decision)
    return commit, target, closed, kept


def forward(store: Any, local: Any, node: int, quorum: int, rnd: int, size: int, total: int,
            latest_seen: int, closes: Optional[Callable[[int, int, int], bool]] = None) -> Tuple[str, bool]:
    """Add a node's whole count to the round's counter in the run's store, mark it forwarded, and
    copy the round's decision back into the node's store for its other members."""
    run_total = store.add(keys.count_key(quorum, rnd), total)
    local.set(keys.node_forwarded_key(node, quorum, rnd), "1")
    decision, closed = _close_or_read(store, run_total, total, quorum, rnd, size, latest_seen, closes)
    local.set(keys.node_decision_key(node, quorum, rnd), decision)
    return decision, closed


class Ballot:
    """Ok votes cast off the training thread, one round at a time: `submit` returns at once,
    `ready` says whether the decision is in, `result` waits for it (raising what the store
    raised). One daemon thread (`spawn`: the member's effects), with its own connection
    (`connect`, `node`), woken by a `signal`: the worker's are real threads and
    threading.Events, the simulator's its scheduler's. A daemon rather than a pool's worker,
    which the interpreter joins at exit: a worker leaving with a vote in flight would wait for
    its decision (up to the vote timeout) instead of exiting."""

    def __init__(self, connect: Callable[[], Any], node: Optional[Callable[[], Optional[Node]]],
                 spawn: Callable[..., None], signal: Callable[[], Any],
                 cast_vote: Optional[Callable[..., Decision]] = None) -> None:
        self._connect = connect
        self._connect_node = node
        self._spawn = spawn
        self._cast = cast_vote or cast
        self._wake, self._done = signal(), signal()
        self._job: Optional[Tuple[int, int, int, int, int]] = None
        self._result: Any = None
        self._started = False
        self.round: Optional[Tuple[int, int]] = None  # (quorum, round) of the vote in flight

    def submit(self, quorum: int, rnd: int, size: int, latest_seen: int, node_size: int = 0) -> None:
        if self.round is not None:
            raise RuntimeError("a vote is already in flight")
        if not self._started:
            self._started = True
            self._spawn(self._run, "ftrun-vote", low_priority=True)
        self.round = (quorum, rnd)
        self._done.clear()
        self._job = (quorum, rnd, size, latest_seen, node_size)
        self._wake.set()

    def ready(self) -> bool:
        return self.round is not None and self._done.is_set()

    def result(self) -> Decision:
        assert self.round is not None, "no vote in flight"
        self._done.wait()
        res, self._result, self.round = self._result, None, None
        if isinstance(res, BaseException):
            raise res
        return res

    def _run(self) -> None:
        store, node = None, None
        while True:
            self._wake.wait()
            self._wake.clear()
            job, self._job = self._job, None
            if job is None:
                continue
            quorum, rnd, size, latest, node_size = job
            try:
                if store is None:
                    store = self._connect()
                    node = self._connect_node() if self._connect_node is not None else None
                self._result = self._cast(store, quorum, rnd, size, True, latest, node, node_size)
            except Exception as e:  # handed to the training thread, which decides what it means
                self._result = e
            self._done.set()
