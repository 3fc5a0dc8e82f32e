"""The keeper's quorum decisions without IO: which joiners are admitted and when a quorum is
published (admit), what that quorum is (next_quorum, stop_quorum: members, healers, the heal
source, the start round, the round length), the members an exit takes out (exit_plan), the
run's pace (Pace, paced_steps, repace_due), and the figures `ftrun status` shows. Each is a
pure function of a KeeperSnapshot and `now`: it reads no store and no clock, writes nothing,
logs nothing, and says why it decided what it did (`reason`).
Must never import torch.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import (AbstractSet, Deque, Dict, FrozenSet, Mapping, Optional, Sequence, Set,
                    Tuple)

from ftrun import keys, pacing, votes
from ftrun.supervisor.ft.keeper import spares
from ftrun.wire import NO_REPORT, MemberReport, Quorum, SurvivorReport

# How long a quorum that starts from nothing (the first, or one after every replica was lost)
# waits for the replicas being started: one that began alone would train on its own gradients
# until the others caught up, and a resumed run would not be the run it resumes.
FIRST_QUORUM_WAIT_S = 30.0
INFO_FRESH_S = 1.0  # a replica reports every 0.25 s: silent for longer, its last report is stale
FRESH_START = "starting again from the first step"  # a fresh quorum after the first, without --checkpoint-dir

Member = Tuple[int, int]  # (rank, incarnation)
_NOTHING_READ: Mapping = MappingProxyType({})


@dataclass(frozen=True)
class KeeperSnapshot:
    """What the keeper knows at one moment: its books (what it decided and saw before) and what
    its shell has just read from the store. The core never changes it (its mappings may be the
    shell's own, read-only here)."""

    k: int = 1                                          # workers per replica (--replica-size)
    ranks: Sequence[int] = ()                           # every rank of the run, sorted
    local: AbstractSet[int] = frozenset()               # the ranks on the keeper's own node
    quorum_id: int = 0                                   # the newest quorum published
    top: int = -1                                       # the newest round decided (keys.TOP)
    members: Mapping[int, int] = field(default_factory=dict)   # the newest quorum's members
    pending: Mapping[int, int] = field(default_factory=dict)   # admitted, not yet in a quorum
    pending_since: Optional[float] = None               # the first join of the quorum being formed
    alive: Mapping[int, Optional[int]] = field(default_factory=dict)  # rank -> live incarnation
    healed: AbstractSet[Member] = frozenset()           # incarnations holding the committed state
    info: Mapping[int, MemberReport] = field(default_factory=dict)  # each replica's newest report
    info_seen: Mapping[int, float] = field(default_factory=dict)  # when it last changed
    quorums: Mapping[int, AbstractSet[Member]] = field(default_factory=dict)  # quorum -> its members
    starts: Mapping[int, int] = field(default_factory=dict)  # quorum -> its start round (-1: continuing)
    collected_below: Mapping[int, int] = field(default_factory=dict)  # quorum -> rounds collected below
    finished: AbstractSet[Member] = frozenset()         # incarnations that left the loop (exit 0)
    awaited: Optional[AbstractSet[int]] = None          # on a moved store: the ranks the first quorum waits for
    stopping: bool = False                              # a stop signal came: every quorum is a stop quorum
    writer: int = -1                                    # the newest stop quorum's writer replica (-1: none)
    moved: bool = False                                 # on a store that moved, where nobody holds the state yet
    fresh_start: str = FRESH_START                      # what a fresh quorum after the first means for the run
    round_steps: int = pacing.ROUND_STEPS               # the most steps per round
    round_steps_chosen: bool = False                    # the user chose them: kept, not paced
    step_s: Optional[float] = None                      # the run's pace (Pace.step_s)
    quorum_steps: int = pacing.ROUND_STEPS              # the newest quorum's round length
    quorum_paced: bool = True                           # ... sized at a known pace (or the user's): not provisional
    repace_after: float = float("-inf")                 # no re-paced quorum before this
    # Read for a quorum being published: each member's entered incarnation (keys.entered_key) and,
    # on a moved store, what each rejoined replica said it holds (keys.survivor_key's raw text).
    entered: Mapping[int, int] = field(default_factory=dict)
    survivors: Mapping[int, object] = field(default_factory=dict)
    spares: int = 0                                     # --spares: replicas held back while the others train
    held: Mapping[int, int] = field(default_factory=dict)  # the spares' ranks now (asked to join, held back)
    check_s: float = pacing.CHECK_S                     # seconds between the guard's checks (0: off)
    check_steps: Optional[int] = None                   # steps between them, the user's choice (None: paced)

    @classmethod
    def of(cls, **fields) -> "KeeperSnapshot":
        """KeeperSnapshot(**fields) with every field but `entered` and `survivors` given, built
        without a frozen dataclass's setattr per field (the keeper's shell builds one or two a
        poll, and the simulator polls it thousands of times a second; docs/development.md).
        Frozen all the same, and equal to the one the constructor builds."""
        snap = object.__new__(cls)
        snap.__dict__.update(entered=_NOTHING_READ, survivors=_NOTHING_READ)
        snap.__dict__.update(fields)
        return snap

    def mates(self, rank: int) -> Tuple[int, ...]:
        """The ranks of `rank`'s replica, itself included."""
        first = rank - rank % self.k
        return tuple(range(first, first + self.k))

    def report(self, rank: int) -> MemberReport:
        """The replica's newest report (NO_REPORT: none, or one refused)."""
        return self.info.get(rank, NO_REPORT)

    def fresh(self, rank: int, now: float) -> bool:
        """Whether the replica's report changed within INFO_FRESH_S: a silent one's says nothing now."""
        return now - self.info_seen.get(rank, -1e9) <= INFO_FRESH_S

    def live_quorums(self) -> Set[int]:
        """The quorums live replicas report being in (their own incarnation's report)."""
        live = set()
        for r, inc in self.alive.items():
            info = self.report(r)
            if info.of(inc) and info.quorum_id:
                live.add(info.quorum_id)
        return live

    def all_live_report(self) -> bool:
        """Every live replica's newest report, of its own incarnation, names the quorum it is in."""
        for r, inc in self.alive.items():
            info = self.report(r)
            if inc is not None and not (info.of(inc) and info.quorum_id):
                return False
        return True


@dataclass(frozen=True)
class KeeperDecision:
    """A quorum to publish (keys.quorum_key, then keys.LATEST), and what the keeper books with it."""

    quorum: Quorum
    reason: str                      # why this quorum, with these healers and this source
    history: Optional[str]           # the line for the run's history (None: said nowhere)
    healed: FrozenSet[Member] = frozenset()  # incarnations newly seen holding the state
    fresh: bool = False              # a fresh quorum after the first: the trained state is lost
    forget: Tuple[int, ...] = ()     # ranks whose survivor keys are of no use any more: to delete
    # On a moved store, no replica holds the state there yet (its first heal has not landed): the
    # next quorum heals from the survivors' words again.
    moving: bool = False
    # A stop quorum that names no writer after one that did: the keeper says so in the writer's place
    # (keys.STOP_SAVE; "nothing": no save was due), or the supervisor, told a replica saves,
    # waits out its grace for a word.
    stop_word: Optional[Mapping] = None
    paced: bool = True               # its rounds were sized at a known pace (or are the user's): repace_due


@dataclass(frozen=True)
class KeeperAdmission:
    """What a poll decides about joiners: who is pending, and whether to publish now and why."""

    pending: Mapping[int, int]
    pending_since: Optional[float]
    publish: Optional[str]           # the quorum's why (None: nothing to publish)
    reason: str
    quiet: bool = False              # a re-paced quorum of the same members, said nowhere
    repace_after: Optional[float] = None  # set when re-paced: no other before this
    held: Mapping[int, int] = field(default_factory=dict)  # ranks held back as hot spares (keeper/spares.py)


@dataclass(frozen=True)
class KeeperExit:
    """What a member's exit does to the books: who leaves, and the quorum to publish without them."""

    unpend: Tuple[int, ...]          # pending ranks dropped: a replica joins whole, so it waits for its next incarnation
    leaving: Mapping[int, int]       # members taken out (its whole replica)
    publish: Optional[str]           # the new quorum's why (None: none left, or it finished)
    finished: bool                   # it left the loop with the others: it never votes again
    reason: str
    promote: Mapping[int, int] = field(default_factory=dict)  # spares admitted in its place (spares.promote)


_NOBODY_TO_ADMIT = KeeperAdmission(_NOTHING_READ, None, None, "nobody to admit")


def _joined(ranks: Sequence[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, sorted(ranks)))} joined"


def admit(s: KeeperSnapshot, joins: Mapping[int, int], now: float) -> KeeperAdmission:
    """Joiners (`joins`: each rank's keys.join_key, the incarnation that asked) are admitted
    whole: every worker of a replica asked, as its live incarnation. A quorum is published when
    someone is admitted, except that one starting from nothing waits FIRST_QUORUM_WAIT_S for the
    replicas still starting (on a moved store only the last quorum's members). With nobody to
    admit, a quorum may be re-paced (repace_due). A stopping run admits nobody."""
    if s.stopping:
        return KeeperAdmission(s.pending, s.pending_since, None, "stopping: nobody joins")
    asked: Dict[int, int] = {}
    for r in s.ranks:
        inc = s.alive.get(r)
        if inc is not None and joins.get(r) == inc and r not in s.members and r not in s.pending:
            asked[r] = inc
    pending = dict(s.pending)
    for r, inc in asked.items():
        if all(asked.get(m) == inc for m in s.mates(r)):
            pending[r] = inc
    pending, held = spares.split(s, pending)  # beyond the training replicas, a replica waits as a spare
    if not pending:
        why = repace_due(s, now)
        if why is None:
            # Most polls: one instance, not one a poll.
            return KeeperAdmission(pending, None, None, "spares held", held=held) if held else _NOBODY_TO_ADMIT
        return KeeperAdmission(pending, None, "", why, quiet=True, repace_after=now + Pace.WINDOW_S, held=held)
    since = s.pending_since if s.pending_since is not None else now
    if s.quorum_id == 0 or not s.members:
        waiting_for = [r for r in s.ranks if s.alive.get(r) is not None and r not in pending and r not in held
                       and (s.awaited is None or r in s.awaited)]
        if waiting_for and now - since < FIRST_QUORUM_WAIT_S:
            return KeeperAdmission(pending, since, None, f"a first quorum waits for ranks {waiting_for}",
                                   held=held)
        why = "first replicas joined" if s.quorum_id == 0 else _joined(list(pending))
    else:
        why = _joined(list(pending))
    if held:
        n = len({r // s.k for r in held})
        why += f"; {n} spare{'s' if n != 1 else ''} held back"
    return KeeperAdmission(pending, since, why, f"admitted {sorted(pending)}", held=held)


def exit_plan(s: KeeperSnapshot, rank: int, inc: int, finished: bool) -> KeeperExit:
    """A member that finished leaves the books alone, unless its replica is the stop quorum's
    writer: it left the loop before that quorum reached it (a replica's exit 0 is seen a moment
    after its last round), so it never says how a save went, and the
    others get a stop quorum naming another holder, or nobody. One that died takes its whole
    replica out (its other workers are being killed and its shard groups are broken, so nobody
    may wait for any of them), and the others get a quorum without it. Not a member: nothing."""
    mates = s.mates(rank)
    if s.members.get(rank) != inc:
        return KeeperExit(mates, {}, None, False, f"rank {rank}.{inc} is not a member")
    if finished:
        writes = s.stopping and rank // s.k == s.writer and any(r != rank for r in s.members)
        return KeeperExit(mates, {rank: inc}, f"the writer, rank {rank}, finished before the stop" if writes else None,
                          True, f"rank {rank}.{inc} finished" + (", the stop quorum's writer" if writes else ""))
    leaving = {m: s.members[m] for m in mates if m in s.members}
    left = any(r not in leaving for r in s.members)
    why = None
    promote: Mapping[int, int] = _NOTHING_READ
    if left:
        why = (f"rank {rank} left" if s.k == 1 else
               f"replica {rank // s.k} left (rank {rank} of ranks {mates[0]}-{mates[-1]})")
        promote = spares.promote(s, leaving)
        if promote:
            why += f"; spare replica {min(promote) // s.k} takes its place"
    return KeeperExit(mates, leaving, why, False, f"rank {rank}.{inc} died" + ("" if left else ": nobody is left"),
                      promote)


def rejoin_applies(s: KeeperSnapshot, rank: int, inc: int) -> bool:
    """Whether incarnation `inc` of `rank` becoming the next in place (a member's rejoin) is booked
    as an exit and a spawn: only for the live incarnation (a worker that died meanwhile, its exit
    taken first, stays dead), and only for replicas of one worker."""
    return s.alive.get(rank) == inc and s.k == 1


def survivors_source(s: KeeperSnapshot, members: Mapping[int, int]) -> Tuple[Optional[int], str]:
    """After the store moved, replicas rejoin holding what they held then: each says which step
    (s.survivors, keys.survivor_key). The source is the replica whose workers all hold the same
    newest step, and of those first one whose state its last round's decision left ("decided":
    no vote in flight): a replica that stepped past a round whose decision the lost store held
    and never delivered may hold a step its peers voted down (a member whose collective completed
    while a peer's failed), while a decided state is committed (a member
    sends a round's gradients only once the round before is decided). With every replica past
    an undecided round, the newest step is a step whose collectives went through: every gradient
    had every part. The others heal from it. None when no replica is whole (every one was
    healing, or none said)."""
    said: Dict[int, SurvivorReport] = {}
    for r in members:
        if r not in s.survivors:  # a replica started since the move says nothing
            continue
        d = SurvivorReport.decode(s.survivors[r])
        if d is not None and d.inc == members[r] and d.in_sync:
            said[r] = d
    whole = {}
    for rep in sorted({r // s.k for r in said}):
        # (step, sub-steps of the next one: several ft.Optimizers, member/iteration.py)
        steps = {(said[m].step, said[m].sub_steps) if m in said else None for m in s.mates(rep * s.k)}
        if len(steps) == 1 and None not in steps:
            whole[rep] = (all(said[m].decided for m in s.mates(rep * s.k)), steps.pop())
    if not whole:
        return None, "no replica says it holds a whole step"
    best = max(whole, key=lambda rep: (whole[rep], -rep))
    decided, (step, sub) = whole[best]
    held = f"step {step}" + (f" and {sub} optimizer step{'s' if sub > 1 else ''} of the next" if sub else "")
    return best, f"replica {best} holds {held}, the newest {'decided' if decided else 'whole'} one"


def survivors_latest(s: KeeperSnapshot) -> int:
    """The newest quorum of the lost store any rejoined replica says it saw (0: none said). This
    keeper's own count is its node's last read of the lost store, which may have published more
    since: a quorum id published again would name two quorums."""
    newest = 0
    for raw in s.survivors.values():
        d = SurvivorReport.decode(raw)
        if d is not None:
            newest = max(newest, d.latest)
    return newest


def paced_steps(s: KeeperSnapshot) -> int:
    """Steps per round of a quorum published now: the user's choice, else about ROUND_TARGET_S
    at the run's pace, and one while the pace is not known (the run's first steps, or a fresh
    start's): a joiner, and a stop signal, wait for the survivors' round's top, and rounds of
    ROUND_STEPS slow steps would keep a replica restarted in the run's first round waiting for
    them (docs/concepts/ft-protocol.md). Rounds sized before the pace was known are re-sized as
    soon as it is (repace_due): one-step rounds are paced by their own votes and would not always grow."""
    if s.round_steps_chosen:
        return s.round_steps
    if s.step_s is None:
        return 1
    return pacing.round_steps_for(s.step_s, s.round_steps)


def check_steps(s: KeeperSnapshot) -> int:
    """Steps between the guard's checks in a quorum published now: the user's count, else about
    s.check_s seconds at the run's pace (a fixed count until it is known); none when the guard is off."""
    if s.check_s <= 0:
        return 0
    return s.check_steps or pacing.check_steps_for(s.step_s, s.check_s)


def repace_due(s: KeeperSnapshot, now: float) -> Optional[str]:
    """As soon as the pace is known, rounds far from ROUND_TARGET_S (over twice as long: a stop
    signal, taken at a round's top, would wait seconds of 8 slow steps; under a quarter and
    shorter than allowed: the votes cost) get a quorum of the same members with rounds
    re-sized, said nowhere: not only after a failure. So do rounds sized before the pace was
    known (one step, s.quorum_paced false) that the pace wants longer, however long they last,
    and without waiting for the pace window (they follow no earlier pace): a step timed in
    rounds of one holds a whole vote, so rounds of one 60 ms step (50 ms of compute, 10 of
    vote) would stay within the bounds and never grow. Only with every member in the quorum and
    holding the state (nobody heals again), once per pace window (a swinging pace rebuilds no
    groups); never for sharded replicas, which vote every step whatever the quorum says
    (member/core.py round_length): a re-sized quorum would only rebuild their groups. The
    reason, or None."""
    if (s.step_s is None or s.round_steps_chosen or votes.Voting(s.k).one_step_rounds or not s.members
            or (s.quorum_paced and now < s.repace_after)):
        return None
    want, round_s = paced_steps(s), s.quorum_steps * s.step_s
    target = pacing.ROUND_TARGET_S
    if want == s.quorum_steps or (s.quorum_paced and target / 4 <= round_s <= 2 * target):
        return None
    for r, inc in s.members.items():
        info = s.report(r)
        if (r, inc) not in s.healed or not info.of(inc) or info.quorum_id != s.quorum_id or not s.fresh(r, now):
            return None
    if not s.quorum_paced:
        return f"rounds of {s.quorum_steps} step{'s' if s.quorum_steps != 1 else ''} until the pace was known " \
               f"({s.step_s:.3f} s a step): re-sized to {want}"
    return f"rounds of {s.quorum_steps} steps last {round_s:.2f} s: re-sized to {want}"


def continues(members: Mapping[int, int], entered: Mapping[int, int]) -> bool:
    """Whether some member has entered the newest quorum (its keys.entered_key is its incarnation):
    then the next quorum's members switch by their votes, and it needs no start round."""
    return any(entered.get(r) == k for r, k in members.items())


def _healed_now(s: KeeperSnapshot, healed: Mapping[int, int]) -> FrozenSet[Member]:
    return frozenset((r, h) for r, h in healed.items() if h >= 0)


def source_replica(s: KeeperSnapshot, members: Mapping[int, int], holders: Sequence[int]) -> int:
    """The heal's source replica, the one definition of it: the lowest replica holding the
    state (`holders`, whole replicas), or with none the lowest member's, whose own state starts
    the run again. One replica sends every shard (Quorum.sources: its worker i sends shard i),
    so that all shards come from the same step; its feed reaches the spares too."""
    return min(holders or members) // s.k


def next_quorum(s: KeeperSnapshot, why: str, healed: Mapping[int, int], quiet: bool = False) -> KeeperDecision:
    """The next quorum: the members and the pending joiners; members that have entered the
    newest quorum (s.entered) switch by their votes, so it starts where they are (-1), else
    after the newest round decided. Its healers are the members whose replica does not hold the
    committed state (`healed`: each member's keys.healed_key read now, not as of the last poll:
    a replica that healed a moment ago must not be taken for one that has nothing). With no
    holder it is fresh: the lowest replica sends its state, shard by shard; on a moved store the
    replica that says it holds the newest whole step does (survivors_source), in every quorum
    until a replica holds the state there: a first source that dies in its transfer leaves the
    survivors holding what they held, and a fresh quorum then would have a replica restarted
    since the move send its initial state over the newest committed step. The source itself is
    source_replica's."""
    if s.stopping:
        return stop_quorum(s, why, healed)
    members = dict(s.members)
    members.update(s.pending)
    continuing = continues(s.members, s.entered)
    known = set(s.healed) | _healed_now(s, healed)
    holders = [r for r in members if all((m, members.get(m)) in known for m in s.mates(r))]
    reason = f"holders {sorted(holders)}"
    forget: Tuple[int, ...] = ()
    moving = s.moved and not holders
    if s.moved and holders:  # a replica holds the state on the moved store: the survivors' words are spent
        forget = tuple(r for r in members if r in s.survivors)
    if moving:
        source, said = survivors_source(s, members)
        reason = said
        if source is not None:
            # The store moved: nobody holds the state in this store yet, and every replica holds
            # what it held then. One replica's state, the newest whole step, goes to all.
            holders = list(s.mates(source * s.k))
            why = (f"the replicas rejoined on the moved store; replica {source} holds the newest step "
                   f"and heals the others")
    eid = max(s.quorum_id, survivors_latest(s) if s.moved else 0) + 1
    fresh = s.quorum_id == 0 or not holders
    start = -1 if continuing else s.top + 1  # rounds are numbered across quorums
    steps = paced_steps(s)
    paced = s.round_steps_chosen or s.step_s is not None
    ranked = tuple(sorted(members.items()))
    src = source_replica(s, members, holders)
    if fresh:
        quorum = Quorum(eid, ranked, tuple(sorted(r for r in members if r // s.k != src)), True, start, steps,
                        check_steps=check_steps(s), sources=s.mates(src * s.k))
        reason = f"fresh: nobody holds the trained state; replica {src} sends its own"
        if eid > 1:
            why += f"; no replica holding the trained state is left: {s.fresh_start}"
    else:
        quorum = Quorum(eid, ranked, tuple(sorted(r for r in members if r not in holders)), False, start, steps,
                        check_steps=check_steps(s), sources=s.mates(src * s.k))
        reason += f"; replica {src} is the source"
    n = len(ranked) // s.k
    shape = f" of {s.k} workers" if s.k > 1 else ""
    # Said when the pace chose them; until it is known they are one step, in every run.
    rounds = f", rounds of {steps} step{'s' if steps != 1 else ''}" if paced and steps != s.round_steps else ""
    line = None if quiet else f"quorum {eid}: {n} replica{'s' if n != 1 else ''}{shape} ({why}){rounds}"
    return KeeperDecision(quorum, f"{why or 're-paced'}: {reason}; starts at round {start}", line,
                          _healed_now(s, healed), fresh and eid > 1, forget, moving, paced=paced)


def left_loop(s: KeeperSnapshot, rep: int) -> bool:
    """Whether a worker of replica `rep` says it left the training loop (a report of its member
    incarnation in phase "done"): it never reads a stop quorum, so it saves nothing at one."""
    for m in s.mates(rep * s.k):
        info = s.report(m)
        if info.phase == "done" and info.of(s.members.get(m)):
            return True
    return False


def stop_writer_left(s: KeeperSnapshot) -> Optional[str]:
    """While stopping: the stop quorum's writer says it left the loop (it had, or did, before that
    quorum reached it): a stop quorum naming another is due, and why."""
    if not s.stopping or s.writer < 0 or not left_loop(s, s.writer):
        return None
    return f"replica {s.writer}, the writer, left the loop before the stop"


def stop_quorum(s: KeeperSnapshot, why: str, healed: Mapping[int, int]) -> KeeperDecision:
    """A stop quorum of the members there are now (nobody joins any more): at its switch every
    member stops, and the writer saves the step it holds: the lowest replica whose every worker
    holds the trained state and is still in the loop (left_loop: a replica that left it never
    reads the quorum; its last step was saved at the loop's end), on the keeper's node where one
    does (its workers are the last this node's ftrun stops); -1 when there is none, and then, when
    an earlier stop quorum named a writer, the keeper's word in its place (stop_word)."""
    continuing = continues(s.members, s.entered)
    known = set(s.healed) | _healed_now(s, healed)
    held = sorted({r // s.k for r in s.members if all((m, s.members.get(m)) in known for m in s.mates(r))})
    holders = [rep for rep in held if not left_loop(s, rep)]
    local = [rep for rep in holders if rep * s.k in s.local]
    writer = (local or holders or [-1])[0]
    eid = s.quorum_id + 1
    start = -1 if continuing else s.top + 1
    quorum = Quorum(eid, tuple(sorted(s.members.items())), (), False, start, 1, stop=True, writer=writer)
    saver = (f"replica {writer} saves" if writer >= 0 else
             "the replicas holding the trained state left the loop, which saved its last step" if held else
             "no replica holds the trained state: nothing to save")
    word = None
    if writer < 0 and s.writer >= 0:  # replica s.writer was to save, and died or left the loop first
        if s.finished or held:  # the loop's end saved its last step
            word = {"step": global_step(s), "ok": False, "rank": -1, "nothing": True,
                    "why": "the training loop had ended before the stop reached a replica, and its last step is "
                           "saved at its end"}
        else:
            word = {"step": global_step(s), "ok": False, "rank": -1,
                    "why": f"replica {s.writer}, which was to save it, is gone and no other holds the trained state"}
    return KeeperDecision(quorum, f"stop: holders {holders}, writer {writer}", f"quorum {eid}: stop ({why}; {saver})",
                          _healed_now(s, healed), stop_word=word)


def waits(s: KeeperSnapshot, waited_since: Mapping[int, float], now: float) -> Dict[int, float]:
    """Since when the others have been waiting for each replica (those waited on only). A member
    is waited on when others of its quorum have voted in its round and it has not. Only
    replicas that still report count, on both sides: a stopped replica's last report is stale
    (its heartbeat check catches it) and must not make a waiting peer look hung. O(N): the
    newest round any fresh member is voting in is enough."""
    fresh = {r for r in s.members if s.fresh(r, now)}
    voting = [_round_or(s.report(r), -1) for r in fresh if s.report(r).phase == "vote"]
    newest_vote = max(voting, default=None)
    out: Dict[int, float] = {}
    if newest_vote is None:  # nobody votes: nobody is waited for
        return out
    for r in s.ranks:
        mine = s.report(r)
        if r in fresh and mine.phase not in ("vote", "done", None) and newest_vote >= _round_or(mine, 0):
            out[r] = waited_since.get(r, now)
    return out


def _round_or(info: MemberReport, default: int) -> int:
    return info.round if info.round is not None else default


def in_quorum(s: KeeperSnapshot, rank: int) -> bool:
    """Whether the replica's live incarnation is a member of the newest quorum holding its state."""
    inc = s.alive.get(rank)
    return inc is not None and s.members.get(rank) == inc and (rank, inc) in s.healed


def replica_status(s: KeeperSnapshot, rank: int) -> dict:
    """One replica's figures for `ftrun status`."""
    info = s.report(rank)
    inc = s.alive.get(rank)
    fields = {
        "in_quorum": in_quorum(s, rank),
        "healing": info.healing and info.inc == inc,
        "last_heal_s": info.last_heal_s,
        "ft_phase": info.phase if info.inc == inc else None,
    }
    if s.spares:
        # None while no incarnation lives: a spare that exited is neither held back nor promoted,
        # and the books, which read False as a promotion (a heal), book its exit as such.
        fields["spare"] = None if inc is None else s.held.get(rank) == inc
    return fields


def global_step(s: KeeperSnapshot) -> int:
    return max((s.report(r).step for r in s.ranks), default=0)


def run_status(s: KeeperSnapshot) -> dict:
    """The run's figures for `ftrun status`. From every replica's last report, not only the
    members': after the run (or while a replica heals) the members may be few or none, and a
    replica's last report still holds the steps it saw. Committed steps are the global step
    (the furthest replica's); discarded rounds are counted by each incarnation, so the
    longest-lived replica's count is the run's (a lower bound once every first replica has been
    restarted)."""
    reports = [s.report(r) for r in s.ranks]
    fields = {
        "quorum_id": s.quorum_id,
        "quorum_size": len(s.members),
        "steps_committed": max((i.step for i in reports), default=0),
        "steps_discarded": max((i.discarded for i in reports), default=0),
    }
    if s.spares:
        fields["spares"] = len(spares.spare_replicas(s))
    return fields


class Pace:
    """The run's recent time per step, from the global step the keeper sees rise: the last
    WINDOW_S seconds of it, so that a run that slows down (or speeds up) is followed. Fed with
    the time by its owner; reads no clock."""

    WINDOW_S = 30.0
    EVERY_S = 0.25  # sampled as often as the replicas report

    def __init__(self) -> None:
        self.samples: Deque[Tuple[float, int]] = deque()
        self.noted_at = float("-inf")

    def due(self, t: float) -> bool:
        return t - self.noted_at >= self.EVERY_S

    def note(self, t: float, step: int) -> None:
        self.noted_at = t
        if self.samples and step < self.samples[-1][1]:  # a fresh start: the old pace says nothing
            self.samples.clear()
        if step == 0:  # no step reported yet: a resumed run's first report (its checkpoint's step) is no pace
            self.samples.clear()
            return
        if self.samples and step == self.samples[-1][1]:
            return
        self.samples.append((t, step))
        while len(self.samples) > 2 and t - self.samples[0][0] > self.WINDOW_S:
            self.samples.popleft()

    def step_s(self) -> Optional[float]:
        """Seconds per step, or None before a few steps over half a second at least were seen."""
        if len(self.samples) < 2:
            return None
        (t0, s0), (t1, s1) = self.samples[0], self.samples[-1]
        if s1 - s0 < 3 or t1 - t0 < 0.5:
            return None
        return (t1 - t0) / (s1 - s0)
