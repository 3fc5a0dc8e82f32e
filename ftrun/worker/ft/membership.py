"""A member's store protocol for epochs: asking to join, finding the epoch to enter, the round
at which every member begins an epoch, who of an epoch is gone, and waiting out a state
transfer. Plain functions of a store (the TCPStore calls ftrun uses) and, where they wait, a
`sleep` and a poll period: the worker's manager (ft/manager.py) calls them with the real store
and time.sleep, the simulator (scripts/simulate.py) with its own store and virtual clock, so
both run exactly this code. Must never import torch, read a clock or the environment, or exit
the process: it returns what it found and the caller acts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple

from ftrun import protocol as keys
from ftrun.protocol import Epoch

Member = Tuple[int, int]  # (global rank, incarnation)


def _text(raw: Any) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def read_epoch(store: Any, epoch_id: int) -> Epoch:
    return Epoch.from_json(store.get(keys.epoch_key(epoch_id)))


def started_epoch_with_me(store: Any, me: Member, latest: int) -> Optional[Tuple[int, int]]:
    """(epoch, round) of the newest epoch that lists this incarnation and that the others have
    entered, or None. Not simply the newest epoch: members enter epochs by their votes and may
    still be in an older one that lists us, and they cannot leave it without our vote."""
    for e in range(latest, 0, -1):
        # An old epoch's key may be gone (the keeper deletes epochs nobody is in): a get
        # would wait for it for the store's whole timeout, deaf to newer epochs meanwhile.
        if not store.check([keys.epoch_key(e)]):
            return None
        epoch = read_epoch(store, e)
        if me not in epoch.members:
            return None  # older epochs were published before we asked to join
        if epoch.start_round >= 0:
            return e, epoch.start_round
        if store.check([keys.start_key(e)]):
            return e, int(store.get(keys.start_key(e)))
    return None


@dataclass(frozen=True)
class Entry:
    """Where a joining member goes: the epoch and round to enter (with the newest epoch seen
    then), or the step at which the run finished while it was joining (`finished`)."""

    epoch: int = 0
    round: int = 0
    latest: int = 0
    finished: Optional[int] = None


def wait_to_enter(store: Any, me: Member, sleep: Callable[[float], None], poll_s: float) -> Entry:
    """Ask the keeper to take this incarnation in, and wait for a started epoch that lists it
    (or for the run's end). Bounded by the keeper: it publishes an epoch, or the run ends."""
    store.set(keys.join_key(me[0]), str(me[1]))
    while True:
        if store.check([keys.FINISHED]):
            return Entry(finished=int(store.get(keys.FINISHED)))
        latest = int(store.get(keys.LATEST)) if store.check([keys.LATEST]) else 0
        found = started_epoch_with_me(store, me, latest)
        if found is not None:
            return Entry(found[0], found[1], latest)
        sleep(poll_s)


def finished_step(store: Any) -> Optional[int]:
    """The run's final step once a member has left the loop (protocol.FINISHED), else None."""
    return int(store.get(keys.FINISHED)) if store.check([keys.FINISHED]) else None


def entry_round(store: Any, epoch: Epoch, current: int) -> int:
    """The round at which a continuing member (one coming from another epoch) begins `epoch`.
    An epoch the keeper started afresh (nobody had entered one when it was published) names its
    start round. Otherwise the first member to enter writes its round and the others take that
    one: continuing members may come from different epochs at different rounds (each left its
    own by its own votes), and on their own rounds they would form groups and vote where the
    others never come."""
    if epoch.start_round >= 0:
        return epoch.start_round
    return int(_text(store.compare_set(keys.start_key(epoch.id), "", str(current))))


def gone(store: Any, epoch: Epoch, ranks: List[int]) -> Optional[str]:
    """Why the group of `ranks` of `epoch` cannot form (some of them are not the incarnation the
    epoch lists: dead, or restarted), or None."""
    alive = [_text(v) for v in store.multi_get([keys.inc_key(r) for r in ranks])]
    lost = [r for r, v in zip(ranks, alive) if v != str(epoch.incarnation(r))]
    return f"ranks {lost} of quorum {epoch.id} are gone" if lost else None


def await_transfer(store: Any, epoch: Epoch, ends: List[int], done_key: str, sleep: Callable[[float], None],
                   poll_s: float) -> bool:
    """A member that neither sends nor receives a state transfer waits for it to end (True), or
    for one of its ends to die (False: the round fails and the next epoch moves on)."""
    watch = [keys.inc_key(r) for r in ends]
    expected = [str(epoch.incarnation(r)) for r in ends]
    while not store.check([done_key]):
        if [_text(v) for v in store.multi_get(watch)] != expected:
            return False
        sleep(poll_s)
    return True
