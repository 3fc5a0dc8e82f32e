"""A member's store protocol for quorums: asking to join, finding the quorum to enter, the round
at which every member begins a quorum, who of a quorum is gone, and waiting out a state
transfer. Plain functions of a store (the TCPStore calls ftrun uses) and, where they wait, a
`sleep` and a poll period: the worker's manager (ft/manager.py) calls them with the real store
and time.sleep, the simulator (scripts/simulate.py) with its own store and virtual clock, so
both run exactly this code. Must never import torch, read a clock or the environment, or exit
the process: it returns what it found and the caller acts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple

from ftrun import keys
from ftrun.wire import Quorum

Member = Tuple[int, int]  # (global rank, incarnation)


def _text(raw: Any) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


# A value no key of ftrun's ever holds: compare_set with it as both the expected and the new value
# reads a key without creating it (read_now).
_ABSENT = "\x00absent"


def read_now(store: Any, key: str) -> Optional[str]:
    """`key`'s value, or None when it is not there, in one store call that never waits: a get of a
    missing key waits for the store's whole timeout, and a key a check found may be deleted before
    the get that follows (a spare withdraws its ask so)."""
    raw = _text(store.compare_set(key, _ABSENT, _ABSENT))
    return None if raw == _ABSENT else raw


def read_quorum(store: Any, quorum_id: int) -> Quorum:
    return Quorum.from_json(store.get(keys.quorum_key(quorum_id)))


def started_quorum_with_me(store: Any, me: Member, latest: int) -> Optional[Tuple[int, int]]:
    """(quorum, round) of the newest quorum that lists this incarnation and that the others have
    entered, or None. Not simply the newest quorum: members enter quorums by their votes and may
    still be in an older one that lists us, and they cannot leave it without our vote."""
    for e in range(latest, 0, -1):
        # An old quorum's key may be gone (the keeper deletes quorums nobody is in): a get
        # would wait for it for the store's whole timeout, deaf to newer quorums meanwhile.
        if not store.check([keys.quorum_key(e)]):
            return None
        quorum = read_quorum(store, e)
        if me not in quorum.members:
            return None  # older quorums were published before we asked to join
        if quorum.start_round >= 0:
            return e, quorum.start_round
        if store.check([keys.start_key(e)]):
            return e, int(store.get(keys.start_key(e)))
    return None


@dataclass(frozen=True)
class Entry:
    """Where a joining member goes: the quorum and round to enter (with the newest quorum seen
    then), or the step at which the run finished while it was joining (`finished`)."""

    quorum: int = 0
    round: int = 0
    latest: int = 0
    finished: Optional[int] = None
    moved: bool = False  # the store holds no keeper's word, and the run's store moved elsewhere


def wait_to_enter(store: Any, me: Member, sleep: Callable[[float], None], poll_s: float,
                  moved: Callable[[], bool] = lambda: False) -> Entry:
    """Ask the keeper to take this incarnation in, and wait for a started quorum that lists it
    (or for the run's end). Bounded by the keeper: it publishes a quorum, or the run ends. On a
    store where no keeper ever wrote (no LATEST) it also asks `moved()` (the node's word of a newer
    run's store), and gives up when it says so: it is not the run's store."""
    store.set(keys.join_key(me[0]), str(me[1]))
    while True:
        if store.check([keys.FINISHED]):
            return Entry(finished=int(store.get(keys.FINISHED)))
        if not store.check([keys.LATEST]):
            if moved():
                return Entry(moved=True)
            sleep(poll_s)
            continue
        latest = int(store.get(keys.LATEST))
        found = started_quorum_with_me(store, me, latest)
        if found is not None:
            return Entry(found[0], found[1], latest)
        sleep(poll_s)


def finished_step(store: Any) -> Optional[int]:
    """The run's final step once a member has left the loop (keys.FINISHED), else None."""
    return int(store.get(keys.FINISHED)) if store.check([keys.FINISHED]) else None


def entry_round(store: Any, quorum: Quorum, current: int) -> int:
    """The round at which a continuing member (one coming from another quorum) begins `quorum`.
    A quorum the keeper started afresh (nobody had entered one when it was published) names its
    start round. Otherwise the first member to enter writes its round and the others take that
    one: continuing members may come from different quorums at different rounds (each left its
    own by its own votes), and on their own rounds they would form groups and vote where the
    others never come."""
    if quorum.start_round >= 0:
        return quorum.start_round
    return int(_text(store.compare_set(keys.start_key(quorum.id), "", str(current))))


def gone(store: Any, quorum: Quorum, ranks: List[int]) -> Optional[str]:
    """Why the group of `ranks` of `quorum` cannot form (some of them are not the incarnation the
    quorum lists: dead, or restarted), or None."""
    alive = [_text(v) for v in store.multi_get([keys.inc_key(r) for r in ranks])]
    lost = [r for r, v in zip(ranks, alive) if v != str(quorum.incarnation(r))]
    return f"ranks {lost} of quorum {quorum.id} are gone" if lost else None


def await_transfer(store: Any, quorum: Quorum, ends: List[int], done_key: str, sleep: Callable[[float], None],
                   poll_s: float) -> bool:
    """A member that neither sends nor receives a state transfer waits for it to end (True), or
    for one of its ends to die (False: the round fails and the next quorum moves on)."""
    watch = [keys.inc_key(r) for r in ends]
    expected = [str(quorum.incarnation(r)) for r in ends]
    while not store.check([done_key]):
        if [_text(v) for v in store.multi_get(watch)] != expected:
            return False
        sleep(poll_s)
    return True
