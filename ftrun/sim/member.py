"""One simulated worker of a replica (--replica-size K: K workers, one per shard) running the member's side of --ft: the
product's own decisions (ft/member/core.py: this class is its second driver, beside the
worker's manager), the real store protocol of ft/membership.py (join, entry round, who is gone,
transfer waits) and ft/vote.py (cast, with ok votes off the training thread as the manager's
Ballot does), in the order ft/manager.py calls them. The model is a digest of the rounds it
stepped on, the collectives and transfers are the world's simulated groups. Threads: the
training loop, the epoch watcher, the status reporter and the ballot, all of one simulated
process. Must never be imported by the product.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, List, Optional, Tuple

from ftrun import protocol as keys
from ftrun.protocol import Epoch
from ftrun.sim.sched import SimKilled
from ftrun.worker.ft import membership, vote
from ftrun.worker.ft.member.core import (AskEntryRound, Backoff, ClosedOk, CollectiveFailed, Command, Computing,
                                         Decided, Entered, Entering, Finish, FinishedRead, InSync, Join, Joined,
                                         MemberCore, ReadFinished, Rejoin, Restart, RoundTop, TakeStep, Voted,
                                         core_field, rejoins_in_place, transfer_ends)

if TYPE_CHECKING:
    from ftrun.sim.world import World

POLL_S = 0.02  # the member's store polls (the product's 5 ms, coarser: fewer simulated turns)
REPORT_S = 0.25  # protocol.HEARTBEAT_S: the status report the keeper reads
VOTE_TIMEOUT_S = 600.0  # FTRUN_FT_VOTE_TIMEOUT's default: the member's store client timeout


class Exited(BaseException):
    """The member exits (os._exit in the product): restart (75) or finished (0)."""

    def __init__(self, code: int, why: str) -> None:
        super().__init__(why)
        self.code, self.why = code, why


class Ballot:
    """The manager's vote.Ballot: one ok vote at a time, cast by a thread of the same process."""

    def __init__(self, m: "SimMember") -> None:
        self.m = m
        self.job: Optional[Tuple[int, int, int, int]] = None
        self.round: Optional[Tuple[int, int]] = None
        self.result_: Optional[object] = None
        self.done = False
        self.after: Tuple[int, int, str] = (0, 0, "")  # (step, digest) of the member after stepping this round
        m.w.sched.spawn(self._run, "ballot", m.proc)

    def submit(self, epoch: int, rnd: int, size: int, latest: int, after: Tuple[int, int, str]) -> None:
        assert self.round is None, "a vote is already in flight"
        self.round, self.after, self.done, self.result_ = (epoch, rnd), after, False, None
        self.job = (epoch, rnd, size, latest)

    def ready(self) -> bool:
        return self.round is not None and self.done

    def result(self) -> vote.Decision:
        sched = self.m.w.sched
        sched.wait_for(lambda: self.done, None)
        res, self.round, self.done, self.result_ = self.result_, None, False, None
        if isinstance(res, BaseException):
            raise res
        return res  # type: ignore[return-value]

    def _run(self) -> None:
        sched = self.m.w.sched
        store = self.m.w.store.client(VOTE_TIMEOUT_S)
        node = self.m.node_client()  # the ballot's own connection to its node's store, as the product's
        while True:
            sched.wait_for(lambda: self.job is not None, None)
            (epoch, rnd, size, latest), self.job = self.job, None
            try:
                self.result_ = vote.cast(store, epoch, rnd, size, True, latest, node, self.m.node_size())
            except Exception as e:  # handed to the training thread
                self.result_ = e
            self.done = True


class SimMember:
    epoch = core_field("epoch")
    round = core_field("round")
    group_round = core_field("group_round")
    in_sync = core_field("in_sync")
    finished = core_field("finished")

    def __init__(self, world: "World", rank: int, inc: int) -> None:
        self.w, self.rank, self.inc = world, rank, inc
        self.proc = f"r{rank}.{inc}"
        self.store = world.store.client(VOTE_TIMEOUT_S)
        self.node = self.node_client()  # on a node other than node 0: votes and reports go through its store
        self.k = world.k
        self.core = MemberCore(can_rejoin=rejoins_in_place(self.k, world.nodes))
        self.rejoin_why: Optional[str] = None
        self.shard = rank % self.k
        self.shard_id = self.shard if self.k > 1 else None  # names its groups and heal keys, as the product's
        self.step = 0
        self.digest = "0"
        self.lineage = 0  # the fresh epoch this state descends from (a run with nobody holding its state starts again)
        self.stepped: List[Tuple[int, int]] = []  # rounds stepped on since the last settle
        self.tainted = False
        self.latest_seen = 0
        self.group = None
        self.phase = "init"
        self.waiting_round: Optional[int] = None
        self.heal_written: Optional[str] = None
        self.ballot: Optional[Ballot] = None
        self.watching = False

    # ------------------------------------------------------------ plumbing
    def sleep(self, s: float) -> None:
        self.w.sched.sleep(s)

    def exit(self, code: int, why: str) -> None:
        raise Exited(code, why)

    def node_client(self) -> Optional[vote.Node]:
        """A connection to this worker's node's store (vote.Node), or None on node 0."""
        n = self.w.node_of(self.rank)
        if n == 0:
            return None
        return vote.Node(n, n * self.w.per_node, self.w.per_node, self.w.node_store[n].client(VOTE_TIMEOUT_S))

    def node_size(self) -> int:
        """How many of the epoch's members vote through this worker's node (0: none)."""
        return self.node.size(self.epoch.members) if self.node is not None and self.epoch is not None else 0

    def info(self) -> dict:
        return {"inc": self.inc, "epoch": self.epoch.id if self.epoch else None,
                "round": self.waiting_round if self.waiting_round is not None else self.round,
                "phase": self.phase, "step": self.step}

    # ------------------------------------------------------------ threads
    def main(self) -> None:
        try:
            self.ballot = Ballot(self)
            self.w.sched.spawn(self._report, "report", self.proc)
            self._loop()
            self.w.on_member_exit(self, 0, "finished")
        except Exited as e:
            self.w.on_member_exit(self, e.code, e.why)
        except SimKilled:
            raise
        self.w.sched.kill(self.proc)  # its other threads end with the process
        raise SimKilled()

    def _report(self) -> None:
        beat = 0
        store = self.w.store.client(VOTE_TIMEOUT_S) if self.node is None else self.node_client().store
        while True:
            beat += 1
            try:
                store.set(keys.info_key(self.rank), json.dumps({**self.info(), "beat": beat}))
            except Exception:  # noqa: BLE001 - the store is down: go on beating
                pass
            self.sleep(REPORT_S)

    def _watch(self) -> None:
        store = self.w.store.client(86400.0)
        nxt = self.latest_seen + 1
        while True:
            try:
                store.get(keys.epoch_key(nxt))
            except Exception:  # noqa: BLE001 - a timeout: wait again
                continue
            self.latest_seen = max(self.latest_seen, nxt)
            nxt += 1

    # ------------------------------------------------------------ the loop (ft.steps)
    def _loop(self) -> None:
        total = self.w.total
        while True:
            self.start_round()
            if self.finished or self.step >= total:
                self.settle()
                if self.rejoin_why is not None:
                    continue
                self.store.compare_set(keys.FINISHED, "", str(self.step))
                break
            self.sleep(self.w.step_s * (0.5 + self.w.sched.rng.random()))  # the forward and backward passes
            self.settle()  # before_collective
            if self.rejoin_why is not None:  # its state is not the committed one: it sends nothing
                self.fail_round("rejoins at the next round's top")
            else:
                self.w.check_state(self)
            if self.group is not None and self.rejoin_why is None:
                err = self.w.groups.allreduce(self, self.group)
                if err:
                    self.fail_round(err)
            self.vote()
        self.phase = "done"

    def start_round(self) -> None:
        self.settle(block=False)
        if self.ballot.round is not None and (self.core.due_switch() is not None or self.step >= self.w.total):
            self.settle()
        if self.rejoin_why is not None:
            self.rejoin()
        for c in self.core.handle(RoundTop()):
            if isinstance(c, Join):
                self.join()
            else:
                self.switch(c.epoch)
        self.core.handle(Computing())
        self.phase = "compute"

    def vote(self) -> None:
        self.phase = "vote"
        if self.rejoin_why is None:
            self.settle()
        if self.rejoin_why is not None:  # it leaves this incarnation at the next round's top: no vote
            return
        ok = self.core.round_ok and self.in_sync and self.group is not None
        e = self.epoch
        if ok and self.k == 1:
            self.take_step(self.round)
            self.ballot.submit(e.id, self.round, len(e.members), self.latest_seen,
                               (self.lineage, self.step, self.digest))
            self.end_round(True, self.core.handle(ClosedOk()))
            return
        # A sharded replica waits for the decision even when its collectives went through: its
        # shards step only on a commit (ft/rounds.py).
        if not ok and self.group is not None:
            self.drop_group()
        rnd = self.round
        commit, target, _, kept = vote.cast(self.store, e.id, rnd, len(e.members), ok, self.latest_seen, self.node,
                                            self.node_size())
        commands = self.core.handle(Voted(ok, 0, commit, target, kept))
        self.carry_out([c for c in commands if isinstance(c, Restart)])
        if any(isinstance(c, TakeStep) for c in commands):
            self.take_step(rnd)
            self.stepped.remove((e.id, rnd))
            self.w.note_commit(self, e.id, rnd, (self.lineage, self.step, self.digest))
        self.end_round(commit, commands)
        if not commit and ok:
            self.drop_group()

    def take_step(self, rnd: int) -> None:
        e = self.epoch
        self.digest = hashlib.blake2b(f"{self.digest}/{e.id}/{rnd}".encode(), digest_size=6).hexdigest()
        self.step += 1
        self.stepped.append((e.id, rnd))

    def end_round(self, commit: bool, commands: List[Command]) -> None:
        self.carry_out(commands)
        self.phase = "commit" if commit else "discard"

    def carry_out(self, commands: List[Command]) -> None:
        for c in commands:
            if isinstance(c, Restart):
                self.exit(keys.EXIT_REPLICA_RESTART, c.why)
            elif isinstance(c, Rejoin):
                self.rejoin_why = c.why
            elif isinstance(c, Backoff):
                self.sleep(c.seconds)
            elif isinstance(c, ReadFinished):
                self.carry_out(self.core.handle(FinishedRead(self.w.bugs.finished_step(self.store))))
            elif isinstance(c, Finish):
                self.step = c.step
                if c.alone:
                    self.exit(keys.EXIT_OK, "the run finished while this replica was not in sync")

    def settle(self, block: bool = True) -> None:
        b = self.ballot
        if b.round is None or not (block or b.ready()):
            return
        epoch_id, rnd = b.round
        after = b.after
        waiting = not b.ready()
        back = self.phase
        if waiting:
            self.waiting_round, self.phase = rnd, "vote"
        try:
            commit, target, _, _ = b.result()
        finally:
            if waiting:
                self.waiting_round, self.phase = None, back
        self.carry_out(self.core.handle(Decided(rnd, commit, target)))
        if not commit:  # voted down after it stepped: it rejoins (Rejoin) at the next round's top
            return
        self.w.note_commit(self, epoch_id, rnd, after)
        self.stepped = [s for s in self.stepped if s != (epoch_id, rnd)]

    def fail_round(self, why: str = "") -> None:
        self.core.handle(CollectiveFailed())

    def drop_group(self) -> None:
        old, self.group = self.group, None
        self.w.groups.leave(self, old)

    # ------------------------------------------------------------ membership
    def rejoin(self) -> None:
        """The manager's _rejoin (ft/relocation.py): this incarnation leaves, the next one joins
        and heals, in the same simulated process."""
        why, self.rejoin_why = self.rejoin_why, None
        old, new = self.inc, self.inc + 1
        self.drop_group()
        self.store.queue_push(keys.EVENTS, f"{self.rank} {old} rejoin {new}")
        self.w.log.append(f"{self.w.sched.now:.3f}s rank {self.rank}.{old} rejoins as {new}: {why} (step {self.step})")
        self.inc = new
        self.core = MemberCore(can_rejoin=True, round=self.round)
        self.waiting_round = None
        self.tainted = True  # until it heals: never the source of a fresh quorum (ft/relocation.py)
        self.heal_written = None

    def join(self) -> None:
        self.phase = "join"
        entry = self.w.bugs.wait_to_enter(self.store, (self.rank, self.inc), self.sleep, POLL_S)
        if entry.finished is None:
            self.latest_seen = entry.latest
            if not self.watching:
                self.watching = True
                self.w.sched.spawn(self._watch, "epochs", self.proc)
        for c in self.core.handle(Joined(entry.epoch, entry.round, entry.finished)):
            if isinstance(c, Finish):
                self.carry_out([c])
                return
            self.switch(c.epoch, joining=True)
        self.store.set(keys.entered_key(self.rank), str(self.inc))

    def switch(self, epoch_id: int, joining: bool = False) -> None:
        epoch = membership.read_epoch(self.store, epoch_id)
        commands = self.core.handle(Entering(epoch, (self.rank, self.inc), joining))
        self.carry_out([c for c in commands if isinstance(c, Restart)])
        asked = any(isinstance(c, AskEntryRound) for c in commands)
        self.core.handle(Entered(epoch, self.w.bugs.entry_round(self.store, epoch, self.round) if asked else self.round))
        self.phase = "group"
        self.drop_group()
        gone = membership.gone(self.store, epoch, epoch.ranks)
        if gone:
            self.fail_round(gone)
            if epoch.healers or epoch.fresh:
                self.heal(epoch)
            return
        mine = [r for r in epoch.ranks if r % self.k == self.shard]  # worker `shard` of every replica
        self.group = self.w.groups.form(self, keys.pg_prefix(epoch.id, self.group_round, self.shard_id), mine,
                                        lambda: self.why_give_up(epoch, mine))
        if self.group is None:
            self.fail_round(f"could not form the group of quorum {epoch.id}")
        if epoch.healers or epoch.fresh:
            self.heal(epoch)

    def why_give_up(self, epoch: Epoch, ranks: List[int]) -> Optional[str]:
        if self.latest_seen > epoch.id:
            return f"quorum {self.latest_seen} is out"
        return membership.gone(self.store, epoch, ranks)

    # ------------------------------------------------------------ healing
    def heal(self, epoch: Epoch) -> None:
        ends = transfer_ends(epoch, self.rank, self.k)
        source = ends[0]
        done_key = keys.heal_key(epoch.id, self.group_round, self.shard_id)
        if self.rank not in ends:
            self.phase = "heal-wait"
            membership.await_transfer(self.store, epoch, ends, done_key, self.sleep, POLL_S)
            return
        sending = self.rank == source
        if membership.gone(self.store, epoch, ends):
            self.fail_round("an end is gone")
            if sending:
                self.set_heal_done(done_key, "fail")
            return
        refused = self.w.bugs.source_refuses(sending, self.tainted, epoch.fresh, self.in_sync, self.k)
        if refused is not None:
            self.carry_out([refused])
        if sending and not epoch.fresh and not self.in_sync:
            self.w.violation(f"rank {self.rank} sends its state in quorum {epoch.id} while not in sync")
        self.phase = "send" if sending else "heal"
        payload = self.w.groups.transfer(self, keys.pg_prefix(epoch.id, self.group_round, self.shard_id) + "heal/", ends,
                                         sending, lambda: self.why_give_up(epoch, ends))
        if payload is None:
            self.fail_round("the transfer failed")
            if sending:
                self.set_heal_done(done_key, "fail")
            return
        if sending:
            if epoch.fresh:
                self.lineage = epoch.id
            self.set_heal_done(done_key, "ok")
            if not self.in_sync:
                self.core.handle(InSync())
                self.store.set(keys.healed_key(self.rank), str(self.inc))
            return
        self.round, self.step, self.digest, self.lineage = payload
        self.stepped = []
        self.tainted = False
        self.core.handle(InSync())
        self.store.set(keys.healed_key(self.rank), str(self.inc))

    def capture(self) -> Tuple[int, int, str, int]:
        return self.round, self.step, self.digest, epoch_lineage(self)

    def set_heal_done(self, key: str, what: str) -> None:
        if self.heal_written:
            try:
                self.store.delete_key(self.heal_written)
            except Exception:  # noqa: BLE001
                pass
        self.store.set(key, what)
        self.heal_written = key


def epoch_lineage(m: SimMember) -> int:
    """The lineage a transfer hands on: a fresh epoch's source starts a new one."""
    return m.epoch.id if m.epoch is not None and m.epoch.fresh else m.lineage
