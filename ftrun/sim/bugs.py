"""Historic --ft bugs, re-introduced for the simulator only: each is the product's code as it
was before its fix, put back as a subclass of a product class (the keeper,
or the member's driver, whose store protocol steps are class attributes) that the simulator
wires in by name (scripts/simulate.py --bug NAME); never by patching a module. The product
never imports this module; with no bug the simulator runs the product's own classes unchanged.
Which commit fixed each, and whether the simulator found it first or it was planted, is in
docs/development.md (the table of `--bug` names), not here.
Must never be imported by the product.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from ftrun import keys, votes
from ftrun.supervisor.ft.keeper.core import KeeperSnapshot
from ftrun.supervisor.ft.keeper.dead import QUORUM_COLLECTED, KeeperRules
from ftrun.supervisor.policy.failure_policy import FailurePolicy, ReplicaFailed, RestartAction, RestartVerdict
from ftrun.supervisor.ft.quorum import QuorumKeeper
from ftrun.wire import Quorum
from ftrun.worker.ft.member import vote
from ftrun.worker.ft.member import core as member_core
from ftrun.worker.ft.member.driver import MemberDriver
from ftrun.worker.ft.member.membership import Entry, Member


class Wiring:
    """What the simulator runs: the keeper's class (node 0's, and the leader's after a store move),
    the other nodes' keepers' class, the member driver's class and the supervisor's failure
    policy's class."""

    keeper = QuorumKeeper
    driver = MemberDriver
    policy = FailurePolicy
    follower = QuorumKeeper  # the other nodes' keepers


# ---------------------------------------------------------------- (a) start-round
def _entry_round_own(store: Any, quorum: Quorum, current: int) -> int:
    """Before the fix: a continuing member wrote its round as the quorum's start and began the
    quorum at its OWN round, whatever the first member to enter had written."""
    if quorum.start_round >= 0:
        return quorum.start_round
    store.compare_set(keys.start_key(quorum.id), "", str(current))
    return current


class _OwnRoundDriver(MemberDriver):
    entry_round = staticmethod(_entry_round_own)


class StartRound(Wiring):
    driver = _OwnRoundDriver


# ---------------------------------------------------------------- (b) deleted-quorum
def _scan_blocking(store: Any, me: Member, latest: int) -> Optional[Tuple[int, int]]:
    """Before the fix: the scan read each quorum with a blocking get, even one the keeper had
    deleted (the get then waits for the store's whole timeout, deaf to newer quorums)."""
    for e in range(latest, 0, -1):
        quorum = Quorum.from_json(store.get(keys.quorum_key(e)))
        if me not in quorum.members:
            return None
        if quorum.start_round >= 0:
            return e, quorum.start_round
        if store.check([keys.start_key(e)]):
            return e, int(store.get(keys.start_key(e)))
    return None


def _wait_to_enter_blocking(store: Any, me: Member, sleep: Callable[[float], None], poll_s: float,
                            moved: Callable[[], bool] = lambda: False) -> Entry:
    store.set(keys.join_key(me[0]), str(me[1]))
    while True:
        if store.check([keys.FINISHED]):
            return Entry(finished=int(store.get(keys.FINISHED)))
        latest = int(store.get(keys.LATEST)) if store.check([keys.LATEST]) else 0
        found = _scan_blocking(store, me, latest)
        if found is not None:
            return Entry(found[0], found[1], latest)
        sleep(poll_s)


class _BlockingScanDriver(MemberDriver):
    wait_to_enter = staticmethod(_wait_to_enter_blocking)


# ---------------------------------------------------------------- the keeper's abstentions of that time
class _AbstainingRules(KeeperRules):
    def rounds_of(self, s: KeeperSnapshot, e: int) -> Set[int]:
        """Before the store-growth fix: the keeper abstained for the dead in the two rounds after
        the newest decided one in every quorum that lists them, also old quorums nobody reports
        being in. Every keeper the historic bugs below ran with
        did; the bugs that need such an abstention (it decides a round before a joiner reports)
        are shown on it."""
        rounds = {s.top + 1, s.top + 2}
        if s.starts.get(e, -1) >= 0:
            rounds |= {s.starts[e], s.starts[e] + 1}
        for r, inc in s.alive.items():
            info = s.report(r)
            if info.of(inc) and info.quorum_id == e and info.round is not None:
                rounds |= {info.round, info.round + 1}
        return rounds


class _AbstainingEverywhere(QuorumKeeper):
    rules = _AbstainingRules()


class StoreGrowth(Wiring):
    keeper = _AbstainingEverywhere


# ---------------------------------------------------------------- (c) collect-joiner
class _CollectingRules(_AbstainingRules):
    def oldest_kept_quorum(self, s: KeeperSnapshot) -> int:
        """Before the fix: quorums older than every live replica's reported quorum were deleted even
        while a live replica (a joiner) reported none yet and was about to enter one of them."""
        return min(s.live_quorums(), default=s.quorum_id) - 2


class _CollectingKeeper(QuorumKeeper):
    rules = _CollectingRules()


class CollectJoiners(Wiring):
    keeper = _CollectingKeeper


class DeletedQuorum(Wiring):
    """The joiner's fix came before the keeper's (collect-joiner): then the keeper still deleted
    quorums while a joiner scanned them, which the keeper no longer does. The bug is shown on the
    keeper of its time: a schedule that fails with both and passes with the keeper's bug alone
    (BASELINE)."""

    keeper = _CollectingKeeper
    driver = _BlockingScanDriver


# ---------------------------------------------------------------- (d) voter-waits: the keeper half of start-round's fix
class _DeafRules(KeeperRules):
    def elsewhere(self, s: KeeperSnapshot, m: int, k: int, e: int, now: float) -> bool:
        """Before the fix: only a member reporting ANOTHER quorum was voted for; a joiner that
        reports none yet, and will enter the newest quorum, left the old quorum's voters waiting."""
        if (m, k) in s.finished:
            return True
        mi = s.report(m)
        return s.alive.get(m) == k and mi.inc == k and s.fresh(m, now) and mi.quorum_id not in (None, e)


class _DeafKeeper(QuorumKeeper):
    rules = _DeafRules()


class VoterWaits(Wiring):
    keeper = _DeafKeeper


# ---------------------------------------------------------------- (e) revote
class _RevotingRules(KeeperRules):
    def rounds_to_fill(self, s: KeeperSnapshot, e: int) -> Set[int]:
        """Before the fix: the keeper kept abstaining for a dead member in every round its peers
        might wait on, even rounds whose keys it had collected: the vote started a fresh counter
        and closed the round a second time, with another decision."""
        return self.rounds_of(s, e)


class _RevotingKeeper(QuorumKeeper):
    rules = _RevotingRules()


class Revote(Wiring):
    keeper = _RevotingKeeper


# ---------------------------------------------------------------- (f) finished-voter: its keeper half
class _FinishedDeafRules(KeeperRules):
    def elsewhere(self, s: KeeperSnapshot, m: int, k: int, e: int, now: float) -> bool:
        """Before the fix: a member that had left the loop (exit 0) was not voted for; a member
        whose heal failed at the last round boundary then waited in a round nobody else votes in."""
        mi = s.report(m)
        return (s.alive.get(m) == k and mi.inc == k and s.fresh(m, now)
                and (mi.quorum_id not in (None, e) or (mi.quorum_id is None and e < s.quorum_id)))


class _FinishedDeafKeeper(QuorumKeeper):
    rules = _FinishedDeafRules()


def _never_finished(store: Any) -> Optional[int]:
    """Before the fix: a member whose round failed did not look whether the others had left the loop."""
    return None


class _FinishedBlindDriver(MemberDriver):
    finished_step = staticmethod(_never_finished)


class FinishedVoter(Wiring):
    keeper = _FinishedDeafKeeper
    driver = _FinishedBlindDriver


# ---------------------------------------------------------------- (h) mixed-shards: sharded replicas
def _source_sends_any_shard(sending: bool, tainted: bool, fresh: bool = False, holds_state: bool = False,
                            k: int = 1) -> Optional[member_core.Restart]:
    """Before the fix: in a fresh quorum of sharded replicas a source worker that held its shard
    of the trained state sent it, while its mate (never healed) sent its initial shard: one
    replica of shards from different steps."""
    return member_core.source_refuses(sending, tainted)


class _AnyShardDriver(MemberDriver):
    source_refuses = staticmethod(_source_sends_any_shard)


class MixedShards(Wiring):
    driver = _AnyShardDriver


# ---------------------------------------------------------------- (i) lost-forward: several nodes
class _NodeForgettingKeeper(QuorumKeeper):
    def on_node_lost(self, node: int, ranks: List[int]) -> None:
        """Before the fix: the keeper took a lost node's votes as cast. Those it had cast through
        the node's store for a member that died as the node's last voter were never forwarded,
        and the round waited for ever for them."""
        self.routes.lose(node)
        for rank in ranks:
            inc = self.alive.get(rank)
            if inc is not None:
                self.on_exit(rank, inc)


class LostForward(Wiring):
    keeper = _NodeForgettingKeeper


# ---------------------------------------------------------------- (j) quorum-revote: sharded replicas
class _QuorumRevotingRules(KeeperRules):
    def rounds_to_fill(self, s: KeeperSnapshot, e: int) -> Set[int]:
        """Before the fix: a quorum whose keys were all collected kept no horizon, so a vote for a
        member that died later (its start round is always filled) began a fresh count there and
        decided a decided round a second time."""
        below = s.collected_below.get(e, -1)
        below = -1 if below >= QUORUM_COLLECTED else below
        return {r for r in self.rounds_of(s, e) if r >= below}


class _QuorumRevotingKeeper(QuorumKeeper):
    rules = _QuorumRevotingRules()


class QuorumRevote(Wiring):
    keeper = _QuorumRevotingKeeper


# ---------------------------------------------------------------- (k) unstick-overcount: three nodes
def _closes_at_size(total: int, added: int, size: int) -> bool:  # noqa: ARG001
    """Before the fix: an add completed a count only where it left it at exactly its size. The
    keeper had voted fail for a member it found in no quorum (SIGSTOPped), the member resumed and
    voted too; a node's forward then took the run's count from below its size to past it, and
    the round waited for ever."""
    return votes.tally(total).votes == size


class _OvercountDriver(MemberDriver):
    cast_vote = staticmethod(functools.partial(vote.cast, closes=_closes_at_size))


class _OvercountRules(KeeperRules):
    closes = staticmethod(_closes_at_size)


class _OvercountKeeper(QuorumKeeper):
    rules = _OvercountRules()


class UnstickOvercount(Wiring):
    driver = _OvercountDriver
    keeper = _OvercountKeeper


# ---------------------------------------------------------------- (l) budget-overrun: the restart budget
class _OneMoreRestartPolicy(FailurePolicy):
    """Planted (no commit): the budget's test off by one, so a replica past its budget restarts
    once more (counted) instead of being dropped or giving the run up."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._overrun: Set[int] = set()

    def on_replica_failure(self, ev: ReplicaFailed) -> RestartAction:
        act = super().on_replica_failure(ev)
        if act.verdict in (RestartVerdict.DROP_REPLICA, RestartVerdict.GIVE_UP) and ev.replica not in self._overrun:
            self._overrun.add(ev.replica)
            return RestartAction(RestartVerdict.RESTART_REPLICA, ev.replica, act.restarts + 1)
        return act


class BudgetOverrun(Wiring):
    policy = _OneMoreRestartPolicy


# ---------------------------------------------------------------- (m) drop-below-min: --min-replicas
class _AlwaysDropPolicy(FailurePolicy):
    """Planted (no commit): past its budget a replica is dropped whatever is left of the run,
    without the --min-replicas test that gives the run up instead."""

    def on_replica_failure(self, ev: ReplicaFailed) -> RestartAction:
        act = super().on_replica_failure(ev)
        if act.verdict is RestartVerdict.GIVE_UP:
            return RestartAction(RestartVerdict.DROP_REPLICA, ev.replica, act.restarts, why=act.why)
        return act


class DropBelowMin(Wiring):
    policy = _AlwaysDropPolicy


# ---------------------------------------------------------------- (n) keyless-add: elastic late ranks
class _KeylessAddKeeper(QuorumKeeper):
    """Planted (no commit): a late node's ranks become the keeper's before their keys exist (no
    compare_set of their join, healed, entered, info and incarnation keys): the next poll's read
    of every rank's keys waits on keys nobody writes until the newcomer has healed, which waits
    on a quorum that only the poll publishes."""

    def add_ranks(self, ranks: List[int], relay: Optional[Tuple[int, str]] = None) -> None:
        new = [r for r in ranks if r not in self.ranks]
        for r in new:
            self.alive.setdefault(r, 0)
        self.ranks = sorted(self.ranks + new)


class KeylessAdd(Wiring):
    keeper = _KeylessAddKeeper


# ---------------------------------------------------------------- (o) forgetful-stop: stop quorums
class _ForgetfulStopKeeper(QuorumKeeper):
    """Planted (no commit): the keeper publishes one stop quorum and then forgets the stop, so a
    member's death during the stop publishes an ordinary quorum in which the others train on."""

    def stop(self) -> Optional[int]:
        writer = super().stop()
        self.stopping = False
        return writer


class ForgetfulStop(Wiring):
    keeper = _ForgetfulStopKeeper


# ---------------------------------------------------------------- (p) move-recount: the store's moves
class _RecountingKeeper(QuorumKeeper):
    """Planted (no commit): the keeper started on a moved store as on a new run: it counts quorums
    from the first again, above no quorum a replica saw, and takes no replica's word for what it
    holds, so quorums the lost store published are published again, otherwise."""

    def store_moved(self, old: QuorumKeeper, alive) -> None:
        super().store_moved(old, alive)
        self.quorum_id, self.moved = 0, False


class MoveRecount(Wiring):
    keeper = _RecountingKeeper


# ---------------------------------------------------------------- (r) first-source-only: store moves
class _FirstSourceOnlyKeeper(QuorumKeeper):
    """Before the fix: the keeper of a moved store took the survivors' words for its first quorum
    only. When that quorum's source died in its transfer, the next quorum was fresh, and its lowest
    replica (one restarted since the move) sent its initial state over the newest committed step
    two live replicas held."""

    def _publish(self, why: str, quiet: bool = False):
        decision = super()._publish(why, quiet)
        if not decision.quorum.stop:
            self.moved = False
        return decision


class FirstSourceOnly(Wiring):
    keeper = _FirstSourceOnlyKeeper


# ---------------------------------------------------------------- (s) blocking-follower: store moves
class _BlockingFollower(QuorumKeeper):
    def _follow(self) -> None:
        """Before the fix: a follower read the quorum LATEST names with a blocking get. On a moved
        store LATEST first names no quorum (the leader counts on above every quorum seen, and this
        follower's count may be lower): the read stopped the node's supervision, its relay with it,
        and a member waiting there for a decision the lost store held waited for ever."""
        s = self._s
        latest = int(s.get(keys.LATEST)) if s.check([keys.LATEST]) else 0
        if latest != self.quorum_id and latest > 0:
            quorum = Quorum.from_json(s.get(keys.quorum_key(latest)))
            self.quorum_id = latest
            self.members = dict(quorum.members)
        healed, infos = self.reports.read(s, [keys.healed_key(r) for r in self.ranks], self.ranks, self.routes)
        now = self.clock()
        self._absorb(healed, infos, now)
        self._track_waits(self._snapshot(), now)


class BlockingFollower(Wiring):
    follower = _BlockingFollower


# ---------------------------------------------------------------- (q) early-save: checkpoints
def _settles_for_switches(vote_in_flight: bool, save_due: bool, switch_due: bool, step: int,
                          total: Optional[int]) -> bool:
    """Planted (no commit): the round's top waits for the vote in flight before a switch and at the
    loop's end, not before a save: the writer saves a step whose round may yet be voted down."""
    return member_core.settles_first(vote_in_flight, False, switch_due, step, total)


class _EarlySaveDriver(MemberDriver):
    settles_first = staticmethod(_settles_for_switches)


class EarlySave(Wiring):
    driver = _EarlySaveDriver


# ---------------------------------------------------------------- (t) finished-writer: the stop's writer
class _FinishedWriterKeeper(QuorumKeeper):
    """Before the fix (--checkpoints --stops): the keeper forgot which replica its stop quorum
    named the writer, so a writer that left the loop before that quorum reached it
    (its exit 0 seen a moment after) published no stop quorum naming another, and a stop quorum that
    named nobody after it said nothing in its place: the supervisor waited out its grace."""

    def _publish(self, why: str, quiet: bool = False):
        decision = super()._publish(why, quiet)
        self.writer = -1
        return decision


class FinishedWriter(Wiring):
    keeper = _FinishedWriterKeeper


# ---------------------------------------------------------------- (u) unsynced-step: a step out of sync
def _never_sits_out(in_sync: bool, healing: bool = False) -> bool:  # noqa: ARG001
    """Before the fix: the round's top handed the script a step whatever the member held. A
    restarted replica whose group or heal failed (a newer quorum was out) ran the script's code,
    an evaluation and a log line, on its initial state; the round was voted down, the script's
    output stood (the ported nanoGPT test's "step 0" printed twice)."""
    return False


class _UnsyncedStepDriver(MemberDriver):
    sits_out = staticmethod(_never_sits_out)


class UnsyncedStep(Wiring):
    driver = _UnsyncedStepDriver


# ---------------------------------------------------------------- (v) undecided-redo: ft.redo() undecided
class _UndecidedRedoDriver(MemberDriver):
    @property
    def redo(self) -> bool:
        """Before the fix: ft.redo() said only whether the step was handed out before on this
        state. A member that stepped past a round and was handed the next step before that
        round's decision ran the step's side effects; the round was voted down, the member healed
        from a peer that had not been handed the step, and ran them again (the ported nanoGPT
        test's step 20 evaluation printed twice)."""
        return self.handed_before


class UndecidedRedo(Wiring):
    driver = _UndecidedRedoDriver


# ---------------------------------------------------------------- (w) spare-short: hot spares
class _SpareShortKeeper(QuorumKeeper):
    """Planted (no commit): the keeper decides from one spare fewer than --spares, so one replica
    too many trains (with --spares 1, none is held back)."""

    def _snapshot(self, top: int = -1, **read: Any) -> KeeperSnapshot:
        snap = super()._snapshot(top, **read)
        return dataclasses.replace(snap, spares=max(0, snap.spares - 1))


class SpareShort(Wiring):
    keeper = _SpareShortKeeper


class _LoneCheckDriver(MemberDriver):
    """The guard's due rule read from what one member knows alone (its own count of rounds since it
    joined, here: odd ranks skip the check after a heal): members reach one collective with
    different ones (torch would mix a check's fingerprints into a step's gradients)."""

    def check_due(self, check_s, step, check_steps, healed_quorum, round_, group_round):  # type: ignore[override]
        return member_core.check_due(check_s, step, check_steps, healed_quorum and self.rank % 2 == 0, round_,
                                     group_round)


class LoneCheck(Wiring):
    driver = _LoneCheckDriver


# ---------------------------------------------------------------- (y) kept-unlike
class _KeepUnlikeCore(member_core.MemberCore):
    """Planted: a promoted spare keeps its fed state whenever its feed followed, without asking
    whether its fingerprints are the source's."""

    def keeps_fed_state(self, followed: bool, same: bool) -> bool:  # type: ignore[override]
        return followed


class _KeepUnlikeDriver(MemberDriver):
    core_class = _KeepUnlikeCore


class KeepUnlike(Wiring):
    driver = _KeepUnlikeDriver


# ---------------------------------------------------------------- (z) failed-healer: a healer's own state stepped
def _sits_out_unless_in_sync(in_sync: bool, healing: bool = False) -> bool:  # noqa: ARG001
    """Before the fix: only a member out of sync sat a round out. After a store move, a survivor
    that had stepped past a round whose decision went with the lost store was named a healer, its
    transfer failed, and, in sync by its own books, it was handed the next step on that
    undecided state: the script evaluated a state a later quorum healed away."""
    return not in_sync


class _FailedHealerDriver(MemberDriver):
    sits_out = staticmethod(_sits_out_unless_in_sync)


class FailedHealer(Wiring):
    driver = _FailedHealerDriver


BUGS: Dict[str, type] = {
    "none": Wiring,
    "start-round": StartRound,        # (a) members entering a quorum at different rounds
    "deleted-quorum": DeletedQuorum,    # (b) a joiner blocked on a deleted quorum
    "collect-joiner": CollectJoiners,  # (c) the keeper deleting keys a joiner needed
    "voter-waits": VoterWaits,        # (d) a voter waiting for a joiner that never comes
    "revote": Revote,                 # (e) a decided round decided again
    "finished-voter": FinishedVoter,  # (f) a voter waiting for a member that left the loop
    "store-growth": StoreGrowth,      # (g) abstentions piling up in quorums nobody is in
    "mixed-shards": MixedShards,      # (h) a fresh quorum's sharded source of shards from two steps
    "lost-forward": LostForward,      # (i) a lost node's unforwarded votes taken as cast
    "quorum-revote": QuorumRevote,      # (j) a vote in a quorum whose keys were all collected
    "unstick-overcount": UnstickOvercount,  # (k) a count jumping past its size, never closed
    "budget-overrun": BudgetOverrun,  # (l) planted: a replica restarted past its budget
    "drop-below-min": DropBelowMin,   # (m) planted: a replica dropped with fewer than --min-replicas left
    "keyless-add": KeylessAdd,        # (n) planted: a late node's ranks polled before their keys exist
    "forgetful-stop": ForgetfulStop,  # (o) planted: an ordinary quorum published after a stop quorum
    "move-recount": MoveRecount,      # (p) planted: a moved store's keeper counting quorums from 1 again
    "early-save": EarlySave,          # (q) planted: a checkpoint of a step whose round was not decided yet
    "first-source-only": FirstSourceOnly,  # (r) a moved store's survivors forgotten after one quorum
    "blocking-follower": BlockingFollower,  # (s) a follower blocked on a moved store's LATEST
    "finished-writer": FinishedWriter,  # (t) a stop's writer that had left the loop, never replaced
    "unsynced-step": UnsyncedStep,    # (u) a step handed to the script on a state out of sync
    "undecided-redo": UndecidedRedo,  # (v) ft.redo() False on a step handed before its round's decision
    "spare-short": SpareShort,        # (w) planted: one hot spare fewer held back than --spares says
    "lone-check": LoneCheck,          # (x) planted: the guard's check due on some members only
    "kept-unlike": KeepUnlike,        # (y) planted: a fed spare's state kept with fingerprints unlike its source's
    "failed-healer": FailedHealer,    # (z) a healer whose heal failed handed steps on its own state
}
# What a bug's schedule must pass for the failure to be that bug's (simulate.py --only-bug).
BASELINE: Dict[str, str] = {"deleted-quorum": "collect-joiner"}
