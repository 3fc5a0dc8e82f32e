"""A member's decisions, without IO: what a replica does at the top of a round, after its vote,
when the decision of a round it stepped past comes in, when it joins or enters a quorum, who
sends and who receives in a heal, whether a heal moves the whole state or keeps a fed spare's,
and when the run ended without it.

A state machine: `MemberCore.handle(event) -> commands`, and the pure rules the driver asks
(sits_out, redo, votes_ok, round_length, save_is_due, settles_first, holds_state, gives_up,
resumes_checkpoint, loop_ends, keeps_fed_state). One driver (member/driver.py) turns store replies, group results and timers into
events and carries out the commands, over the worker's effects in the product and the
simulator's under seeded faults, so both run exactly these decisions. The store protocol they
speak is ft/member/membership.py and ft/member/vote.py.

A hot spare fits these events without a new mechanism: a spare is a joiner the keeper leaves
out of its quorums until a member is lost (its `Join` waits as any joiner's does), and its
promotion is the quorum that lists it as a healer (`Joined`, `Entering`, `Entered`, then a heal
with it as a receiving end). Only the keeper's choice of members changes.

Must never import torch, touch a store, read a clock or the environment, sleep, or exit: it
returns commands, and the driver acts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple, Union

from ftrun.votes import Voting
from ftrun.wire import Quorum

Member = Tuple[int, int]  # (global rank, incarnation)

# The longest back-off between failed rounds with no new quorum in sight (seconds).
BACKOFF_MAX_S = 0.2


# ------------------------------------------------------------------ events (what happened)
@dataclass(frozen=True)
class RoundTop:
    """The top of a round: join, or switch to the quorum a decision named, as due."""


@dataclass(frozen=True)
class Joined:
    """The keeper took this incarnation in: enter `quorum` at `round` (or the run finished at
    step `finished` while it was joining)."""

    quorum: int = 0
    round: int = 0
    finished: Optional[int] = None


@dataclass(frozen=True)
class Entering:
    """The quorum about to be entered was read (a join, a switch, or a rebuild of the group)."""

    quorum: Quorum
    me: Member
    joining: bool = False


@dataclass(frozen=True)
class Entered:
    """The quorum is entered at `round` (the agreed entry round, or the joiner's)."""

    quorum: Quorum
    round: int


@dataclass(frozen=True)
class Computing:
    """The round's compute begins (after any join or switch): only a member in sync may vote ok."""


@dataclass(frozen=True)
class Skipped:
    """A round every member discards alike with no vote (a layout round with nothing to average)."""


@dataclass(frozen=True)
class CollectiveFailed:
    """A collective of this round failed (or could not begin): the round is voted down."""


@dataclass(frozen=True)
class InSync:
    """This member holds the committed state: it received it, or it is the source of a fresh
    quorum, or it resumed the final step from a checkpoint."""


@dataclass(frozen=True)
class FedCompared:
    """At a heal in a run with hot spares, before the transfer: what the heal's ends found of the
    healers' fed states. `followed`: every healer is a spare whose feed followed the training
    replicas (caught up to the source's step); `same`: each one's models and optimizers there
    are bit for bit the source's (fingerprints compared)."""

    followed: bool
    same: bool


@dataclass(frozen=True)
class Voted:
    """The decision of this member's own vote, read at once (a failed round, or a sharded
    replica's round): `taken` steps it took in the round, `kept` the steps the round keeps."""

    ok: bool
    taken: int
    commit: bool
    target: int
    kept: int


@dataclass(frozen=True)
class ClosedOk:
    """This member voted ok and stepped; its vote goes to the store off the training thread."""


@dataclass(frozen=True)
class Decided:
    """The decision of round `round`, which this member voted ok on and stepped past."""

    round: int
    commit: bool
    target: int


@dataclass(frozen=True)
class FinishedRead:
    """After a failed round: the step at which the others left the loop, or None."""

    step: Optional[int]


@dataclass(frozen=True)
class Received:
    """A heal put a peer's state into this member's objects: it is at that state's round."""

    round: int


@dataclass(frozen=True)
class StoreLost:
    """The run's store went away: the member rejoins on the next one."""


@dataclass(frozen=True)
class Compared:
    """The guard's check at this round's top: every member of this worker's group and the
    fingerprint of its state, and what differs between this member's state and the others'
    (the names of the first few entries that differ, or nothing when it agrees with all)."""

    me: int
    prints: Tuple[Tuple[int, Tuple[int, ...]], ...]  # (rank, fingerprint), one per member of the group
    step: int
    differs: Tuple[Tuple[int, str], ...] = ()  # (rank, what of its state differs from the majority's)


@dataclass(frozen=True)
class StepAgain:
    """A loop step whose round was voted down in one of its sub-steps is handed out again
    (member/iteration.py): what its later sub-steps' collectives said was that round's."""


Event = Union[RoundTop, Joined, Entering, Entered, Computing, Skipped, CollectiveFailed, InSync, FedCompared, Voted,
              ClosedOk, Decided, FinishedRead, Received, StoreLost, Compared, StepAgain]


# ------------------------------------------------------------------ commands (what to do)
@dataclass(frozen=True)
class Join:
    """Ask the keeper to take this incarnation in and wait for a quorum (membership.wait_to_enter)."""


@dataclass(frozen=True)
class Switch:
    """Read quorum `quorum` and enter it (a new quorum, or the same one to rebuild its group);
    `joining`: as the quorum a join just got in to (it begins at the round it was given)."""

    quorum: int
    joining: bool = False


@dataclass(frozen=True)
class AskEntryRound:
    """Agree with the quorum's other members on the round to begin it at (membership.entry_round).
    A question, as MoveState is: the part that asked answers it with its next event (Entered)."""


@dataclass(frozen=True)
class TakeStep:
    """The round was committed by the vote just read: step (a sharded replica's round)."""


@dataclass(frozen=True)
class Backoff:
    """Rounds keep failing with no new quorum in sight: wait before the next one."""

    seconds: float


@dataclass(frozen=True)
class ReadFinished:
    """Read whether the others left the loop (membership.finished_step), then report FinishedRead."""


@dataclass(frozen=True)
class Finish:
    """The run finished at `step`; `alone`: this member is not in sync and nobody is left to heal
    it (it exits with status 0, or resumes the final checkpoint)."""

    step: int
    alone: bool


@dataclass(frozen=True)
class Restart:
    """This member's state is not the committed one: exit 75, restart and heal like a newcomer.
    `charged`: the supervisor counts it against --max-restarts; not when the member's peers decided
    it (a round they decided otherwise: nothing is wrong with this process), yes when the member
    finds itself left out of a quorum. `clean`: it must begin again clean, never as a heal's
    source (its state is not the committed one, or its replica's other shards are not)."""

    why: str
    charged: bool = False
    clean: bool = False


@dataclass(frozen=True)
class Rejoin:
    """This member's state is not the committed one, but its process is sound (a round its peers
    decided otherwise): at the next round's top it leaves its quorum as this incarnation and joins
    again as the next one, which heals from a peer into its own objects, without leaving the
    process. Only where the driver can (`MemberCore.can_rejoin`); else the same case is a Restart."""

    why: str


@dataclass(frozen=True)
class MoveState:
    """Move the state over the heal's group: only what the healers lack (`kept`: their fed models
    and optimizers are the source's and stay), or all of it."""

    kept: bool


@dataclass(frozen=True)
class SitOut:
    """Vote this round down at its top without handing the script the step (the guard found
    replicas that differ: none of them trains on until the one that differs has healed)."""

    why: str


@dataclass(frozen=True)
class EndRun:
    """The run cannot go on whatever is restarted (replicas differ and no majority holds one
    state): every member leaves with EXIT_CANNOT_GO_ON, saying `why`."""

    why: str


Command = Union[Join, Switch, AskEntryRound, TakeStep, Backoff, ReadFinished, Finish, Restart, Rejoin, SitOut,
                EndRun, MoveState]


# ------------------------------------------------------------------ the machine
@dataclass
class MemberCore:
    """A member's decision state; its drivers read it and feed it events."""

    quorum: Optional[Quorum] = None
    round: int = 0
    group_round: int = -1  # the round at which the current group was built
    target_quorum: Optional[int] = None
    switch_round: Optional[int] = None  # the round at whose top the member switches to target_quorum
    rebuild: bool = False
    round_ok: bool = True
    in_sync: bool = False
    # Named a healer of the quorum it entered, and that heal has not landed: whatever this member
    # holds, the keeper's rules said it is not the committed state (after a store move, a state
    # past a round whose decision went with the lost store), so it trains nothing and is handed
    # no step until a heal lands (sits_out); it may still be named a source later, as the
    # keeper's rules allow, since what it holds is what it said it holds.
    healing: bool = False
    finished: bool = False
    failed_in_row: int = 0
    # The driver can rejoin in place (a whole replica of one worker whose supervisor keeps the
    # quorum: one node); set by the driver, kept across a rejoin.
    can_rejoin: bool = False
    # Ranks the guard last found differing from the majority, until a check finds the group
    # agreeing (kept across a rejoin: a member found different twice running cannot be healed).
    suspects: Tuple[int, ...] = ()

    def keeps_fed_state(self, followed: bool, same: bool) -> bool:
        return keeps_fed_state(followed, same)

    def handle(self, event: Event) -> List[Command]:
        return _HANDLERS[type(event)](self, event)

    # -------------------------------------------------------------- queries
    def due_switch(self) -> Optional[int]:
        """The quorum to switch to (or to rebuild the group of) at the top of this round, if any."""
        if self.target_quorum is not None and (self.rebuild or self.round >= (self.switch_round or 0)):
            return self.target_quorum
        if self.rebuild:
            return self.quorum.id
        return None

    # -------------------------------------------------------------- handlers
    def _on_RoundTop(self, e: RoundTop) -> List[Command]:
        if self.quorum is None:
            return [Join()]
        target = self.due_switch()
        return [Switch(target)] if target is not None else []

    def _on_Joined(self, e: Joined) -> List[Command]:
        if e.finished is not None:
            self.finished = True
            return [Finish(e.finished, alone=not self.in_sync)]
        self.round = e.round
        return [Switch(e.quorum, joining=True)]

    def _on_Entering(self, e: Entering) -> List[Command]:
        if e.me not in e.quorum.members:
            return [Restart(f"left out of quorum {e.quorum.id}", charged=True)]
        self.healing = e.me[0] in e.quorum.healers
        changed = self.quorum is None or e.quorum.id != self.quorum.id
        # Every continuing member begins the quorum at one round; a joiner at the one it was given.
        return [AskEntryRound()] if changed and not e.joining else []

    def _on_Entered(self, e: Entered) -> List[Command]:
        self.round = self.group_round = e.round
        self.quorum = e.quorum
        self.target_quorum = self.switch_round = None
        self.rebuild = False
        return []

    def _on_Computing(self, e: Computing) -> List[Command]:
        self.round_ok = self.round_ok and self.in_sync and not self.healing
        return []

    def _on_Skipped(self, e: Skipped) -> List[Command]:
        self.round += 1
        self.round_ok = True
        return []

    def _on_CollectiveFailed(self, e: CollectiveFailed) -> List[Command]:
        self.round_ok = False
        return []

    def _on_InSync(self, e: InSync) -> List[Command]:
        self.in_sync = True
        return []

    def _on_FedCompared(self, e: FedCompared) -> List[Command]:
        return [MoveState(self.keeps_fed_state(e.followed, e.same))]

    def _on_ClosedOk(self, e: ClosedOk) -> List[Command]:
        return self._end_round(True, self.quorum.id)

    def _on_Voted(self, e: Voted) -> List[Command]:
        if e.commit and not e.ok:  # possible only when a dead member's own vote and its abstention both counted
            return [Restart(f"round {self.round} was committed by its other members while this member's "
                            f"collectives had failed")]
        if not e.commit and e.kept != e.taken:  # a peer's collective failed earlier in the round than ours
            return [self._retake(f"round {self.round} keeps its first {e.kept} steps while this member had taken "
                                 f"{e.taken}")]
        out: List[Command] = [TakeStep()] if e.commit else []  # a sharded replica's one-step round
        out += self._end_round(e.commit, e.target)
        if e.commit:  # every member read this decision before stepping: they all switch at the next round
            self._note_target(e.target, self.round)
        return out

    def _on_Decided(self, e: Decided) -> List[Command]:
        if not e.commit:
            return [self._retake(f"round {e.round} was voted down after this member had stepped past it")]
        # Members read a commit at different moments of the round after it: the round after
        # that is the first boundary every one of them reaches knowing it.
        self._note_target(e.target, e.round + 2)
        return []

    def _on_FinishedRead(self, e: FinishedRead) -> List[Command]:
        if e.step is None:
            return []
        # The others left the loop (a joiner whose heal failed at the last boundary is left
        # alone in a round nobody else votes in): this member's run is over too.
        self.finished = True
        return [Finish(e.step, alone=not self.in_sync)]

    def _on_StepAgain(self, e: StepAgain) -> List[Command]:
        self.round_ok = True
        return []

    def _on_Received(self, e: Received) -> List[Command]:
        self.round = e.round
        self.healing = False
        return []

    def _on_StoreLost(self, e: StoreLost) -> List[Command]:
        self.quorum = None
        self.target_quorum = self.switch_round = None
        self.rebuild = False
        self.round_ok = True
        return []

    def _on_Compared(self, e: Compared) -> List[Command]:
        """The guard's verdict: members whose state differs from the majority's take it again
        from a peer (the round is voted down by all, so nobody trains on until then); with no
        majority (two replicas, or every one different) nobody can tell which state is right, and
        the run ends, naming what differs. A member found different again before any check
        found the group agreeing (its heal did not cure it: the script keeps or computes state no
        heal carries) would differ forever: the run ends."""
        kind, odd = verdict(e.prints)
        if kind == "agree":
            self.suspects = ()
            return []
        what = "; ".join(f"rank {r}: {w}" for r, w in e.differs) or "their fingerprints differ"
        ranks = ", ".join(str(r) for r, _ in e.prints)
        if kind == "split":
            return [EndRun(f"the replicas' states differ at step {e.step} and no majority holds one of them (ranks "
                           f"{ranks}; {what}): ftrun cannot tell which is right, so the run stops")]
        again = sorted(set(odd) & set(self.suspects))
        self.suspects = odd
        if again:
            return [EndRun(f"rank{'s' if len(again) > 1 else ''} {', '.join(map(str, again))} differ from their peers "
                           f"at step {e.step} again after a heal ({what}): the script keeps or computes state that "
                           f"no heal carries, so the run stops")]
        odd_text = ", ".join(str(r) for r in odd)
        if e.me not in odd:
            return [SitOut(f"rank{'s' if len(odd) > 1 else ''} {odd_text} hold{'' if len(odd) > 1 else 's'} a state "
                           f"that differs from the others' at step {e.step}")]
        mine = dict(e.differs).get(e.me, "its fingerprint differs")
        return [SitOut(f"its state differs from its peers' at step {e.step}"),
                self._retake(f"its state differs from its peers' at step {e.step} ({mine})")]

    def _retake(self, why: str) -> Union[Rejoin, Restart]:
        """This member's steps go past what its peers decided, its process is sound: it takes the
        committed state again, in place where the driver can."""
        return Rejoin(why) if self.can_rejoin else Restart(why)

    # -------------------------------------------------------------- the round's end
    def _end_round(self, commit: bool, target: int) -> List[Command]:
        self.round += 1
        self.round_ok = True
        if commit:
            self.failed_in_row = 0
            return []
        self.failed_in_row += 1
        self.rebuild = True  # the group may be broken: every member builds a fresh one
        out: List[Command] = []
        if self.failed_in_row > 3 and target <= self.quorum.id:
            # Rounds keep failing and no new quorum is in sight: wait a little for the keeper
            # to change membership instead of spinning (bounded).
            out.append(Backoff(min(BACKOFF_MAX_S, 0.005 * 2 ** min(self.failed_in_row - 3, 6))))
        # Every member that goes on from a failed round voted it down and waited for its
        # decision: they all switch at the next round.
        self._note_target(target, self.round)
        return out + [ReadFinished()]

    def _note_target(self, target: int, at_round: int) -> None:
        if target > self.quorum.id:
            self.target_quorum = max(target, self.target_quorum or 0)
            self.switch_round = at_round if self.switch_round is None else min(self.switch_round, at_round)


# Each event's handler, found once (a member handles a few events a step).
_HANDLERS = {cls: getattr(MemberCore, "_on_" + cls.__name__) for cls in Event.__args__}  # type: ignore[attr-defined]


def rejoins_in_place(replica_size: int, nodes: int) -> bool:
    """Whether a member can take the committed state again in its own process (Rejoin): its
    replica is this one worker, and its own supervisor keeps the quorum and books its
    incarnations (one node). Elsewhere the same case is a Restart."""
    return replica_size == 1 and nodes == 1


def transfer_ends(quorum: Quorum, rank: int, k: int = 1) -> List[int]:
    """The ends of a heal's transfer for worker `rank` (shard rank % k): first the quorum's source
    of that shard (the keeper chose it: Quorum.source), then the healers of that shard."""
    shard = rank % k
    source = quorum.source(shard)
    if source is None:
        raise ValueError(f"quorum {quorum.id} names no source of shard {shard}, and it heals")
    return [source] + [r for r in sorted(quorum.healers) if r != source and r % k == shard]


def source_refuses(sending: bool, tainted: bool, fresh: bool = False, holds_state: bool = False,
                   k: int = 1) -> Optional[Restart]:
    """Whether the source of a transfer must restart clean instead of sending: never a half-received
    state, nor one that stepped past a round voted down (`tainted` until it heals); and in a fresh
    quorum of sharded replicas (k > 1), never a worker that holds the trained
    state (`holds_state`: in sync on this store). A quorum is fresh when no replica holds the whole
    state, so such a worker's mates do not hold their shards of that step: sent with theirs, the
    replica would be a model whose shards come from different steps. The
    whole replica restarts and begins again from the first step or the checkpoint, as its
    mates do."""
    if sending and tainted:
        return Restart("named the source of a fresh quorum while holding a state that is not the committed one "
                       "(half-received, or stepped past a round voted down)", charged=True, clean=True)
    if sending and fresh and holds_state and k > 1:
        return Restart("named the source of a fresh quorum while the other workers of its replica do not hold "
                       "their shards of the trained state; the replica starts again whole", charged=True, clean=True)
    return None


# ------------------------------------------------------------------ the rules the driver asks
# Pure functions of what every member knows alike; the driver (member/driver.py) asks them at
# the same points on the worker and in the simulator.
def keeps_fed_state(followed: bool, same: bool) -> bool:
    """Whether a heal's healers keep their own models and optimizers (a promoted hot spare: only
    the rest of the state moves): only when every healer's feed followed up to the source's step
    and its fingerprints there are the source's. Anything else sends the whole state: a state
    kept on a fingerprint that differs would be a replica that silently differs."""
    return followed and same


def sits_out(in_sync: bool, healing: bool = False) -> bool:
    """Whether the round's top hands the script no step: this member does not hold the committed
    state (its heal did not land: the quorum's group or the transfer failed, so it holds its
    initial state, or a state it stepped past a round voted down on), or its quorum names it a
    healer and that heal has not landed (`healing`: in sync by its own books, but the keeper's
    rules found its state is not the run's; after a store move, one stepped past a round whose
    decision went with the lost store, which a later quorum may discard). It votes the round
    down at once, without the script's code, and heals again at the next round's top. Handed the
    step, the script would run its code (an evaluation, a log line) on a state that is not the
    run's, and the round would be voted down anyway (votes_ok)."""
    return not in_sync or healing


def redo(handed_before: bool, retaking: bool) -> bool:
    """ft.redo(): the step just handed out must not run the script's side effects (an evaluation,
    a save, a log line). Either it was handed out before on this state (the round that took it was
    discarded), or this member stepped past the round before it (its collectives went through,
    its vote off the training thread) and that round was voted down: its state is not the
    committed one, and the step is handed out again on the committed state (`retaking`, known
    once the driver has read that decision). The same on every member handed the step in a round."""
    return handed_before or retaking


def votes_ok(round_ok: bool, in_sync: bool, has_group: bool) -> bool:
    """The vote rule: ok only when every collective of the round went through, this member holds
    the committed state, and it has the quorum's group (else it sent nothing)."""
    return round_ok and in_sync and has_group


def save_is_due(step: int, total: Optional[int], every: int) -> bool:
    """A checkpoint after the step that brought the count to `step` (every N steps, and the last)."""
    return step > 0 and (step % every == 0 or (total is not None and step >= total))


def round_length(round_steps: int, k: int, layout_round: bool, step: int, total: Optional[int],
                 every: Optional[int], check_steps: int = 0) -> int:
    """Steps in the round starting at `step`: the quorum's round_steps, ending early where a
    checkpoint (every `every` steps; None: none) or the end of the loop needs the step decided,
    and where the guard checks (every `check_steps`: a round begins there). One step for sharded
    replicas (Voting.one_step_rounds) and layout rounds. The same on every member."""
    if Voting(k).one_step_rounds or layout_round:
        return 1
    n = max(1, round_steps)
    if total is not None:
        n = max(1, min(n, total - step))
    for s in range(step + 1, step + n):
        if (every is not None and save_is_due(s, total, every)) or (check_steps > 0 and s % check_steps == 0):
            return s - step
    return n


def check_due(check_s: float, step: int, check_steps: int, healed_quorum: bool, round_: int,
              group_round: int) -> bool:
    """Whether the guard compares the members' states at the top of round `round_`, at `step`: at
    every multiple of the quorum's check_steps (rounds begin there: round_length), and at the top
    of the round after the one its group began with when the quorum had healers (their heal's
    first round is stepped by then). Never when the guard is off (`check_s` 0). Made of what every
    member of a quorum knows alike, so they all check at the same top (a collective)."""
    if check_s <= 0 or step <= 0:
        return False
    return (check_steps > 0 and step % check_steps == 0) or (healed_quorum and round_ == group_round + 1)


def verdict(prints: Sequence[Tuple[int, Tuple[int, ...]]]) -> Tuple[str, Tuple[int, ...]]:
    """The guard's rule on the fingerprints of a group's members, (rank, fingerprint) each:
    ("agree", ()) when all are equal; ("heal", ranks) when a strict majority holds one state and
    `ranks` differ from it; ("split", ()) when no state is held by more than half of them."""
    groups: dict = {}
    for rank, fp in prints:
        groups.setdefault(tuple(fp), []).append(rank)
    if len(groups) <= 1:
        return "agree", ()
    biggest = max(groups.values(), key=lambda ranks: (len(ranks), -min(ranks)))
    if 2 * len(biggest) <= len(prints):
        return "split", ()
    return "heal", tuple(sorted(r for r, _ in prints if r not in biggest))


def settles_first(vote_in_flight: bool, save_due: bool, switch_due: bool, step: int, total: Optional[int]) -> bool:
    """Whether the round's top waits for the decision of the vote in flight: a checkpoint, a
    switch (whose heal sends this state) and the end of the loop need the last step decided."""
    return vote_in_flight and (save_due or switch_due or (total is not None and step >= total))


def holds_state(in_sync: bool, healed_gen: int, store_gen: int) -> bool:
    """Heal bookkeeping: this member holds the trained state on the current store (it healed, or
    was the source, since the store's last move)."""
    return in_sync and healed_gen == store_gen


def gives_up(latest_seen: int, quorum_id: int, gone: Callable[[], Optional[str]]) -> Optional[str]:
    """Why a group of quorum `quorum_id` is given up while forming: a newer quorum is out (its members
    never come), or some of its ranks are gone (`gone()`: membership.gone, asked only then);
    None: keep waiting."""
    if latest_seen > quorum_id:
        return f"quorum {latest_seen} is out"
    return gone()


def resumes_checkpoint(sending: bool, fresh: bool, in_sync: bool, has_checkpoints: bool, resumed: bool) -> bool:
    """The source of a fresh quorum (no member holds trained state) first loads the newest
    checkpoint, once per incarnation, so that the heal spreads it."""
    return sending and fresh and not in_sync and has_checkpoints and not resumed


def loop_ends(finished: bool, step: int, total: Optional[int]) -> bool:
    """The loop is over: the run finished (another member left it), or the total is committed."""
    return finished or (total is not None and step >= total)
