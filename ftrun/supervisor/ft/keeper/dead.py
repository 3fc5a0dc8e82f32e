"""The keeper's votes in the place of members that cannot vote, and its key collection, without
IO: abstentions for a dead member in the rounds its peers may wait on, in every quorum that
lists it (dead_votes, forget_dead); a failed vote for a member that will never vote in a round
because it is in another quorum, still joining while a newer one is out, or finished (unstick);
rounds whose closer died before deciding (closed_round, orphan_commit, node_forward); the keys
of rounds every live member is past and of quorums nobody can still be in (collect). Never a
vote in a round whose keys were collected. The rules a historic bug changes are the methods of
KeeperRules (ftrun/sim/bugs.py overrides them); the rest are functions. Each is pure: what the
shell (ftrun.supervisor.ft.quorum) read, in, a decision with its reason, out.
Must never import torch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

from ftrun import keys, votes
from ftrun.supervisor.ft.keeper.core import KeeperSnapshot, Member

STUCK_S = 2.0  # a member waiting this long for a vote of a member that is in another quorum
COLLECT_EVERY_S = 0.25  # one list_keys per status report: a few dozen keys of rounds in flight at most
ROUND_KEYS_KEPT = 4  # keys of this many rounds behind the newest decided one stay in the store
QUORUM_COLLECTED = 1 << 62  # the collected horizon of a quorum whose keys are all gone: no round of it is voted in again
ROUND_KEYS = ("n", "d", "p", "heal", "pg")  # the kinds of a round's keys (keys.parse_key)


@dataclass(frozen=True)
class DeadVotes:
    """The votes due in one quorum for one dead member: cast `vote` in each of `rounds` not yet
    cast (the shell books those cast), then look at each cast one for a closer that died."""

    quorum: int
    vote: int
    rounds: Tuple[int, ...]          # every round due, sorted
    reason: str


@dataclass(frozen=True)
class FailVote:
    """A failed vote in the place of member (rank, inc) of quorum `quorum`, in round `rnd`."""

    rank: int
    inc: int
    quorum: int
    rnd: int
    reason: str


@dataclass(frozen=True)
class NodeForward:
    """What to do with a dead member's node count that was never marked forwarded."""

    action: str                      # "clear" (forwarded, or not complete), "wait", or "forward"
    total: int = 0                   # what to forward (the count less the keeper's own excess votes)
    reason: str = ""


@dataclass(frozen=True)
class KeyCollection:
    """Keys to delete, in order, and each quorum's new collected horizon (rounds below it are never voted in)."""

    delete: Tuple[str, ...]
    collected_below: Mapping[int, int]
    oldest_kept: int
    reason: str


class KeeperRules:
    """The keeper's rules that a historic bug changes (ftrun/sim/bugs.py subclasses it): pure."""

    # Whether an add completed a round's count: the protocol's test, the members' too.
    closes = staticmethod(votes.closes)

    def rounds_of(self, s: KeeperSnapshot, e: int) -> Set[int]:
        """Rounds of quorum `e` its live members may be waiting on: its start, the round each live
        member in it last reported, and, in a quorum a live member reports being in (or the
        newest while a member it lists lives: it may be entering), the two after the newest
        decided round. Not those two in an older quorum nobody reports being in: a joiner that
        enters such a quorum begins at its start and reports its rounds, while votes in rounds
        nobody else comes to never close, and their keys stay until the quorum is collected (the
        store would grow past its bound while a restarted replica is still starting)."""
        rounds: Set[int] = set()
        start = s.starts.get(e, -1)
        if start >= 0:
            rounds |= {start, start + 1}
        # The newest quorum while a member it lists lives (it may be entering, before it reports):
        # with every one of them dead, each abstention would close the next round, and the next.
        someone = e == s.quorum_id and any(s.alive.get(r) == inc for r, inc in s.quorums.get(e, ()))
        for r, inc in s.alive.items():
            info = s.report(r)
            if info.of(inc) and info.quorum_id == e:
                someone = True
                if info.round is not None:
                    rounds |= {info.round, info.round + 1}
        if someone:
            rounds |= {s.top + 1, s.top + 2}
        return rounds

    def rounds_to_fill(self, s: KeeperSnapshot, e: int) -> Set[int]:
        """The rounds of quorum `e` to abstain in for a dead member: those its peers may wait on,
        never one below the collected horizon (a vote there would start a fresh count and
        decide a decided round a second time)."""
        below = s.collected_below.get(e, -1)
        return {r for r in self.rounds_of(s, e) if r >= below}

    def elsewhere(self, s: KeeperSnapshot, m: int, k: int, e: int, now: float) -> bool:
        """Whether member (m, k) of quorum `e` will never vote there: it finished; it reports being
        in another quorum; or in none yet while a newer one is published (a joining replica enters
        the newest quorum, never this older one that listed it)."""
        if (m, k) in s.finished:  # it left the loop: a joiner left behind would wait for ever
            return True
        mi = s.report(m)
        return (s.alive.get(m) == k and mi.inc == k and s.fresh(m, now)
                and (mi.quorum_id not in (None, e) or (mi.quorum_id is None and e < s.quorum_id)))

    def oldest_kept_quorum(self, s: KeeperSnapshot) -> int:
        """Quorums below this one have their keys deleted (-1: none). A live replica that reports
        no quorum of its own yet (joining, or its first report not read) may be about to enter
        any quorum that lists it: nothing is deleted by quorum meanwhile (this once took a
        joiner's quorum, and the decision it was about to read, from under it)."""
        return min(s.live_quorums(), default=-1) - 2 if s.all_live_report() else -1


def dead_votes(rules: KeeperRules, s: KeeperSnapshot, member: Member) -> List[DeadVotes]:
    """The votes due for dead `member` in every quorum that lists it and that live members may
    still be in or enter: votes.Voting.dead_vote, an abstention where the live members stepped
    first, a failed vote where they wait for the decision (sharded replicas). A dead member's own
    vote may count besides the keeper's; a failed one then discards a round nobody has stepped
    past."""
    vote = votes.Voting(s.k).dead_vote
    oldest = min(s.live_quorums(), default=0) if s.all_live_report() else 0
    due = []
    for e, members in s.quorums.items():
        if member not in members or e < oldest:
            continue
        rounds = tuple(sorted(rules.rounds_to_fill(s, e)))
        due.append(DeadVotes(e, vote, rounds, f"rank {member[0]}.{member[1]} of quorum {e} is dead: "
                                              f"{'abstain' if vote == votes.ABSTAIN_VOTE else 'fail'} in rounds {list(rounds)}"))
    return due


def forget_dead(s: KeeperSnapshot, dead: Iterable[Member]) -> Tuple[Tuple[Member, ...], Tuple[Member, ...]]:
    """(forgotten, kept) of the dead members voted for: one is forgotten once every live replica
    reports being past every quorum that listed it; the others are voted for again."""
    live_quorums = s.live_quorums()
    settled = s.all_live_report()  # a joiner may yet enter an old quorum that lists the dead
    gone, kept = [], []
    for member in dead:
        newest = max((e for e, m in s.quorums.items() if member in m), default=0)
        (gone if settled and live_quorums and min(live_quorums) > newest else kept).append(member)
    return tuple(gone), tuple(kept)


def dead_on_node(dead: Iterable[Member], node_of, node: int) -> Tuple[Member, ...]:
    """On a lost node, the dead members whose votes were cast through its store: voted again in
    the run's store, as those votes may never have been forwarded (their node's last voter died
    before forwarding), and a round short of them would wait for ever.
    A vote counted twice is decided by its votes (orphan_commit), as after any double vote."""
    return tuple(m for m in dead if node_of(m[0]) == node)


def unstick(rules: KeeperRules, s: KeeperSnapshot, voting_since: Mapping[int, Tuple[Tuple[object, object], float]],
            unstuck: Set[Tuple[int, int, int, int]],
            now: float) -> Tuple[Dict[int, Tuple[Tuple[object, object], float]], Tuple[FailVote, ...]]:
    """A member that has waited STUCK_S for a round's decision while another member of its
    quorum will never vote there (rules.elsewhere) would wait for ever: a failed vote in that
    member's place (the round fails; everyone moves on). Returns since when each live member
    has been voting where it is, and the votes due (none twice: `unstuck` are those cast)."""
    since_now: Dict[int, Tuple[Tuple[object, object], float]] = {}
    due: List[FailVote] = []
    planned = set()
    alive = s.alive
    for v in s.ranks:
        info = s.report(v)
        inc = alive.get(v)
        where = (info.quorum_id, info.round)
        if (not info.of(inc) or info.phase != "vote" or not s.fresh(v, now) or info.round is None
                or info.quorum_id not in s.quorums):
            continue
        since = voting_since.get(v)
        if since is None or since[0] != where:
            since_now[v] = (where, now)
            continue
        since_now[v] = since
        if now - since[1] < STUCK_S:
            continue
        e, rnd = info.quorum_id, info.round
        for m, k in s.quorums[e]:
            if (m, k, e, rnd) in unstuck or (m, k, e, rnd) in planned or not rules.elsewhere(s, m, k, e, now):
                continue
            planned.add((m, k, e, rnd))
            mi = s.report(m)
            at = f"in quorum {mi.quorum_id}" if mi.quorum_id is not None else "still joining"
            due.append(FailVote(m, k, e, rnd, f"rank {m} is {at} while quorum {e} waits for its "
                                              f"vote in round {rnd}: voted fail in its place"))
    return since_now, tuple(due)


def closed_round(rules: KeeperRules, after: int, added: int, size: int) -> Optional[bool]:
    """The add of `added` that left a round's count at `after` in a quorum of `size`: whether it
    closed the round (rules.closes), and then its decision (True: commit, no failed vote and one
    ok at least). None: not closed, somebody else decides it."""
    if rules.closes(after, added, size):
        return votes.tally(after).commit
    return None


def orphan_commit(total: int, size: int) -> Optional[bool]:
    """A round every member voted in, whose decision may be missing (its closer died between its
    vote and its decision): decided by its votes, as the closer would have (members that voted ok
    have stepped already). None: votes are missing, the round is not orphaned."""
    t = votes.tally(total)
    return t.commit if t.votes >= size else None


def node_counted(total: int, size: int) -> bool:
    """Whether a node's count of a round holds every vote of the node's members."""
    return votes.tally(total).votes >= size


def node_forward(total: int, size: int, forwarded: bool, since: Optional[float], now: float,
                 mine: Sequence[int]) -> NodeForward:
    """A dead member's node counted every vote of the round but never marked it forwarded: the
    member may have been that node's last voter and died before forwarding. After STUCK_S (a
    live forwarder marks it within a store round trip, `since`: when this was first seen) the
    keeper forwards the node's count less its own votes (`mine`) past the node's size: those were
    for members that had voted themselves. Had the dead forwarder reached the run's store after
    all, the round is over-counted and decided by orphan_commit, as after any double vote."""
    excess = votes.tally(total).votes - size
    if excess < 0 or forwarded:
        return NodeForward("clear", reason="forwarded" if forwarded else "votes missing")
    waited = 0.0 if since is None else now - since  # first seen now
    if waited < STUCK_S:
        return NodeForward("wait", reason=f"not forwarded for {waited:.2f} s")
    return NodeForward("forward", total - sum(mine[len(mine) - excess:] if excess else []),
                       f"not forwarded for {waited:.2f} s")


def collect_due(top: int, now: float, collected_at: int, collected_when: float) -> bool:
    """Keys are collected when a round was decided since, at most every COLLECT_EVERY_S."""
    return top != collected_at and now - collected_when >= COLLECT_EVERY_S


def node_votes_kept_from(top: int) -> int:
    """The keeper's own votes through node stores are remembered (for node_forward) from this round on."""
    return top - 4 * ROUND_KEYS_KEPT


# The store's key names repeat from one collection to the next (and in the simulator from one run to
# the next): each is parsed once. keys.parse_key is pure and returns immutable tuples.
_parse_key = functools.lru_cache(maxsize=16384)(keys.parse_key)


def collect(rules: KeeperRules, s: KeeperSnapshot, names: Iterable[str]) -> KeyCollection:
    """Which keys (`names`: the store's keys) to delete: those of rounds every live member is past
    (counters, decisions, transfer words, group addresses), of quorums nobody can still be in,
    and the groups of sharded replicas' earlier incarnations, so a long run's store stays the
    same size. "Past" is judged per quorum, by the newest round decided in it: rounds are
    numbered per quorum, and one that restarted afresh may count from anywhere."""
    ours = []
    newest: Dict[int, int] = {}
    delete: List[str] = []
    for key in names:
        parsed = _parse_key(key)
        if parsed is None:
            continue
        kind, nums = parsed
        if kind in ROUND_KEYS and len(nums) >= 2 or kind in ("quorum", "start") and nums:
            where = (nums[0], nums[1] if kind not in ("quorum", "start") else -1)
            ours.append((key, kind, where))
            if kind == "d":
                newest[where[0]] = max(newest.get(where[0], -1), where[1])
        elif kind == "replica" and len(nums) >= 2:
            # A sharded replica's own group of an earlier incarnation: nobody uses it again.
            rep, inc = nums[0], nums[1]
            now_inc = s.alive.get(rep * s.k)
            if now_inc is not None and inc < now_inc:
                delete.append(key)
    # A quorum's keys go once every live replica reports being past it (oldest_kept_quorum).
    oldest = rules.oldest_kept_quorum(s)
    below = {e: max(s.collected_below.get(e, -1), rnd - ROUND_KEYS_KEPT) for e, rnd in newest.items()}
    for e in {e for _, _, (e, _) in ours if e < oldest}:
        # Its decisions go too: a vote there later (for a member that dies after, while a
        # restarted replica has not reported yet) would start a fresh count and decide a
        # decided round again.
        below[e] = QUORUM_COLLECTED
    for key, kind, (e, rnd) in ours:
        if e < oldest or kind in ROUND_KEYS and rnd < newest.get(e, -1) - ROUND_KEYS_KEPT:
            delete.append(key)
    return KeyCollection(tuple(delete), below, oldest,
                         f"quorums below {oldest} and rounds {ROUND_KEYS_KEPT} behind each quorum's newest decided")


def node_size(members: Iterable[Member], node_ranks: Iterable[int]) -> int:
    """How many of a quorum's members vote through a node whose ranks are `node_ranks`."""
    ranks = set(node_ranks)
    return sum(1 for r, _ in members if r in ranks)
