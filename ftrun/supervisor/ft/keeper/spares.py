"""Hot spares (--spares N): which whole replicas that asked to join train, and which the keeper holds
back as spares; and which spare takes the place of a training replica that died.

A spare is a replica the keeper leaves out of its quorums while the training replicas are enough:
its workers ran the script up to the first ft.steps()/ft.epochs() (process started, imports done,
model and optimizer built) and wait there to enter a quorum, as any joiner does
(worker/ft/member/membership.py wait_to_enter). So a spare is never a member: it is not counted in
`ft.num_replicas()`, the data split, the global batch or the votes. When a training replica dies,
the quorum published without it lists a spare in its place, as a healer (keeper/core.py exit_plan):
the spare takes the committed state from a live peer and trains from the next round. The replica
that died restarts and asks to join; with the training replicas whole again it is held back, and
is the spare from then on. A spare that dies is only restarted.

Pure functions of the keeper's snapshot (keeper/core.py KeeperSnapshot, read as a SpareView): no store, no clock, no IO.
Must never import torch.
"""

from __future__ import annotations

from typing import AbstractSet, Dict, Mapping, Optional, Protocol, Sequence, Tuple

from ftrun.wire import MemberReport


class SpareView(Protocol):
    """The fields of keeper/core.py's KeeperSnapshot these rules read (core.py imports this module)."""

    k: int
    ranks: Sequence[int]
    spares: int
    members: Mapping[int, int]
    pending: Mapping[int, int]
    held: Mapping[int, int]
    alive: Mapping[int, Optional[int]]
    moved: bool
    awaited: Optional[AbstractSet[int]]

    def mates(self, rank: int) -> Tuple[int, ...]: ...

    def report(self, rank: int) -> MemberReport: ...


def target(s: SpareView) -> int:
    """How many replicas train: every replica of the run but the spares, and one at least (a
    keeper on a moved store may know fewer replicas than the spares plus one: it held every replica
    back, and nothing would train again)."""
    return max(1, len(s.ranks) // s.k - s.spares)


def room(s: SpareView, members: Mapping[int, int]) -> int:
    """How many more replicas may train beside those of `members`."""
    return target(s) - len({r // s.k for r in members})


def split(s: SpareView, candidates: Mapping[int, int]) -> Tuple[Dict[int, int], Dict[int, int]]:
    """Whole replicas that asked to join (`candidates`: rank -> incarnation) into those admitted and
    those held back as spares: the lowest replicas first, up to the room the members leave. The same
    on every poll for the same asks, so the first quorum's spares are the highest replicas whatever
    the order they asked in."""
    if not s.spares:
        return dict(candidates), {}
    # On a moved store the last quorum's members come first: they hold the trained state (the spares
    # held none), and a quorum of spares would heal from a replica holding less than the newest step.
    trained = {r // s.k for r in s.awaited} if s.moved and s.awaited else set()
    reps = sorted({r // s.k for r in candidates}, key=lambda rep: (rep not in trained, rep))
    taken = set(reps[:max(0, room(s, s.members))])
    admitted = {r: inc for r, inc in candidates.items() if r // s.k in taken}
    held = {r: inc for r, inc in candidates.items() if r // s.k not in taken}
    return admitted, held


def promote(s: SpareView, leaving: Mapping[int, int]) -> Dict[int, int]:
    """The spares that take the place of the training replicas `leaving` (their ranks ->
    incarnations, to be admitted in the quorum published without them): the lowest live spares, as
    many as there is room for. A spare is promoted whole (every worker of it is still the
    incarnation that asked)."""
    if not s.spares or not s.held:
        return {}
    staying = {r: inc for r, inc in s.members.items() if r not in leaving}
    free = room(s, {**staying, **s.pending})
    out: Dict[int, int] = {}
    for rep in sorted({r // s.k for r in s.held}):
        if free <= 0:
            break
        mates = s.mates(rep * s.k)
        if all(m in s.held and s.alive.get(m) == s.held[m] for m in mates):
            out.update({m: s.held[m] for m in mates})
            free -= 1
    return out


def followed(s: SpareView) -> Dict[int, int]:
    """The spares as a follower node's keeper sees them (the leader holds them back in its own books,
    not in the store, so a follower's `held` stayed empty and `ftrun status` said `out`): the ranks
    whose incarnation waits to join (phase "join", as it reports) outside the quorum while the
    quorum's replicas fill every training place. Their ranks -> incarnations, as `held` has them."""
    if not s.spares or room(s, s.members) > 0:
        return {}
    out: Dict[int, int] = {}
    for r in s.ranks:
        info = s.report(r)
        if info.phase == "join" and info.inc is not None and s.members.get(r) != info.inc:
            out[r] = info.inc
    return out


def spare_replicas(s: SpareView) -> Tuple[int, ...]:
    """The replicas held back as spares now, for `ftrun status`."""
    return tuple(sorted({r // s.k for r in s.held}))
