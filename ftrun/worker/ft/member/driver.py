"""The member's driver: the one loop that carries out a --ft member's decisions (member/core.py)
over its effects (member/effects.py). The worker's manager (ft/manager.py) runs it over torch and
the TCPStore; the simulator (ftrun/sim) runs this very class over its in-memory store, simulated
groups and virtual clock, so both run the same code.

A round is one attempt at a step. Each member adds its vote (ok, or failed) to the round's
counter in the store (ft/member/vote.py); the member whose vote completes the count writes the decision,
the others read it. A member whose collectives succeeded steps at once and reads the decision
during the next round, before that round's first collective; one whose action the decision
contradicts takes the committed state again (in place, or by a restart). Members switch to the
quorum a decision names at one boundary; a thread learns of new quorums as they are published. A
new or restarted replica asks to join, is put into a quorum as a healer, and receives the state
from a peer. Components that own their fields: joining and switching with the quorum's group
(member/entry.py), the quorum watcher (watch.py), the heal (heal.py), the layout rounds
(layout.py), the ways out of the loop (stop.py) and the store's moves (moves.py). They report
events to the core and hand what it answers to `execute`, the one place a command is carried out.
Must never raise a collective failure into the user's loop, never import torch, and never
import the supervisor.
"""

from __future__ import annotations

from typing import Any, Iterator, List, Optional, Tuple

from ftrun import exits, keys, pacing, votes
from ftrun.wire import MemberReport, Quorum, SurvivorReport
from ftrun.worker.ft.member import membership, vote
from ftrun.worker.ft.member import core
from ftrun.worker.ft.member.core import (AskEntryRound, Backoff, ClosedOk, CollectiveFailed, Command, Compared,
                                         Computing, Decided, EndRun, Finish, FinishedRead, Join, MemberCore,
                                         MoveState, ReadFinished, Rejoin, Restart, RoundTop, SitOut, Skipped,
                                         Switch, TakeStep, Voted)
from ftrun.worker.ft.member.effects import MemberEffects, Snapshot
from ftrun.worker.ft.member.entry import QuorumEntry
from ftrun.worker.ft.member.heal import HealTransfers
from ftrun.worker.ft.member.iteration import VOTE, Iteration
from ftrun.worker.ft.member.layout import LayoutRounds
from ftrun.worker.ft.member.member_io import PEER_LOST, _plain
from ftrun.worker.ft.member.moves import StoreFollower
from ftrun.worker.ft.member.stop import StopPaths
from ftrun.worker.ft.member.watch import QuorumWatch

SLOW_S = 2.0  # a protocol wait longer than this is worth a line in the log
GONE_LOOK_S = 0.05  # how often a member asks the store whether a peer is gone, while a newer quorum is out


class MemberDriver:
    """One member (a worker of a replica): its loop, rounds, quorums and rejoins."""

    # The store protocol's steps, as class attributes: the simulator's historic bugs put old ones
    # back in a subclass (ftrun/sim/bugs.py), never by patching a module.
    wait_to_enter = staticmethod(membership.wait_to_enter)
    entry_round = staticmethod(membership.entry_round)
    finished_step = staticmethod(membership.finished_step)
    source_refuses = staticmethod(core.source_refuses)
    settles_first = staticmethod(core.settles_first)
    core_class = MemberCore  # the member's decisions (a historic bug of the simulator's is a subclass)
    sits_out = staticmethod(core.sits_out)
    check_due = staticmethod(core.check_due)
    cast_vote = staticmethod(vote.cast)

    def __init__(self, fx: MemberEffects, rank: int, inc: int, k: int, nodes: int,
                 checkpoints: Any = None, state: Any = None, store_gen: int = 0,
                 check_s: float = pacing.CHECK_S) -> None:
        self.fx = fx
        self.check_s = check_s  # seconds between the guard's checks (0: the guard is off)
        self.rank, self.inc, self.k = rank, inc, k
        self.voting = votes.Voting(k)
        self.replica, self.shard = divmod(rank, k)
        self.node = fx.node()
        self.store_gen = store_gen
        self.store = fx.connect()
        self.ballot = self._new_ballot()
        self.core = self.core_class(can_rejoin=core.rejoins_in_place(k, nodes))
        self.checkpoints = checkpoints  # a Checkpointer (--checkpoint-dir), or None
        self.state = state  # what a checkpoint saves and resumes (ft/heal/state.py's ReplicaState), or None
        self.layout = LayoutRounds()
        self.iteration = Iteration()  # the loop step's sub-steps, with several ft.Optimizers
        self.heals = HealTransfers(self)
        self.stops = StopPaths(self)
        self.moves = StoreFollower(self)
        self.watch = QuorumWatch(self)
        self.entry = QuorumEntry(self)
        self.step = 0
        # A round is up to quorum.round_steps steps; `round_len` is this round's, fixed at its top
        # from what every member knows alike, and `taken` how many of them this member has stepped.
        self.round_len = 1
        self.taken = 0
        self.total: Optional[int] = None
        self.waiting_round: Optional[int] = None  # the round whose decision the member waits for
        # Why this member takes the committed state again in place at the next round's top, or None.
        self.rejoin_why: Optional[str] = None
        self.save_due = False  # a checkpoint at the top of the next round (after a due commit)
        self.unsettled = False  # the decision of a round it stepped past was lost with the run's store
        self.loop_ending = False  # ft.epochs() ran out (finish_loop): its save is the loop's last
        self.looping = False  # inside ft.steps() or ft.epochs() (opt.step() outside one is a misuse)
        self.step_open = False  # a step's top ran and opt.step() has not voted on it yet
        self.step_serial = 0  # counts step tops: an ft.DataLoader rewinds to its committed position at each
        # The newest step handed to the script, and whether the step just handed out was handed
        # out before on this state (a discarded round): what ft.redo() starts from (`redo`).
        self.yielded = -1
        self.handed_before = False
        self.committed = 0
        self.discarded = 0
        self.last_failure: Optional[str] = None
        self.phase = "init"
        self.phase_since = fx.wall()
        self._index_of: Tuple[int, int] = (-1, 0)  # (quorum id, replica index in it)
        self._node_count: Tuple[int, int] = (-1, 0)  # (quorum id, its members voting through this node)
        # The last look at whether a member of the quorum is gone (`_member_gone`): (quorum id, newest
        # quorum seen), when, and why (None: all there).
        self._gone: Tuple[Tuple[int, int], float, Optional[str]] = ((-1, -1), 0.0, None)

    def _new_ballot(self) -> vote.Ballot:
        fx = self.fx
        return vote.Ballot(fx.connect, fx.node, fx.spawn, fx.signal, self.cast_vote)

    # ------------------------------------------------------------ what the member's state says
    latest_seen = property(lambda self: self.watch.latest)
    pg = property(lambda self: self.entry.pg)  # the quorum's group of this worker's shard (the replica's when k == 1)
    quorum = property(lambda self: self.core.quorum)
    round = property(lambda self: self.core.round)
    round_ok = property(lambda self: self.core.round_ok)
    in_sync = property(lambda self: self.core.in_sync)
    finished = property(lambda self: self.core.finished)
    group_round = property(lambda self: self.core.group_round)

    @property
    def shard_id(self) -> Optional[int]:
        """The shard index that names this worker's groups and keys (none for whole replicas)."""
        return self.shard if self.k > 1 else None

    @property
    def num_replicas(self) -> int:
        return len(self.quorum.members) // self.k if self.quorum else 1

    @property
    def replica_index(self) -> int:
        if self.quorum is None:
            return 0
        if self._index_of[0] != self.quorum.id:  # asked every step by most scripts: once per quorum
            self._index_of = (self.quorum.id, sorted({r // self.k for r in self.quorum.ranks}).index(self.replica))
        return self._index_of[1]

    def shard_ranks(self, quorum: Quorum) -> List[int]:
        """Worker `shard` of every replica of the quorum: the ranks of this worker's group."""
        return [r for r in quorum.ranks if r % self.k == self.shard]

    def node_size(self) -> int:
        """How many of the quorum's members vote through this member's node (0: no node)."""
        if self.node is None or self.quorum is None:
            return 0
        if self._node_count[0] != self.quorum.id:
            self._node_count = (self.quorum.id, self.node.size(self.quorum.members))
        return self._node_count[1]

    def info(self) -> MemberReport:
        """What the member reports (`ftrun status`, and the keeper, which reads inc, quorum_id, round):
        its beat is the reporter's (ftrun.worker.progress)."""
        h = self.heals
        return MemberReport(
            inc=self.inc, quorum_id=self.quorum.id if self.quorum else None,
            replicas=self.num_replicas if self.quorum else 0, in_quorum=self.quorum is not None and self.in_sync,
            healing=self.phase == "heal", step=self.step,
            round=self.waiting_round if self.waiting_round is not None else self.round,
            committed=self.committed, discarded=self.discarded, last_heal_s=h.last_heal_s,
            phase=self.phase, phase_since=self.phase_since, heals=h.count, last_transfer=h.last_transfer)

    @property
    def redo(self) -> bool:
        """ft.redo() (core.redo). A member that stepped past the round before this step first reads
        that round's decision, as the step's first collective would: voted down, its state is not
        the committed one, and this hand-out does not count (the step is handed out again on the
        committed state, as a new one)."""
        if self.step_open and self.ballot.round is not None:
            try:
                self._settle()
            except self.fx.store_errors as e:  # the store moved: this round is nobody's now
                self.moves.relocate(e)
        retaking = self.step_open and (self.rejoin_why is not None or self.quorum is None)
        if retaking and not self.handed_before:
            self.yielded = self.step - 1
        return core.redo(self.handed_before, retaking)

    def set_phase(self, phase: str) -> None:
        self.phase = phase
        self.phase_since = self.fx.wall()

    # ------------------------------------------------------------ the loop
    def steps(self, total: int) -> Iterator[int]:
        """Yield the global step until `total` steps are committed (by any replica)."""
        self.total = total
        self.looping = True
        while True:
            self.start_round()
            if core.loop_ends(self.finished, self.step, total):
                try:
                    self._settle()
                    if self.rejoin_why is not None:  # it stepped past the end the others decided otherwise
                        continue
                    self._end_loop()
                    break
                except self.fx.store_errors as e:  # the store moved as the run ended: rejoin, and end there
                    self.moves.relocate(e)
                    continue
            yield self.step
        self._left_loop()

    def finish_loop(self) -> None:
        """ft.epochs() ran out: the end of the loop, as steps() ends at its total. A round of several
        steps the last quorum cut short is voted as it stands, the last step is saved when
        checkpoints are on, the decision is awaited, and the run is marked finished."""
        self.close_round()
        if (self.checkpoints is not None and self.step > 0 and self.quorum is not None and self.in_sync
                and self.replica_index == 0
                and core.save_is_due(self.step, self.step, self.checkpoints.settings.every)):
            self.save_due = True
        self.loop_ending = True
        while True:
            self.start_round()
            try:
                self._settle()
                if self.rejoin_why is not None:  # the script's loop is over: its quorums cannot be given again
                    self.restart(self.rejoin_why)
                self._end_loop()
                break
            except self.fx.store_errors as e:  # the store moved as the run ended: rejoin, and end there
                self.moves.relocate(e)
        self._left_loop()

    def _end_loop(self) -> None:
        if self.checkpoints is not None:
            self.checkpoints.wait()  # the last checkpoint is published before the script goes on
            self.stops.retry_final_save()
        if not self.finished:
            self.store.compare_set(keys.FINISHED, "", str(self.step))

    def set_looping(self, looping: bool) -> None:
        """ft.epochs() (ft/api/data.py) drives the loop itself: it says when it is inside one."""
        self.looping = looping

    def _left_loop(self) -> None:
        self.looping = False
        self.step_open = False
        self.set_phase("done")
        self.fx.note_step(self.step)

    def close_round(self) -> None:
        """Vote the steps this member took in the current round, as its last step would."""
        self._step_done()
        if self.taken and self.quorum is not None and self.voting.steps_first:
            self.ballot.submit(self.quorum.id, self.round, len(self.quorum.members), self.latest_seen,
                               self.node_size())
            self._end_round(True, self.core.handle(ClosedOk()))

    def start_round(self) -> None:
        """The top of a step: join, switch quorum, heal, checkpoint, as due. A step is then open
        until the vote. A member left out of sync (core.sits_out) votes the round down without the
        script and tries again at the next round's top."""
        self._step_done()
        while True:
            try:
                if self._start_round():  # the guard voted this round down at its top
                    continue
                if not self.finished and (self._peer_lost() or self._group_given_up()):
                    if self.rejoin_why is None:  # else the decision it read first: it rejoins at the top
                        self._sit_out()
                    continue
                if self.finished or not self.sits_out(self.in_sync, self.core.healing):
                    break
                self._sit_out()
            except self.fx.store_errors as e:  # the run's store went away: rejoin on the next one
                self.moves.relocate(e)
        self.step_open = True
        self.step_serial += 1
        self.handed_before = self.step <= self.yielded
        self.yielded = max(self.yielded, self.step)

    def _start_round(self) -> bool:
        """A round's top; True when the guard voted the round down here (start_round goes on to the next)."""
        self._settle(block=False)
        if self.finished:  # the others left the loop (core.Finish): no quorum is entered again, nobody heals it
            return False
        if self.taken and self.rejoin_why is None:  # inside a round of several steps (or sub-steps): nothing happens between them
            self.core.handle(Computing())
            self.set_phase("compute")
            return False
        q = self.quorum
        checking = q is not None and not q.stop and self.check_due(self.check_s, self.step, q.check_steps,
                                                                    bool(q.healers), self.round, self.group_round)
        if self.settles_first(self.ballot.round is not None, self.save_due or checking,
                              self.core.due_switch() is not None, self.step, self.total):
            self._settle()
        if self.rejoin_why is not None:
            self.rejoin()  # a fresh member: it joins below and heals from a peer
        if self.save_due:
            self.save_due = False
            self.set_phase("checkpoint")
            last = self.loop_ending or (self.total is not None and self.step >= self.total)
            self.checkpoints.save(self.state, self.step, "final" if last else "periodic")
        entering = self.core.handle(RoundTop())
        self.execute(entering)
        every = self.checkpoints.settings.every if self.checkpoints is not None else None
        q = self.quorum
        self.round_len = (core.round_length(q.round_steps, self.k, self.layout.round, self.step, self.total, every,
                                            q.check_steps) if q is not None else 1)
        # A top that entered a quorum checks at its own due top (its members differ from the old one's).
        if checking and not entering and not self.finished and self.quorum is q and self._check():
            return True
        self.core.handle(Computing())
        self.set_phase("compute")
        return False

    def _check(self) -> bool:
        """The guard, at a round's top where core.check_due says so: every member of this worker's
        group fingerprints its whole state and the fingerprints are compared (one small
        collective; a second names what differs when they do). What follows is the core's: on
        a disagreement every member votes the round down here, those that differ from the
        majority take its state again, and with no majority the run ends. True when the round
        was voted down. A member that cannot take part (no group, not in sync, a round already
        failed) drops its group, so its peers' check fails at once instead of waiting for it."""
        if self.pg is None or not self.in_sync or not self.round_ok or self.rejoin_why is not None:
            self.entry.drop_group()
            return False
        self.set_phase("check")
        t0 = self.fx.now()
        try:
            prints, differs = self.fx.compare_states(self.pg)
        except Exception as e:  # noqa: BLE001 - a peer left mid-check: the round fails, as any collective's
            self.fail_round(f"the guard's check failed: {str(e).strip()}")
            return False
        commands = self.core.handle(Compared(self.rank, prints, self.step, differs))
        self.fx.log_detail(f"rank {self.rank}: the guard compared {len(prints)} states at step {self.step} in "
                           f"{self.fx.now() - t0:.3f} s: " + ("the same" if not commands else
                                                             "; ".join(c.why for c in commands)))
        return self.execute(commands)

    # ------------------------------------------------------------ rounds
    def fail_round(self, why: str = "") -> None:
        """A collective of this round failed: the round will be voted down. A peer's loss is said
        in the log only; anything else in ftrun's words too."""
        if self.round_ok and why:
            first = why.splitlines()[0]
            if first != self.last_failure or self.core.failed_in_row % 100 == 0:
                self.fx.log_detail(f"rank {self.rank}: round {self.round}: {why.strip()}")
                if PEER_LOST.search(first):
                    self.fx.log_detail(f"rank {self.rank}: round {self.round} is voted down: a peer left "
                                       f"mid-collective")
                else:
                    self.fx.log(f"rank {self.rank}: round {self.round} failed: {_plain(first)} (the "
                                f"full text is in this rank's log)")
            self.last_failure = first
        # The round is lost: a peer blocked on this member (a ring all-reduce waits on its
        # neighbours only) fails now, not when this member votes after the script's code that
        # follows its backward, nor at the group's timeout.
        self.fx.hang_up(self.pg)
        self.core.handle(CollectiveFailed())

    def before_collective(self) -> None:
        """Called before the round's first collective: the previous round's decision must be in,
        so that no member sends a gradient over a group whose last round was voted down."""
        try:
            self._settle()
        except self.fx.store_errors as e:  # the store moved: this round sends nothing, the next one rejoins
            self.moves.relocate(e)
        if self.rejoin_why is not None:  # this member's state is not the committed one: it sends nothing
            self.core.handle(CollectiveFailed())

    def vote(self) -> bool:
        """This step's part of the round; True if this member steps (the caller steps at once).
        A member whose collectives all succeeded steps without waiting; after the round's last
        step its ok vote goes to the store from a thread and the decision is read during the next
        round. A member whose collective failed votes at once, saying how many of the round's
        steps it took; the round keeps the fewest any member took (keys.kept_key)."""
        if self.iteration.several:
            return self._vote_sub()
        if self.looping and not self.step_open and self.quorum is not None:
            # One step's top, two votes: a loop that steps its optimizer again after another
            # backward (a GAN's D then G), whose second step would send gradients no round expects.
            self.misused("opt.step() was called twice in one step of the loop (an optimizer stepped, then another "
                         "backward and a second step before the loop's next batch or step): with one ft.Optimizer a "
                         "step of ft.steps() / ft.DataLoader is one optimizer step of the whole model. For a loop "
                         "that steps its optimizers one after another between backward passes (a GAN's D then G), "
                         "give each its own: ft.Optimizer(opt_d), ft.Optimizer(opt_g) (in Lightning's manual "
                         "optimization: step each optimizer configure_optimizers returns once a batch)")
        self.step_open = False
        if self.rejoin_why is not None:  # it leaves this incarnation at the next round's top: no vote, no step
            return False
        if self.quorum is None:
            if not self.looping:
                self.misused("opt.step() was called outside an ftrun.ft loop, so no step could ever be committed "
                             "(every one would be discarded): drive the training loop with ft.epochs() or "
                             "ft.steps(), as in `for epoch in ft.epochs(n):` or `for step in ft.steps(total):`")
            return False  # the run's store moved during this round: nothing to vote on
        try:
            return self._vote()
        except self.fx.store_errors as e:  # the store moved: the round is nobody's now; rejoin next round
            self.moves.relocate(e)
            return False

    def _vote_sub(self) -> bool:
        """A sub-step (several ft.Optimizers: member/iteration.py): as vote(), but a member whose
        collectives went through only counts it (the round is voted at the top after its last
        loop step), one committed before this loop step was handed out again is skipped, and one
        after a sub-step whose round was voted down in this loop step is discarded without a vote."""
        self.step_open = False
        if self.iteration.next() != VOTE or self.rejoin_why is not None:
            return False
        if self.quorum is None:
            return False  # the run's store moved during this round: nothing to vote on
        try:
            return self._vote(sub_step=True)
        except self.fx.store_errors as e:  # the store moved: the round is nobody's now; rejoin next round
            self.moves.relocate(e)
            return False

    def _step_done(self) -> None:
        """Several ft.Optimizers: the script is back at the top. A loop step whose every sub-step
        was taken is counted now (the loaders move on, as one step is), and a round whose last loop
        step it was is voted; else the loop step is handed out again (member/iteration.py)."""
        it = self.iteration
        if not it.several:
            return
        if self.rejoin_why is not None:  # it takes the committed state again: the heal says where it is
            it.forget()
            self.layout.end()
            return
        complete = it.top()
        self.layout.end()
        if not complete or self.quorum is None:  # (a store moved mid-step left it incomplete: Iteration.store_moved)
            if it.done or self.core.round_ok is False:
                self.core.handle(core.StepAgain())
            return
        self.step += 1
        self.committed += 1
        self.fx.took_step(self.quorum.id, self.round, self.step)
        it.steps += 1
        if it.steps >= self.round_len:
            self.ballot.submit(self.quorum.id, self.round, len(self.quorum.members), self.latest_seen,
                               self.node_size())
            self._end_round(True, self.core.handle(ClosedOk()))

    def several_optimizers(self) -> None:
        """A second ft.Optimizer: from its first step on, the loop's steps are voted as sub-steps.
        Every replica runs the same script, so every member learns it before its loop begins."""
        if self.looping:
            self.misused("a second ftrun.ft.Optimizer was made inside the training loop: make every ft.Optimizer "
                         "before the loop (ft.steps(), ft.epochs()), as every replica must agree how a step is voted")
        if not self.voting.sub_steps:
            self.misused(f"several ftrun.ft.Optimizers (optimizers stepped one after another in a step) are not "
                         f"supported with --replica-size {self.k} yet: give every optimizer to one ft.Optimizer, or "
                         f"use --replica-size 1")
        self.iteration.several = True

    def _vote(self, sub_step: bool = False) -> bool:
        voted = self.layout.take(sub_step)
        if voted is False:  # agreed by all (it follows the same switch): nothing was sent, nothing is voted
            if sub_step:  # one loop step, one discarded round: its other sub-steps are discarded with it
                self.iteration.voted_down()
            self.core.handle(Skipped())
            self.set_phase("discard")
            return False
        if voted:  # a model whose backward did not average averages here
            self.layout.average(self.layout.averages, self.pg, self.fail_round)
            if sub_step:
                self.layout.sub_step_voted()
        self.set_phase("vote")
        if self.checkpoints is not None:
            self.checkpoints.staged()  # a save still copying the state: done before the optimizer steps
        unsettled = self.fx.collectives_unsettled() if self.pg is not None else None
        if unsettled:  # NCCL does not fail a collective whose peer died: it would wait forever
            self.fail_round(unsettled)
        injected = self.fx.injected_failure(self.rank, self.step, self.inc)
        if injected:
            self.fail_round(injected)
        self._settle()  # the previous round first: a member it contradicts restarts (or rejoins) here
        if self.rejoin_why is not None:
            return False
        ok = core.votes_ok(self.round_ok, self.in_sync, self.pg is not None)
        if sub_step:
            if ok:
                self.taken += 1
                self.iteration.took()
                self.fx.took_sub_step(self.quorum.id, self.round)
                self.set_phase("commit")
                return True
            self._cast(False)
            if self.rejoin_why is None:
                self.iteration.voted_down()
            return False
        if ok and self.voting.steps_first:
            self._took_step(self.round)
            if self.taken >= self.round_len:
                self.ballot.submit(self.quorum.id, self.round, len(self.quorum.members), self.latest_seen,
                                   self.node_size())
                self._end_round(True, self.core.handle(ClosedOk()))
            return True
        # A sharded replica waits for the decision even when its collectives went through: its
        # shards may disagree, and a replica holds the state only if every shard does.
        return self._cast(ok)

    def _peer_lost(self) -> bool:
        """A member of this quorum died and the keeper has published a quorum since (the watcher
        saw it): no round of this one can commit, so this one is voted down at its top, the
        decision before it read first, instead of the script computing a step whose first
        collective fails (the rest of a forward and backward; docs/benchmarks/heal.md). Whole
        replicas only (k == 1): a sharded replica's were not measured."""
        if self.rejoin_why is not None or self._member_gone() is None:
            return False
        self._settle()  # the round before first, as before any vote (it may say: take the state again)
        return True

    def _group_given_up(self) -> bool:
        """This top switched to a quorum whose group it gave up forming, since a newer quorum is
        out (a restarted replica was admitted before every survivor had entered the quorum without
        it): no round of it can commit, so it is voted down here, as in `_peer_lost`, instead of
        handing the script a step whose gradients go nowhere (a whole step per early restart).
        Whole replicas only, as `_peer_lost`."""
        q = self.quorum
        return (self.voting.gives_up_lost_rounds and q is not None and self.pg is None and not self.round_ok
                and self.latest_seen > q.id and self.rejoin_why is None)

    def abandoned(self) -> Optional[str]:
        """Asked inside the script's backward (ft/api/ddp.py): why this open step's round can no
        longer commit (a member of its quorum is gone and a newer quorum is out), or None. The
        backward then stops where it is instead of computing gradients nobody will apply: the
        survivors of a failure reach the next round, and a spare waiting to replace the lost
        replica, the rest of a backward sooner (docs/benchmarks/heal.md). One comparison
        while no newer quorum is out; then a store read every GONE_LOOK_S at most."""
        q = self.quorum
        if q is None or self.latest_seen <= q.id:  # the common case, at every gradient: two reads
            return None
        if not self.step_open or self.rejoin_why is not None:
            return None
        try:
            return self._member_gone()
        except self.fx.store_errors:  # the store is moving: the round's own collectives will tell
            return None

    def _member_gone(self) -> Optional[str]:
        """Why a member of this quorum is gone, once the watcher has seen a newer quorum; else None.
        A member found gone stays gone; one found there is looked at again after GONE_LOOK_S (the
        keeper publishes the quorum that drops a dead member before it marks the member dead)."""
        q = self.quorum
        if not self.voting.gives_up_lost_rounds or q is None or self.pg is None or self.latest_seen <= q.id:
            return None
        seen, now = (q.id, self.latest_seen), self.fx.now()
        last, at, why = self._gone
        if last != seen or (why is None and now - at >= GONE_LOOK_S):
            why = membership.gone(self.store, q, self.shard_ranks(q))
            self._gone = (seen, now, why)
        return why

    def _sit_out(self) -> None:
        """The round's top left this member out of sync (core.sits_out): it votes the round down at
        once, sending nothing (its group is dropped, so a peer's collective fails at once), and
        its next round's top switches again, healing. A layout round every member discards
        without a vote is discarded here too."""
        if self.layout.take() is False:
            self.core.handle(Skipped())
            self.set_phase("discard")
            return
        self.set_phase("vote")
        self._cast(False)

    def _cast(self, ok: bool) -> bool:
        """Vote on the round in this thread and take in its decision (a failed round, a member
        sitting it out, a sharded replica's round); True if the round committed."""
        if not ok and self.pg is not None:
            self.entry.drop_group()
        t0 = self.fx.now()
        e, rnd = self.quorum, self.round
        commit, target, _, kept = self.cast_vote(self.store, e.id, rnd, len(e.members), ok, self.latest_seen,
                                                 self.node, self.node_size(), self.taken)
        self._slow(t0, f"the decision of round {rnd}")
        commands = self.core.handle(Voted(ok, self.taken, commit, target, kept))
        self._end_round(commit, commands, rnd)
        if any(isinstance(c, TakeStep) for c in commands):  # a sharded replica's one-step round, taken
            self.fx.decided(e.id, rnd, True)
        if not commit and ok:
            self.entry.drop_group()
        return commit

    def _slow(self, t0: float, what: str) -> None:
        took = self.fx.now() - t0
        if took > SLOW_S:
            self.fx.log_detail(f"rank {self.rank}: waited {took:.1f} s for {what}")

    def _took_step(self, rnd: int) -> None:
        """This member steps on round `rnd` (its collectives of this step went through): counted at once."""
        self.step += 1
        self.taken += 1
        self.committed += 1
        self.fx.took_step(self.quorum.id, rnd, self.step)
        self.set_phase("commit")

    def _end_round(self, commit: bool, commands: List[Command], rnd: int = -1) -> None:
        """Carry out the end of round `rnd` the core decided, with this member's own bookkeeping:
        the round's own commands (a step taken, a restart or rejoin) before it, and what follows
        the round (a wait, a look for the run's end, the end) after it, which reads the step."""
        after = (Backoff, ReadFinished, Finish)
        self.execute([c for c in commands if not isinstance(c, after)], rnd)
        self.taken = 0
        self.iteration.steps = 0
        if commit:
            self.last_failure = None
            # The same on every worker of a replica (all of them stepped).
            self.save_due = (self.checkpoints is not None
                             and core.save_is_due(self.step, self.total, self.checkpoints.settings.every)
                             and self.replica_index == 0)
        else:
            self.discarded += 1
            self.fx.note_step(self.step)
        self.execute([c for c in commands if isinstance(c, after)])
        self.set_phase("commit" if commit else "discard")

    def execute(self, commands: List[Command], rnd: int = -1) -> bool:
        """Carry out the core's commands, in their order: the one place a command is interpreted
        (entry, heal, the checks and the vote report events and hand over what the core answered).
        `rnd`: the round a TakeStep steps on. True if one was SitOut. The two questions
        (AskEntryRound, MoveState) are answered by the part that asked, with its next event."""
        sat = False
        for c in commands:
            if isinstance(c, Join):
                self.entry.join()
            elif isinstance(c, Switch):
                self.entry.switch(c.quorum, joining=c.joining)
            elif isinstance(c, TakeStep):
                self._took_step(rnd)
            elif isinstance(c, Restart):
                self.restart(c.why, c.charged, c.clean)
            elif isinstance(c, Rejoin):
                self._rejoin_due(c.why)
            elif isinstance(c, SitOut):
                self._sit_out()
                sat = True
            elif isinstance(c, EndRun):
                self.fx.exit(exits.EXIT_CANNOT_GO_ON, f"rank {self.rank}: {c.why}")
            elif isinstance(c, Backoff):
                self.fx.sleep(c.seconds)
            elif isinstance(c, ReadFinished):
                self.execute(self.core.handle(FinishedRead(self.finished_step(self.store))))
            elif isinstance(c, Finish):
                self.step = c.step
                if c.alone:
                    self.stops.finish_without_peers()
            elif not isinstance(c, (AskEntryRound, MoveState)):
                raise TypeError(f"no way to carry out {c!r}")
        return sat

    def _settle(self, block: bool = True) -> None:
        """Take in the decision of the round this member voted ok on and stepped past."""
        ballot = self.ballot
        if ballot.round is None or not (block or ballot.ready()):
            return
        quorum_id, rnd = ballot.round
        waiting = not ballot.ready()
        back = self.phase
        if waiting:
            self.waiting_round = rnd
            self.set_phase("vote")
        t0 = self.fx.now()
        try:
            commit, target, _, _ = ballot.result()
        except self.fx.store_errors:
            self.unsettled = True  # stepped past a round whose decision never came (the store moved)
            raise
        finally:
            if waiting:
                self.waiting_round = None
                self.set_phase(back)
        self._slow(t0, f"the decision of round {rnd}")
        self.fx.decided(quorum_id, rnd, commit)
        self.execute(self.core.handle(Decided(rnd, commit, target)))

    def _rejoin_due(self, why: str) -> None:
        """Its state is not the committed one from now on; it rejoins at the next round's top."""
        self.rejoin_why = why
        self.heals.taint()

    def misused(self, why: str) -> None:
        """The script uses ftrun.ft in a way that can never train: one line, the run stops."""
        self.fx.exit(exits.EXIT_CANNOT_GO_ON, f"rank {self.rank}: {why}")

    def restart(self, why: str, charged: bool = False, clean: bool = False) -> None:
        """This member's state is not the committed one and no peer can take it back: exit, so
        that ftrun restarts the replica and it heals like any newcomer (core.Restart). Unless
        `charged`, the supervisor is told the decision came from the others, and charges no
        restart for it."""
        if not charged:
            self.fx.restart(f"rank {self.rank}: {why}; restarting to take the committed state from a peer", why)
        else:
            then = "restarts it clean" if clean else "restarts and heals it"
            self.fx.restart(f"rank {self.rank}: {why}; exiting so that ftrun {then}")

    # ------------------------------------------------------------ quorums
    # ------------------------------------------------------------ a new incarnation, in place
    def rejoin(self) -> None:
        """The peers decided a round this member stepped past otherwise (core.Rejoin): it leaves
        its quorum as this incarnation and joins as the next, as a restarted process would: the
        supervisor books the change (keys.EVENTS, "rejoin"), and the keeper makes the new one a
        healer; the heal puts the committed state into this process's own objects. Called at a
        round's top, with no vote in flight."""
        why, self.rejoin_why = self.rejoin_why, None
        if self.store_gen:  # a moved store's keeper is another node's ftrun, which cannot book it
            self.restart(why)
        old, new = self.inc, self.inc + 1  # the incarnation a restart would have been given
        self.entry.drop_group()
        try:
            self.store.queue_push(keys.EVENTS, f"{self.rank} {old} rejoin {new}")
        except Exception:  # noqa: BLE001 - the store is gone or moving: the process restarts, as it did before
            self.restart(why)
        self.inc = new
        self.fx.incarnation(new)
        self.core = self.core_class(can_rejoin=True, round=self.round, suspects=self.core.suspects)
        self._forget_round()
        self.heals.rejoined()
        self._index_of, self._node_count = (-1, 0), (-1, 0)
        self.fx.log(f"rank {self.rank}: {why}; taking the committed state from a peer in place (incarnation {new})")

    def _forget_round(self, keep_iteration: bool = False) -> None:
        self.layout.forget()
        if not keep_iteration:
            self.iteration.forget()
        self.waiting_round = None
        self.save_due = False
        self.taken = 0

    # ------------------------------------------------------------ what the components report
    def took_state(self, snapshot: Snapshot) -> None:
        """A heal put a peer's state into this member's objects (member/heal.py)."""
        rnd, self.step, self.yielded, self.iteration.done = snapshot
        self.core.handle(core.Received(rnd))
        self.fx.note_step(self.step)

    def resumed_at(self, step: int) -> None:
        """The source of a fresh quorum resumed a checkpoint of `step` (member/heal.py)."""
        self.step = step
        self.yielded = max(self.yielded, step - 1)
        self.fx.note_step(step)

    def moved_store(self, gen: int, store: Any, latest: int) -> None:
        """The run's store moved (member/moves.py): connected to the next one (`store`), this member
        rejoins there holding its state, and says whether its last round's decision left it
        (the keeper heals from a decided state first: core.survivors_source)."""
        decided = self.ballot.round is None and not self.taken and not self.unsettled
        self.unsettled = False
        seen = self.watch.latest  # the newest quorum of the lost store it saw: the new one counts above it
        self.store = store
        self.ballot = self._new_ballot()
        self.watch.seen(latest)
        self.store_gen = gen  # the quorum watcher reconnects on this
        self.core.handle(core.StoreLost())
        sub_steps = self.iteration.held()
        self.iteration.store_moved()  # not forgotten: its state holds those sub-steps
        self._forget_round(keep_iteration=True)
        self.heals.store_moved()
        self.store.set(keys.survivor_key(self.rank), SurvivorReport(
            inc=self.inc, step=self.step, in_sync=self.in_sync and not self.heals.tainted, decided=decided,
            latest=seen, sub_steps=sub_steps).encode())
