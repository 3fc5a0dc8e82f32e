"""A member's rounds (mixed into manager.Manager): failing a round, voting (ok votes off the
training thread, failed ones at once), taking a step, ending a round, and reading the decision a
round later. Must never raise a collective failure into the user's loop, and never import the
supervisor.
"""

from __future__ import annotations

import time
from typing import Callable, List, Optional

import torch.distributed as dist

from ftrun import protocol as keys
from ftrun.worker.ft import membership, vote
from ftrun.worker.ft.group import settle
from ftrun.worker.ft.member.core import (Backoff, ClosedOk, CollectiveFailed, Command, Decided, Finish, FinishedRead,
                                         ReadFinished, Rejoin, Restart, Skipped, TakeStep, Voted)
from ftrun.worker.ft.member_io import PEER_LOST, SLOW_S, _log, _log_detail, _plain, leave, restart_replica


class Rounds:
    """Votes and decisions of rounds; the state is Manager's."""

    def fail_round(self, why: str = "") -> None:
        """A collective of this round failed: the round will be voted down. A peer's loss is an
        expected event (the supervisor says which replica died): it is said in the log only;
        anything else is said in ftrun's words too. The full text always goes to the log."""
        if self.round_ok and why:
            first = why.splitlines()[0]
            if first != self._last_failure or self.failed_in_row % 100 == 0:
                _log_detail(f"rank {self.rank}: round {self.round}: {why.strip()}")
                if PEER_LOST.search(first):
                    _log_detail(f"rank {self.rank}: round {self.round} is voted down: a peer left mid-collective")
                else:
                    _log(f"rank {self.rank}: round {self.round} failed: {_plain(first)} (the full text is in this "
                         f"rank's log)")
            self._last_failure = first
        self.core.handle(CollectiveFailed())

    def before_collective(self) -> None:
        """Called before the round's first collective: the previous round's decision must be in
        (it arrived during this round's forward pass, as a rule), so that no member sends a
        gradient over a group whose last round was voted down."""
        try:
            self._settle()
        except (dist.DistError, vote.StoreLost) as e:  # the store moved: this round sends nothing, the next one rejoins
            self._relocate(e)
        if self._rejoin_why is not None:  # this member's state is not the committed one: it sends nothing
            self.core.handle(CollectiveFailed())

    def vote(self) -> bool:
        """This step's part of the round; True if this member steps (the caller steps at once).

        A round is several steps (Epoch.round_steps) and one vote. A member whose collectives
        all succeeded steps without waiting; after the round's last step its ok vote goes to
        the store from a thread and the decision is read during the next round (`_settle`). A
        member whose collective failed votes at once, saying how many of the round's steps it
        took; the round keeps the fewest any member took (protocol.kept_key). An
        all-reduce that completed for one member had every member's part, so as a rule it
        completed for all and the decision is commit; where a member's action and the decision
        disagree (a rare mixed outcome as a peer dies mid-collective), that member heals from a
        peer again: in place, as its next incarnation, at the next round's top (`_rejoin`), or by
        a restart where it cannot. A member whose round failed votes and waits, as before.
        """
        self.step_open = False
        if self._rejoin_why is not None:  # it leaves this incarnation at the next round's top: no vote, no step
            return False
        if self.epoch is None:
            if not self.looping:
                self._misused("opt.step() was called outside an ftrun.ft loop, so no step could ever be committed "
                              "(every one would be discarded): drive the training loop with ft.epochs() or "
                              "ft.steps(), as in `for epoch in ft.epochs(n):` or `for step in ft.steps(total):`")
            return False  # the run's store moved during this round: nothing to vote on
        try:
            return self._vote()
        except (dist.DistError, vote.StoreLost) as e:  # the store moved: the round is nobody's now; rejoin next round
            self._relocate(e)
            return False

    def _vote(self) -> bool:
        if self.layout_round:
            self.layout_round = False
            if not self.layout_averaging():
                # Agreed by all (it follows the same switch): nothing was sent, nothing is voted.
                self.core.handle(Skipped())
                self._set_phase("discard")
                return False
            # As a rule each model's average ran as its backward returned (ft/ddp.py), so the
            # script read averaged gradients; one whose backward did not reduce averages here.
            self.layout_average(self.layout_averages)
        self._set_phase("vote")
        if self.checkpoints is not None:
            self.checkpoints.staged()  # a save still copying the state: done before the optimizer steps
        if self.pg is not None and not settle(self._settle_s):
            # NCCL does not fail a collective whose peer died: it would wait forever.
            self.fail_round(f"the round's collectives did not finish within {self._settle_s:g} s")
        if self._inject_fail == (self.rank, self.step) and self.inc == 0:
            self._inject_fail = None
            self.fail_round("a failure injected by FTRUN_FT_INJECT_FAIL")
        self._settle()  # the previous round first: a member it contradicts restarts (or rejoins) here
        if self._rejoin_why is not None:
            return False
        ok = self.round_ok and self.in_sync and self.pg is not None
        if ok and self.k == 1:
            self._took_step()
            if self.taken >= self.round_len:
                self._ballot.submit(self.epoch.id, self.round, len(self.epoch.members), self.latest_seen,
                                    self._node_size())
                self._end_round(True, self.core.handle(ClosedOk()))
            return True
        # A sharded replica (--replica-size > 1) waits for the decision even when its collectives
        # went through: its shards may disagree (one shard group's collective completed, its
        # mate's failed), and a replica holds the state only if every shard does. Had its ok
        # shards stepped, a failed round would restart the whole replica, and when it is the
        # last one, nobody would hold the trained state any more.
        if not ok and self.pg is not None:
            self._drop_group()
        t0 = time.monotonic()
        commit, target, _, kept = vote.cast(self.store, self.epoch.id, self.round, len(self.epoch.members), ok,
                                            self.latest_seen, self.node, self._node_size(), self.taken)
        if time.monotonic() - t0 > SLOW_S:
            _log_detail(f"rank {self.rank}: waited {time.monotonic() - t0:.1f} s for the decision of round {self.round}")
        self._end_round(commit, self.core.handle(Voted(ok, self.taken, commit, target, kept)))
        if not commit and ok:
            self._drop_group()
        return commit

    def layout_can_average(self) -> bool:
        """Whether every wrapped model's gradients can be averaged in a layout round."""
        return bool(self.layout_averages) and None not in self.layout_averages

    def layout_averaging(self) -> bool:
        """Whether this layout round is voted on (else it is discarded by all, with no vote)."""
        return self.layout_can_average() and not self.layout_discard

    def layout_average(self, averages: List[Optional[Callable[[], None]]]) -> None:
        """Run the layout round's averages (each once a round: a model's runs as its backward
        returns); a failed one votes the round down. Without a group nothing is sent: this
        member votes the round down anyway."""
        if self.pg is None:
            return
        try:
            for average in averages:
                average()
        except Exception as e:  # the group broke: this round is voted down
            self.fail_round(str(e))

    def _node_size(self) -> int:
        """How many of the epoch's members vote through this member's node (0: no node)."""
        if self.node is None:
            return 0
        if self._node_count[0] != self.epoch.id:
            self._node_count = (self.epoch.id, self.node.size(self.epoch.members))
        return self._node_count[1]

    def _took_step(self) -> None:
        """This member steps (its collectives of this step went through): counted at once."""
        self.step += 1
        self.taken += 1
        self.committed += 1
        for fn in self.step_listeners:
            fn()
        if self._progress is not None:
            self._progress.note_step(self.step)
        self._set_phase("commit")

    def _end_round(self, commit: bool, commands: List[Command]) -> None:
        """Carry out the end of a round the core decided (member_core.py), with this worker's
        own bookkeeping: steps, counters, a checkpoint due, the progress report."""
        for c in commands:
            if isinstance(c, Restart):
                self._restart(c.why)
            elif isinstance(c, Rejoin):
                self._rejoin_due(c.why)
            elif isinstance(c, TakeStep):
                self._took_step()
        self.taken = 0
        if commit:
            self._last_failure = None
            # The same on every worker of a replica (all of them stepped).
            self._save_due = (self.checkpoints is not None and self.checkpoints.due(self.step, self.total)
                              and self.replica_index == 0)
        else:
            self.discarded += 1
            if self._progress is not None:
                self._progress.note_step(self.step)
        self._carry_out(commands)
        self._set_phase("commit" if commit else "discard")

    def _carry_out(self, commands: List[Command]) -> None:
        """The core's commands after a round's end or a join: wait, look for the run's end, finish."""
        for c in commands:
            if isinstance(c, Backoff):
                time.sleep(c.seconds)
            elif isinstance(c, ReadFinished):
                self._carry_out(self.core.handle(FinishedRead(membership.finished_step(self.store))))
            elif isinstance(c, Finish):
                self.step = c.step
                if c.alone:
                    self._finish_without_peers()

    def _settle(self, block: bool = True) -> None:
        """Take in the decision of the round this member voted ok on and stepped past (the core
        decides what it means: member_core.Decided)."""
        ballot = self._ballot
        if ballot.round is None or not (block or ballot.ready()):
            return
        epoch_id, rnd = ballot.round
        waiting = not ballot.ready()
        if waiting:
            back = self.phase
            self._waiting_round = rnd
            self._set_phase("vote")
        t0 = time.monotonic()
        try:
            commit, target, _, _ = ballot.result()
        finally:
            if waiting:
                self._waiting_round = None
                self._set_phase(back)
        if time.monotonic() - t0 > SLOW_S:
            _log_detail(f"rank {self.rank}: waited {time.monotonic() - t0:.1f} s for the decision of round {rnd}")
        for c in self.core.handle(Decided(rnd, commit, target)):
            if isinstance(c, Restart):
                self._restart(c.why)
            elif isinstance(c, Rejoin):
                self._rejoin_due(c.why)

    def _rejoin_due(self, why: str) -> None:
        """Its state is not the committed one from now on (a store move meanwhile must not take it for
        a holder of the newest step); it rejoins at the next round's top (StoreMoves._rejoin)."""
        self._rejoin_why = why
        self._tainted = True

    def _misused(self, why: str) -> None:
        """The script uses ftrun.ft in a way that can never train: say so in one line and stop the
        run (every replica would do the same; a restart cannot change it)."""
        leave(keys.EXIT_CANNOT_GO_ON, f"rank {self.rank}: {why}")

    def _restart(self, why: str) -> None:
        """This member's state is not the committed one and no peer can take it back: exit, so
        that ftrun restarts the replica and it heals from a peer like any newcomer. The round's
        decision came from the others: the supervisor is told, so that it names the failure
        that caused it and charges no restart budget for it."""
        restart_replica(f"rank {self.rank}: {why}; restarting to take the committed state from a peer", why)
