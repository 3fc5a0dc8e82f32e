"""The quorum keeper of --ft: the supervisor decides who takes part, and speaks for the dead.

On several machines the keeper of the node hosting the store (the leader,
node 0 until the store moves) keeps the quorum of every global rank; the
other nodes' keepers only report their replicas' births and deaths to it
through a store queue, and read the quorums it publishes. After the store
moved, a new keeper starts on it: the replicas rejoin saying which step they
hold, and the first quorum heals them all from the one with the newest whole
step.

Members are workers (global ranks). With --replica-size K a replica is the
K workers of ranks jK .. jK+K-1: it is admitted only once all K have asked to
join with the same incarnation, it leaves as a whole when any of them dies
(the supervisor kills the others), and it heals as a whole (all K ranks are
healers, or none).

It publishes a quorum (wire.Quorum: members, and which of them must heal)
whenever membership changes: when every first replica has asked to join, when a
restarted replica asks to join, and when a member dies. For a member that
died it abstains in the rounds its peers may be waiting on, so those rounds
close on the survivors' own votes; a round its vote closes, it decides. On
several nodes that vote goes through the member's node's store (relayed per
node, ftrun.supervisor.relay) while the node answers. It deletes the keys of
finished rounds and old quorums, so the store does not grow with the run.

This module is the shell: it reads the store into a snapshot, asks the keeper core
(ftrun.supervisor.ft.keeper: pure functions returning a decision and its reason) and writes what
was decided; it decides nothing itself. Its components own their state: ReplicaReports (the
replicas' reports, quorum_status) and VoteCaster (the votes as cast, quorum_votes).
Must never import torch (it talks to the store through RunStore), and never touch processes.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Set, Tuple

from ftrun import keys, pacing, votes
from ftrun.keys import EVENTS
from ftrun.supervisor.ft.keeper import core, dead
from ftrun.supervisor.ft.keeper import spares as spare_rules
from ftrun.supervisor.ft.keeper.core import FRESH_START, KeeperDecision, KeeperSnapshot, Pace
from ftrun.supervisor.ft.keeper.dead import KeeperRules
from ftrun.supervisor.ft.quorum_status import ReplicaReports
from ftrun.supervisor.ft.quorum_votes import VoteCaster
from ftrun.supervisor.relay import Routes
from ftrun.wire import MemberReport, Quorum


@dataclass(frozen=True)
class KeeperSettings:
    """What the keeper takes from the environment, read once (the simulator passes its own)."""

    round_steps: int = pacing.ROUND_STEPS
    round_steps_chosen: bool = False  # the user set the round length: it is kept, not paced
    note: Optional[str] = None  # a line saying why the environment's value was not taken
    check_s: float = pacing.CHECK_S  # seconds between the guard's checks (0: off)
    check_steps: Optional[int] = None  # steps between them, if the user chose (FTRUN_FT_CHECK_STEPS)

    @staticmethod
    def from_env(env: Mapping[str, str]) -> "KeeperSettings":
        steps, why = pacing.round_steps_from_env(env)
        # Bad values are refused before the run starts (checks.py).
        check_s, _ = pacing.check_s_from_env(env)
        check_steps, _ = pacing.check_steps_from_env(env)
        return KeeperSettings(steps, why is None and pacing.ROUND_STEPS_ENV in env, why, check_s, check_steps)


class QuorumKeeper:
    """Quorums: who takes part, who heals, from which round; the events that change them."""

    rules = KeeperRules()  # the core's rules (a historic bug's subclass, ftrun/sim/bugs.py, puts in its own)

    def __init__(self, store, ranks: List[int], local_ranks: Optional[List[int]] = None, leader: bool = True,
                 replica_size: int = 1, routes: Optional[Routes] = None, settings: Optional[KeeperSettings] = None,
                 clock: Callable[[], float] = time.time, fresh_start: str = FRESH_START, spares: int = 0) -> None:
        # Time comes in: poll(now) is given it, and the events between polls (a death) read `clock`,
        # the same clock the supervisor passes to poll (the simulator passes its virtual one).
        self.clock = clock
        self.store = store  # RunStore; its .store is the TCPStore once ready
        # Several nodes: the nodes whose members vote through their node's store (ftrun.supervisor.relay).
        self.routes = routes
        self.k = replica_size
        self.ranks = sorted(ranks)              # every replica of the run (all nodes)
        self.local = set(local_ranks if local_ranks is not None else ranks)
        self.leader = leader
        self.quorum_id = 0
        self.members: Dict[int, int] = {}
        self.rejoined: List[Tuple[int, int]] = []  # (rank, incarnation) booked in place, for the supervisor
        self.healed: Set[Tuple[int, int]] = set()
        self.pending: Dict[int, int] = {}
        self.spares = spares  # --spares: replicas held back while the others train (keeper/spares.py)
        self.held: Dict[int, int] = {}  # the spares' ranks -> incarnations, as the last poll admitted them
        self.alive: Dict[int, Optional[int]] = {r: 0 for r in ranks}
        self.reports = ReplicaReports()
        self.votes = VoteCaster(store, self.rules)
        self.pending_since: Optional[float] = None  # the first join of the quorum being formed
        self.ready, self.history = False, []
        settings = settings if settings is not None else KeeperSettings.from_env(os.environ)
        self.round_steps = settings.round_steps
        if settings.note:
            self.history.append(settings.note)
        # A round length the user chose is kept; the default follows the run's pace (Pace).
        self.round_steps_chosen = settings.round_steps_chosen
        self.check_s, self.check_steps = settings.check_s, settings.check_steps
        self.pace = Pace()
        self._dead_pending: List[Tuple[int, int]] = []
        # Members that died while listed in a quorum, and the rounds voted for them, per quorum,
        # for as long as some live replica may still be in a quorum that lists them.
        self.dead: Dict[Tuple[int, int], Dict[int, Set[int]]] = {}
        self.starts: Dict[int, int] = {}  # quorum -> its start round (-1: its members continue)
        self.voting_since: Dict[int, Tuple[Tuple[object, object], float]] = {}
        self.unstuck: Set[Tuple[int, int, int, int]] = set()
        self._collected_at, self._collected_when = -2, float("-inf")
        self.quorums: Dict[int, Set[Tuple[int, int]]] = {}
        # Per quorum, the rounds below this one had their keys collected: nobody waits on them, and
        # a vote there would start a fresh counter and write a second decision of a decided round.
        self.collected_below: Dict[int, int] = {}
        self.finished_members: Set[Tuple[int, int]] = set()  # incarnations that left the loop (exit 0)
        # Since when the others have been waiting for each replica, continuously.
        self.waited_since: Dict[int, float] = {}
        # Started on a store that moved (ftrun.supervisor.nodes.failover): its first quorum takes the
        # state from the replica that says it holds the newest whole step (core.survivors_source).
        self.moved = False
        # On a moved store, the ranks the first quorum waits for: the last quorum's members. A
        # newcomer still starting joins the quorum after (the others need not wait for its import).
        self.awaited: Optional[Set[int]] = None
        # What a fresh quorum after the first means for the run (said once, in its history line).
        self.fresh_start = fresh_start
        self.fresh_quorums: Set[int] = set()  # quorums after the first that no holder of the trained state was in
        # A stop signal with --checkpoint-dir (stop()): every quorum from then on is a stop quorum.
        self.stopping = False
        self.writer = -1  # the newest stop quorum's writer replica (-1: none)
        self.quorum_steps, self.repace_after = self.round_steps, float("-inf")  # the newest quorum's (core.repace_due)
        self.quorum_paced = True  # its rounds were sized at a known pace (core.repace_due)

    @property
    def info(self) -> Dict[int, MemberReport]:
        return self.reports.info

    @property
    def info_seen(self) -> Dict[int, float]:
        return self.reports.seen

    def _snapshot(self, top: int = -1, **read) -> KeeperSnapshot:
        """What the core decides from: the keeper's books as they are, and what was just `read`."""
        return KeeperSnapshot.of(
            k=self.k, ranks=self.ranks, local=self.local, quorum_id=self.quorum_id, top=top, members=self.members,
            pending=self.pending, pending_since=self.pending_since, alive=self.alive, healed=self.healed,
            info=self.reports.info, info_seen=self.reports.seen, quorums=self.quorums, starts=self.starts,
            collected_below=self.collected_below, finished=self.finished_members, awaited=self.awaited,
            stopping=self.stopping, writer=self.writer, moved=self.moved, fresh_start=self.fresh_start,
            round_steps=self.round_steps, round_steps_chosen=self.round_steps_chosen, step_s=self.pace.step_s(),
            quorum_steps=self.quorum_steps, quorum_paced=self.quorum_paced, repace_after=self.repace_after,
            spares=self.spares, held=self.held, check_s=self.check_s, check_steps=self.check_steps, **read)

    def store_moved(self, old: "QuorumKeeper", alive: Mapping[int, Optional[int]]) -> None:
        """This keeper starts on the store the run moved to (ftrun.supervisor.nodes.failover) after `old`'s
        was lost: its quorums count on above every quorum a replica may have seen, the first one
        waits for `old`'s members and heals from the newest holder (core.survivors_source), and the
        replicas' last words stand until they speak again. `alive`: this node's ranks' incarnations."""
        self.fresh_start = old.fresh_start
        self.quorum_id = old.quorum_id + 1
        self.reports.info.update(old.info)
        self.moved = True
        self.awaited = set(old.members) or None
        self.alive.update(alive)

    # ------------------------------------------------------------ store
    @property
    def _s(self):
        return self.store.store

    def on_store_ready(self) -> None:
        s = self._s
        if not self.leader:
            self.ready = True
            for r in self.local:
                inc = self.alive.get(r)
                if inc is not None:
                    self._report(r, inc, "spawn")
            for r, k in self._dead_pending:
                self._report(r, k, "died")
            self._dead_pending.clear()
            return
        s.compare_set(keys.TOP, "", "-1")
        for r in self.ranks:
            s.compare_set(keys.join_key(r), "", "-1")
            s.compare_set(keys.healed_key(r), "", "-1")
            s.compare_set(keys.entered_key(r), "", "-1")
            if self.routes is None or self.routes.node_of(r) is None:
                s.compare_set(keys.info_key(r), "", "{}")
            if r in self.local:
                inc = self.alive.get(r)
                s.set(keys.inc_key(r), "dead" if inc is None else str(inc))
            else:
                s.compare_set(keys.inc_key(r), "", "0")
        for k in self.routes.nodes if self.routes is not None else []:
            s.compare_set(keys.node_info_key(k), "", "{}")
        # Last: followers read every rank's keys once LATEST exists. Above 0 on a store that
        # moved (ftrun.supervisor.nodes.failover): quorums go on counting from the lost store's.
        s.compare_set(keys.LATEST, "", str(self.quorum_id))
        self.ready = True
        for r, k in self._dead_pending:
            self.on_exit(r, k)
        self._dead_pending.clear()

    def add_ranks(self, ranks: List[int], relay: Optional[Tuple[int, str]] = None) -> None:
        """A node joined the running run (elastic c10d): its replicas become ranks of the quorum,
        voting and reporting through its store when it has one (`relay`: its node and store's
        host:port). The leader creates their keys first: every poll reads them all at once."""
        new = [r for r in ranks if r not in self.ranks]
        if relay is not None:
            if self.routes is None:
                self.routes = Routes({})
            self.routes.add(relay[0], relay[1], new)
        if self.leader and self.ready:
            s = self._s
            for r in new:
                s.compare_set(keys.join_key(r), "", "-1")
                s.compare_set(keys.healed_key(r), "", "-1")
                s.compare_set(keys.entered_key(r), "", "-1")
                if relay is None:
                    s.compare_set(keys.info_key(r), "", "{}")
                s.compare_set(keys.inc_key(r), "", "0")
            if relay is not None:
                s.compare_set(keys.node_info_key(relay[0]), "", "{}")
        for r in new:
            self.alive.setdefault(r, 0)
        self.ranks = sorted(self.ranks + new)

    # ------------------------------------------------------------ events from the supervisor
    def _report(self, rank: int, inc: int, what: str) -> None:
        """A follower node tells the leader about its replica. Node 0 may be gone (the nodes'
        watch reports that, and the agent stops): the word is then lost, not raised."""
        try:
            if what == "spawn":
                self._s.set(keys.inc_key(rank), str(inc))
            self._s.queue_push(EVENTS, f"{rank} {inc} {what}")
        except Exception as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
            self.history.append(f"could not tell node 0 that rank {rank} {what if what != 'spawn' else 'started'} "
                                f"({first})")

    def on_spawn(self, rank: int, inc: int) -> None:
        self.alive[rank] = inc
        if self.ready:
            if self.leader:
                self._s.set(keys.inc_key(rank), str(inc))
            else:
                self._report(rank, inc, "spawn")

    def on_exit(self, rank: int, inc: int, finished: bool = False) -> None:
        """A replica incarnation died (or finished): take it out (core.exit_plan) and vote for it
        where it can't."""
        if self.alive.get(rank) == inc:
            self.alive[rank] = None
        if not self.ready:
            if not finished:
                self._dead_pending.append((rank, inc))
            return
        if not self.leader and rank in self.local:
            self._report(rank, inc, "finished" if finished else "died")
            return
        plan = core.exit_plan(self._snapshot(), rank, inc, finished)
        for m in plan.unpend:
            self.pending.pop(m, None)
            self.held.pop(m, None)
        for m, k in plan.promote.items():  # a spare takes the place of the replica that died
            self.held.pop(m, None)
            self.pending[m] = k
        if plan.finished:
            del self.members[rank]
            self.finished_members.add((rank, inc))
            if plan.publish is not None:
                self._publish(plan.publish)
            return
        if plan.leaving:
            for m in plan.leaving:
                del self.members[m]
            if plan.publish is not None:
                self._publish(plan.publish)
            s = self._snapshot(self._top())
            now = self.clock()
            for m, k in plan.leaving.items():
                if m != rank:
                    self._s.set(keys.inc_key(m), "dead")  # peers forming a group with it give up now
                self._fill_votes(s, m, k, now)
        if self.alive.get(rank) is None:
            self._s.set(keys.inc_key(rank), "dead")

    def on_node_lost(self, node: int, ranks: List[int]) -> None:
        """Node `node` is lost (the supervisor's node watch said so), its store and its workers
        `ranks` with it. Its members are voted for in the run's store from now on, and so again
        are the rounds this keeper had voted in through that store (dead.dead_on_node)."""
        if self.routes is not None:
            self.routes.lose(node)
            for member in dead.dead_on_node(self.dead, self.routes.node_of, node):
                self.dead[member].clear()
        for rank in ranks:
            inc = self.alive.get(rank)
            if inc is not None:
                self.on_exit(rank, inc)

    def _rejoin(self, rank: int, inc: int, nxt: int) -> None:
        """Incarnation `inc` of `rank` became `nxt` in place (worker/ft/member/driver.py MemberDriver.rejoin): what a
        restart shows, without a new process (core.rejoin_applies)."""
        if not core.rejoin_applies(self._snapshot(), rank, inc):
            return
        self.on_exit(rank, inc)
        self.on_spawn(rank, nxt)
        self.rejoined.append((rank, nxt))

    def take_rejoined(self) -> List[Tuple[int, int]]:
        """The (rank, incarnation) pairs booked in place since the last call, for the supervisor's
        worker records (their processes live on as the next incarnation)."""
        taken, self.rejoined = self.rejoined, []
        return taken

    def take_history(self) -> List[str]:
        """The run's history lines (quorums published, votes cast for the dead) since the last call,
        oldest first, for the console."""
        taken, self.history = self.history, []
        return taken

    def _top(self) -> int:
        return int(self._s.get(keys.TOP))

    # ------------------------------------------------------------ polling
    def _drain_events(self) -> None:
        s = self._s
        for _ in range(s.queue_len(EVENTS)):
            rank, inc, what, *nxt = s.queue_pop(EVENTS, False).decode().split()
            rank, inc = int(rank), int(inc)
            if what == "rejoin":
                self._rejoin(rank, inc, int(nxt[0]))
            elif what == "spawn":
                self.alive[rank] = inc
                s.set(keys.inc_key(rank), str(inc))  # after any "died" of the previous incarnation
            else:
                self.on_exit(rank, inc, finished=what == "finished")

    def _follow(self) -> None:
        """A follower reads what the leader decided, for status and hang detection."""
        s = self._s
        latest = int(s.get(keys.LATEST)) if s.check([keys.LATEST]) else 0
        # On a moved store LATEST first names no quorum (the new leader's count starts above every
        # quorum seen, and this keeper's may be below it): a blocking read of it would stop this
        # node's supervision until the leader's first quorum.
        if latest != self.quorum_id and latest > 0 and (not self.moved or s.check([keys.quorum_key(latest)])):
            quorum = Quorum.from_json(s.get(keys.quorum_key(latest)))
            self.quorum_id = latest
            self.members = dict(quorum.members)
        healed, infos = self.reports.read(s, [keys.healed_key(r) for r in self.ranks], self.ranks, self.routes)
        now = self.clock()
        self._absorb(healed, infos, now)
        self.held = spare_rules.followed(self._snapshot())  # the leader's spares, for this node's status and goodput
        self._track_waits(self._snapshot(), now)

    def _absorb(self, healed: List[bytes], infos: List[object], now: float) -> None:
        """Take in the replicas' healed incarnations and status reports (as ReplicaReports.read gives them)."""
        for r, h in zip(self.ranks, healed):
            if int(h) >= 0:
                self.healed.add((r, int(h)))
        self.reports.absorb(self.ranks, infos, now)
        self.history += self.reports.take_refusals()  # a member of another ftrun: said once, on the console

    def _track_waits(self, s: KeeperSnapshot, now: float) -> None:
        self.waited_since = core.waits(s, self.waited_since, now)

    def poll(self, now: float) -> None:
        if not self.ready:
            return
        if not self.leader:
            if self._s.check([keys.LATEST]):
                self._follow()
            return
        self._drain_events()
        top = self._top()
        s = self._snapshot(top)  # the books' mappings are the keeper's own: what is absorbed below shows
        if self.dead:
            self._refill(s, now)
        self._collect(s, now)
        n = len(self.ranks)
        vals, infos = self.reports.read(self._s, [keys.join_key(r) for r in self.ranks]
                                        + [keys.healed_key(r) for r in self.ranks], self.ranks, self.routes)
        self._absorb(vals[n:], infos, now)
        if self.pace.due(now):  # global_step reads every report: not at every tick
            self.pace.note(now, core.global_step(s))
            s = self._snapshot(top)  # the pace it says
        self._track_waits(s, now)
        self._unstick(s, now)
        admission = core.admit(s, {r: int(j) for r, j in zip(self.ranks, vals[:n])}, now)
        if admission.pending or self.pending:
            self.pending = dict(admission.pending)
        if admission.held or self.held:
            self.held = dict(admission.held)
        self.pending_since = admission.pending_since
        if admission.repace_after is not None:
            self.repace_after = admission.repace_after
        if admission.publish is not None:
            self._publish(admission.publish, quiet=admission.quiet)
        if self.stopping:
            why = core.stop_writer_left(s)
            if why is not None:
                self._publish(why)

    def stop(self) -> Optional[int]:
        """A stop signal: publish a stop quorum (wire.Quorum.stop), at whose switch every member
        stops and the writer replica saves the step it holds. The writer (a replica holding the
        trained state, on this node where one is) or None: no quorum yet, or nobody holds it."""
        if not self.leader or not self.ready or self.quorum_id == 0 or not self.members:
            return None
        self.stopping = True
        decision = self._publish("a stop signal: the last committed step is saved, then every worker stops")
        return decision.quorum.writer if decision.quorum.writer >= 0 else None

    def _publish(self, why: str, quiet: bool = False) -> KeeperDecision:
        """Read what the next quorum depends on, have the core decide it (core.next_quorum), write it."""
        s = self._s
        # Members that have entered a quorum switch by their votes; the others are still joining.
        entered = dict(zip(self.members, map(int, s.multi_get([keys.entered_key(r) for r in self.members]))))
        ranks = list(self.members) + ([] if self.stopping else [r for r in self.pending if r not in self.members])
        # Who holds the committed state now, not as of the last poll.
        healed = dict(zip(ranks, map(int, s.multi_get([keys.healed_key(r) for r in ranks]))))
        survivors = {}
        if self.moved and not self.stopping:  # what each rejoined replica says it holds (until one holds it here)
            for r in ranks:
                if s.check([keys.survivor_key(r)]):
                    survivors[r] = s.get(keys.survivor_key(r))
        top = -1 if core.continues(self.members, entered) else self._top()  # the start round needs it
        decision = core.next_quorum(self._snapshot(top, entered=entered, survivors=survivors), why, healed, quiet)
        for r in decision.forget:
            s.delete_key(keys.survivor_key(r))
        quorum = decision.quorum
        self.healed |= decision.healed
        if not quorum.stop:
            self.pending, self.pending_since, self.moved = {}, None, decision.moving
            self.quorum_steps, self.quorum_paced = quorum.round_steps, decision.paced
        else:
            self.writer = quorum.writer
        self.members = dict(quorum.members)
        self.quorum_id = quorum.id
        if decision.fresh:
            self.fresh_quorums.add(quorum.id)
        self.quorums[quorum.id] = set(quorum.members)
        self.starts[quorum.id] = quorum.start_round
        s.set(keys.quorum_key(quorum.id), quorum.to_json())
        s.set(keys.LATEST, str(quorum.id))
        if decision.stop_word is not None:  # never over a word a writer gave before it went
            s.compare_set(keys.STOP_SAVE, "", json.dumps(decision.stop_word))
        if decision.history is not None:
            self.history.append(decision.history)
        return decision

    # ------------------------------------------------------------ votes for the dead, collection
    def _fill_votes(self, s: KeeperSnapshot, rank: int, inc: int, now: float) -> None:
        """Cast the votes due for dead member (rank, inc) (dead.dead_votes), then decide the rounds
        they completed whose closer died."""
        filled = self.dead.setdefault((rank, inc), {})
        for due in dead.dead_votes(self.rules, s, (rank, inc)):
            done = filled.setdefault(due.quorum, set())
            for rnd in due.rounds:
                if rnd not in done and self.votes.cast(s, due.quorum, rnd, due.vote, rank, self.routes):
                    done.add(rnd)
            for rnd in due.rounds:
                if rnd in done:
                    line = self.votes.close_orphaned_node(s, rank, due.quorum, rnd, now, self.routes)
                    if line is not None:
                        self.history.append(line)
                    self.votes.close_orphaned(s, due.quorum, rnd)

    def _refill(self, s: KeeperSnapshot, now: float) -> None:
        """Keep voting for dead members some live replica may still wait for (dead.forget_dead)."""
        gone, kept = dead.forget_dead(s, list(self.dead))
        for member in gone:
            del self.dead[member]
        for member in kept:
            self._fill_votes(s, member[0], member[1], now)

    def _unstick(self, s: KeeperSnapshot, now: float) -> None:
        """Vote fail in the place of members that will never vote where others wait (dead.unstick)."""
        self.voting_since, due = dead.unstick(self.rules, s, self.voting_since, self.unstuck, now)
        for vote in due:
            if not self.votes.cast(s, vote.quorum, vote.rnd, votes.FAIL_VOTE, vote.rank, self.routes):
                continue  # its node's store did not answer: again at the next poll
            self.unstuck.add((vote.rank, vote.inc, vote.quorum, vote.rnd))
            self.history.append(vote.reason)

    def _collect(self, s: KeeperSnapshot, now: float) -> None:
        """Delete the keys the core says nobody reads again (dead.collect)."""
        if not dead.collect_due(s.top, now, self._collected_at, self._collected_when):
            return
        self._collected_at, self._collected_when = s.top, now
        self.votes.forget_below(dead.node_votes_kept_from(s.top))
        collection = dead.collect(self.rules, s, self._s.list_keys())
        self.collected_below.update(collection.collected_below)
        for key in collection.delete:
            self._s.delete_key(key)

    # ------------------------------------------------------------ status
    def replica_fields(self, rank: int) -> dict:
        return core.replica_status(self._snapshot(), rank)

    def in_quorum(self, rank: int) -> bool:
        return core.in_quorum(self._snapshot(), rank)

    def run_fields(self) -> dict:
        return core.run_status(self._snapshot())

    def waited_for_s(self, rank: int) -> float:
        """How long the others have been waiting for this replica without a break (0: they are not)."""
        since = self.waited_since.get(rank)
        return self.clock() - since if since is not None else 0.0

    def global_step(self) -> int:
        return core.global_step(self._snapshot())
