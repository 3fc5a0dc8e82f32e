"""One simulated run of --ft: the real keeper (ftrun.supervisor.ft.quorum.QuorumKeeper) polled by a
simulated supervisor that sees deaths and restarts replicas, simulated worker processes running
the product's member driver (sim/worker.py),
simulated process groups (a collective succeeds only if every member of the group reaches it
and none has died or left it), a schedule of faults, and the protocol's invariants, checked
after every scheduled turn. `run(schedule)` returns the first violation, or None.
On several nodes every node but node 0 has its own store, through which its workers vote and
report, kept by the real node relay (ftrun.supervisor.relay.NodeRelay) and a follower keeper
that tells node 0's leader of its workers' starts and deaths; a lost node's workers die with
it and its store is gone, and node 0 declares it lost NODE_LOST_S later, as its node watch does.
On three nodes or more the node hosting the run's store may be lost (host-lost): the others agree
on the next host (the lowest node left, whose standby store, its node store, becomes the run's),
and each surviving node's ftrun starts the product's keeper there after its old one
(QuorumKeeper.store_moved), says where the store went in its own store (keys.RUN_STORE) and tells
its relay; its workers follow through the product's member/moves.py.
Must never be imported by the product.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Set, Tuple

from ftrun import protocol as keys
from ftrun.protocol import Quorum
from ftrun.sim.checkpoint import Marker
from ftrun.sim.worker import SimWorker
from ftrun.sim.sched import Deadlock, Sched
from ftrun.sim.store import SimStore
from ftrun.supervisor.policy.failure_policy import ReplicaFailed, RestartVerdict
from ftrun.supervisor.ft.quorum import KeeperSettings, QuorumKeeper
from ftrun.supervisor.nodes import failover
from ftrun.supervisor.relay import NODE_OP_TIMEOUT_S, NodeRelay, Routes

STEP_S = 0.05  # a training step's compute, on average (virtual)
TICK_S = 0.05  # the supervisor's loop under --ft (supervisor/loop/run.py)
FORM_TIMEOUT_S = 10.0  # FTRUN_FT_TIMEOUT's default: a group formation, a collective's settle
PROGRESS_BOUND_S = 60.0  # after the last fault ends, the run finishes within this (virtual) time:
# six group formations' timeouts, more than any schedule of the product's own code has needed
TURNS_BOUND = 400_000  # a livelock that keeps time from moving is a violation too
EVAL_EVERY = 2  # the simulated script evaluates (a side effect gated on ft.redo()) every this many steps
KEYS_PER_RANK = 40  # the store holds at most this many keys per rank, plus KEYS_BASE (rounds in flight)
KEYS_BASE = 100
STOP_BOUND_S = 30.0  # after a stop quorum, its members stop (and its writer says how its save went) within this
NODE_LOST_S = 3.0  # node 0 declares a node lost this long after its beats stop (supervisor/nodes/node_watch.py)
# After the store's host is lost, the others notice (their node watch), agree on the next host
# (supervisor/nodes/failover.py: at once once every candidate chose it) and start their keepers on it
# this long after, give or take MOVE_SPREAD_S between the nodes.
MOVE_S = (0.3, 1.5)
MOVE_SPREAD_S = 0.2
UNLIMITED = 10 ** 9  # a schedule with no restart budget of its own (--max-restarts not given)


@dataclass(frozen=True)
class Fault:
    """One fault of a schedule, at virtual time `at`: kill (a replica's current incarnation),
    kill-call (killed at its `x`-th store call from then on, before the call takes effect),
    pause (SIGSTOP for `dur`), pause-call (SIGSTOP for `dur` at the rank's `x`-th store call from
    then on, whichever incarnation makes it: a restarted replica stopped mid-join), slow (its turns `x` times slower for `dur`), late (its first
    start delayed by `dur`), heal-kill (killed as soon as it next sends or receives state),
    store-down (every store call waits `dur`), store-slow (latency `x` for `dur`), node-lost (node
    `rank` and every worker on it are gone for good, its store with them), host-lost (the node
    hosting the run's store is lost so, and the run's store moves to the lowest node left), kill-all
    (every worker at once: nobody holds the trained state, and the next quorum's source resumes the
    newest checkpoint)."""

    at: float
    kind: str
    rank: int = -1
    dur: float = 0.0
    x: float = 0.0

    def __str__(self) -> str:
        who = f" rank {self.rank}" if self.rank >= 0 else ""
        extra = (f" {self.dur:.2f}s" if self.dur else "") + (f" x{self.x:g}" if self.x else "")
        return f"{self.at:.3f}s {self.kind}{who}{extra}"


@dataclass
class Schedule:
    seed: int
    replicas: int
    total: int
    faults: List[Fault] = field(default_factory=list)
    k: int = 1  # workers per replica (--replica-size): ranks are replicas * k, a fault's rank is a worker
    nodes: int = 1  # machines: each runs replicas / nodes replicas (whole), in rank order
    round_steps: int = 1  # steps a round takes (the keeper's pinned round length: one vote per round)
    max_restarts: int = UNLIMITED  # ftrun's --max-restarts: each replica's restart budget
    min_replicas: int = 1  # ftrun's --min-replicas: past its budget a replica is dropped while this many live
    joiners: int = 0  # replicas of a node that joins the running run (elastic): ranks after the others'
    join_at: float = 0.0  # when node 0 admits them (QuorumKeeper.add_ranks), and they start
    stop_at: float = -1.0  # a stop signal (SIGTERM with --checkpoint-dir) reaches ftrun then: a stop quorum
    checkpoint_every: int = 0  # --checkpoint-dir with --checkpoint-every N: the writer saves every N steps
    spares: int = 0  # --spares N: the keeper holds N replicas back as hot spares (keeper/spares.py)
    # The guard (FTRUN_FT_CHECK_STEPS N): members compare their states every N steps and after every
    # heal; 0: off (the schedules before it replay as they did).
    check_every: int = 0
    # Optimizers stepped one after another in each step (several ft.Optimizers, a GAN's D then G):
    # each step of the loop is this many sub-steps, each with its own collective and vote; 0: one.
    sub_steps: int = 0

    def keeper_settings(self) -> KeeperSettings:
        return KeeperSettings(self.round_steps, True, None, keys.CHECK_S if self.check_every else 0.0,
                              self.check_every or None)


class Group:
    def __init__(self, key: str, ranks: List[int]) -> None:
        self.key, self.ranks = key, list(ranks)
        self.procs: Dict[int, str] = {}
        self.left: Set[int] = set()
        self.seq: Dict[int, int] = {}
        self.ops: Dict[int, Set[int]] = {}
        self.payload: Optional[tuple] = None  # what a heal sends: (snapshot, digest, lineage, side effects run)
        self.waiters: list = []  # threads parked in one of its collectives
        self.kinds: Dict[int, Tuple[str, int]] = {}  # collective index -> (what it is, the first rank in it)
        self.prints: Dict[int, Dict[int, int]] = {}  # a check's collective index -> each rank's digest


class Groups:
    """Process groups: formed once every rank arrives; a collective completes once every rank
    reaches it, and fails at once when a rank of the group died or left it (a reset connection)."""

    def __init__(self, world: "World") -> None:
        self.w = world
        self.groups: Dict[str, Group] = {}

    def _broken(self, g: Group) -> bool:
        if g.left:
            return True
        alive = self.w.sched.alive
        for p in g.procs.values():
            if not alive(p):
                return True
        return False

    def form(self, m: SimWorker, key: str, ranks: List[int], why: Callable[[], Optional[str]]) -> Optional[Group]:
        g = self.groups.setdefault(key, Group(key, ranks))
        g.procs[m.rank] = m.proc
        g.left.discard(m.rank)
        m.store.set(f"{key}{m.rank}", m.proc)  # the formation's own store traffic
        deadline = self.w.sched.now + FORM_TIMEOUT_S
        while True:
            if len(g.procs) == len(g.ranks) and not self._broken(g):
                return g
            if why() or self.w.sched.now >= deadline:
                self.leave(m, g)
                return None
            m.sleep(0.05)

    def leave(self, m: SimWorker, g: Optional[Group]) -> None:
        if g is not None:
            g.left.add(m.rank)
            self._wake(g)

    def _wake(self, g: Group) -> None:
        """Something changed for the group's collective: its waiters look again."""
        waiters, g.waiters = g.waiters, []
        for t in waiters:
            self.w.sched.wake(t)

    def died(self) -> None:
        """A process died: every collective waiting on it fails now (a reset connection)."""
        for g in self.groups.values():
            if g.waiters:
                self._wake(g)

    def allreduce(self, m: SimWorker, g: Group, what: str = "step") -> Optional[str]:
        """One collective of `what` (a step's gradients, a heal, the guard's check): members that
        reach the same collective with different ones would mix them (torch would, silently)."""
        i = g.seq.get(m.rank, 0)
        g.seq[m.rank] = i + 1
        first = g.kinds.setdefault(i, (what, m.rank))
        if first[0] != what:
            self.w.violation(f"rank {m.rank}'s collective {i} on {g.key} is a {what} where rank {first[1]}'s is a "
                             f"{first[0]}")
        arrived = g.ops.setdefault(i, set())
        arrived.add(m.rank)
        whole = len(g.ranks)
        sched = self.w.sched
        if len(arrived) == whole:
            self._wake(g)
            sched.block()  # still a yield point
            return None
        deadline = sched.now + FORM_TIMEOUT_S
        me = sched.current
        while len(arrived) < whole and not self._broken(g) and sched.now < deadline:
            g.waiters.append(me)
            try:
                sched.park(deadline)
            finally:
                if me in g.waiters:
                    g.waiters.remove(me)
        if len(arrived) == whole:
            return None
        return "a peer left mid-collective" if self._broken(g) else "the collective timed out"


class Violation(Exception):
    pass


class World:
    def __init__(self, sched: Sched, schedule: Schedule, bugs) -> None:
        self.sched = sched
        self.sch = schedule
        self.bugs = bugs
        self.total = schedule.total
        self.step_s = STEP_S
        self.store = SimStore(sched)
        self.groups = Groups(self)
        self.k = schedule.k
        self.ranks = list(range((schedule.replicas + schedule.joiners) * self.k))
        first = self.ranks[:schedule.replicas * self.k]  # the run's ranks at its start
        self.joining = self.ranks[len(first):]  # a late node's: node 0 admits them at join_at
        self.members: Dict[int, SimWorker] = {}
        self.inc: Dict[int, int] = {r: -1 for r in self.ranks}
        self.done: Set[int] = set()
        self.gone: Set[int] = set()  # ranks of lost nodes: never back
        self.nodes = schedule.nodes
        self.per_node = len(self.ranks) // self.nodes
        self.node_store: Dict[int, SimStore] = {n: SimStore(sched) for n in range(1, self.nodes)}
        self.lost_at: Dict[int, float] = {}  # node -> when it was lost
        self.events: List[Tuple[float, str, int, int]] = []  # (when, what, rank, inc) for the supervisor
        self.heal_kill: Dict[int, bool] = {}
        self.call_kill: Dict[str, int] = {}  # proc -> store calls it makes before it is killed at the next
        self.call_pause: Dict[int, Tuple[int, float]] = {}  # rank -> (store calls before the pause, its length)
        # self._on_call is the store's on_call while a kill-call or pause-call is armed (None: no
        # function call per store call in the common turn).
        self.decided: Dict[str, bytes] = {}
        self.committed: Dict[Tuple[int, int], str] = {}  # (lineage, step) -> the digest of the state committed
        self.outcome: Dict[Tuple[int, int], bool] = {}
        self.effects: Dict[Tuple[int, int], Dict[str, int]] = {}  # (lineage, step) -> {state: a rank} side effects ran on
        self.first_violation: Optional[str] = None
        self.log: List[str] = []  # what happened to the replicas, for a violation's report
        self._writes_seen = 0
        self.last_fault_end = max([f.at + f.dur for f in schedule.faults], default=0.0)
        self._progress_deadline = self.last_fault_end + PROGRESS_BOUND_S
        self._keys_bound = KEYS_BASE + KEYS_PER_RANK * len(self.ranks)
        self._ranks_n = len(self.ranks)
        self.restarted: Set[Tuple[int, int]] = set()  # (replica, incarnation) already restarted whole
        # The supervisor's own failure policy (supervisor/policy/failure_policy.py) decides each
        # failure: restart the replica, drop it, leave it failed, or give the run up.
        self.policy = bugs.policy(ft=True, max_restarts=schedule.max_restarts, min_replicas=schedule.min_replicas)
        self.counted: Dict[int, int] = {}  # replica -> restarts charged to its budget (the invariant's own count)
        self.dropped: Set[int] = set()  # ranks of replicas dropped or left failed: never back
        self.given_up = False  # the policy gave the run up: it ends (every worker is stopped)
        self.stop_sent: Optional[float] = None  # when the stop signal reached the supervisor
        self.stopped = False  # the stop is done: every worker is stopped, the run ends
        self.routes: Optional[Routes] = None
        # Where the run's store is: node 0's until its host is lost, then the next host's standby
        # store (its node store). `node_run`: what each node's ftrun announced after a move.
        self.first_addr = "node0"
        self.stores: Dict[str, SimStore] = {"node0": self.store,
                                            **{f"node{n}": st for n, st in self.node_store.items()}}
        self.node_run: Dict[int, Tuple[int, str]] = {}
        self.host = 0
        self.host_lost_at: Optional[float] = None
        self.move_at: Dict[int, float] = {}  # node -> when its ftrun follows the store to the next host
        self.requeued = False  # too few nodes were left to move the store: every node stopped its workers
        # The newest step committed before the move that a surviving member held then (lineage,
        # step), and the old keeper's last quorum: a source of a quorum after it sends nothing older.
        self.kept: Optional[Tuple[int, int]] = None
        self.moved_after = 0
        self.elected: List[int] = []  # the nodes the run goes on with after the move
        # Every quorum published, on any store: a quorum id names one quorum for the whole run (a
        # moved store's keeper counts on above the lost store's), and up to which each keeper was read.
        self.published: Dict[int, bytes] = {}
        self.checkpoints: Dict[str, Marker] = {}  # the run's checkpoint folder (sim/checkpoint.py): name -> marker
        self._published_upto: Dict[int, int] = {}
        self.seen_before_move = 0  # the newest quorum a member that lived on had seen when the store moved
        shape = {}
        if self.nodes > 1:
            self.routes = _SimRoutes(self, {n: (f"node{n}", self.node_ranks(n)) for n in range(1, self.nodes)})
            shape = {"local_ranks": self.node_ranks(0), "routes": self.routes}
        self.keeper = bugs.keeper(_RunStore(self.store.client(600.0)), first, replica_size=self.k,
                                  settings=schedule.keeper_settings(), clock=lambda: sched.now,
                                  spares=schedule.spares, **shape)
        # Every other node's ftrun: a follower keeper (it reports its workers to node 0's) and the relay.
        self.followers: Dict[int, QuorumKeeper] = {
            n: bugs.follower(_RunStore(self.store.client(600.0)), self.ranks, local_ranks=self.node_ranks(n),
                            leader=False, replica_size=self.k, routes=self.routes,
                            settings=schedule.keeper_settings(),
                            clock=lambda: sched.now)
            for n in range(1, self.nodes)}
        self.node_keeper: Dict[int, QuorumKeeper] = {0: self.keeper, **self.followers}

    def node_of(self, rank: int) -> int:
        return rank // self.per_node

    def node_ranks(self, node: int) -> List[int]:
        return list(range(node * self.per_node, (node + 1) * self.per_node))

    def over(self) -> bool:
        if self.given_up or self.stopped or self.requeued:
            return True
        ended = len(self.done) + len(self.gone) + len(self.dropped)
        return ended >= self._ranks_n and len(self.done | self.gone | self.dropped) >= self._ranks_n

    # ------------------------------------------------------------ the supervisor
    def _supervise(self) -> None:
        """Node 0's ftrun: the leader keeper, its own workers' starts and deaths, lost nodes."""
        k = self.keeper
        k.on_store_ready()
        for n in range(1, self.nodes):
            self.sched.spawn(lambda n=n: self._supervise_node(n), "ftrun", f"node{n}")
        late = {f.rank: f.dur for f in self.sch.faults if f.kind == "late"}
        for r in self.ranks:
            if r not in self.joining:
                self.events.append((late.get(r, 0.0), "spawn", r, 0))
        while not self.over():
            self._lead(0, k)
            self.sched.sleep(TICK_S)

    def _lead(self, node: int, k: QuorumKeeper) -> None:
        """A tick of the ftrun hosting the run's store (node 0's, then the next host's): late nodes
        admitted, its workers' starts and deaths, the stop, lost nodes declared, the keeper's poll."""
        now = self.sched.now
        if self.joining and now >= self.sch.join_at:  # a late node is admitted: its ranks, then its workers
            late = {f.rank: f.dur for f in self.sch.faults if f.kind == "late"}
            self.log.append(f"{now:.3f}s ranks {self.joining} join the run")
            k.add_ranks(self.joining)
            self.events += [(now + late.get(r, 0.0), "spawn", r, 0) for r in self.joining]
            self.joining = []
        self._take_events(node, k)
        if self.sch.stop_at >= 0:
            self._stop(k, now)
        for n, at in sorted(self.lost_at.items()):
            if now >= at + NODE_LOST_S and n not in self.routes.lost:
                self.log.append(f"{now:.3f}s node {n} declared lost")
                k.on_node_lost(n, self.node_ranks(n))  # as node 0's ftrun does on its node watch's word
        try:
            k.poll(now)
        except Exception:  # noqa: BLE001 - the store is down: the next tick tries again
            pass
        if self.dropped:  # the leader, told of a dropped replica's exit, lists it in no quorum again
            listed = sorted(r for r in self.dropped if r in k.members and k.alive.get(r) is None)
            if listed:
                self.violation(f"quorum {k.quorum_id} lists rank(s) {listed} of a replica dropped from the run")
        for r, inc in k.take_rejoined():  # the supervisor books a worker's next incarnation, its process the same
            self.inc[r] = inc
        if self.sch.spares:
            self._check_spares(k)
        if k.quorum_id > self._published_upto.get(node, 0):
            self._note_quorums(node, k)

    def _check_spares(self, k: QuorumKeeper) -> None:
        """Hot spares (--spares): a replica the keeper holds back is in none of its quorums, and a
        quorum trains at most the run's replicas less the spares."""
        both = sorted(r for r in k.held if r in k.members)
        if both:
            self.violation(f"rank(s) {both} held back as spares are members of quorum {k.quorum_id}")
        most = max(1, len(k.ranks) // self.k - self.sch.spares)  # one trains at least (keeper/spares.py target)
        training = {r // self.k for r in k.members}
        if len(training) > most:
            self.violation(f"quorum {k.quorum_id} trains {len(training)} replicas ({sorted(training)}), more than the "
                           f"{most} the run's replicas less its {self.sch.spares} spare(s) leave")

    def _note_quorums(self, node: int, k: QuorumKeeper) -> None:
        """The quorums node's keeper published since the last tick: none published twice otherwise
        while a member that lived on had seen the first (one the lost store published just before
        it went, which no survivor saw, may be published again)."""
        data = self.store.data
        for q in range(self._published_upto.get(node, 0) + 1, k.quorum_id + 1):
            raw = data.get(keys.quorum_key(q))
            if raw is not None and self.published.setdefault(q, raw) != raw and q <= self.seen_before_move:
                self.violation(f"quorum {q} published twice, otherwise: {self.published[q].decode()} on the lost "
                               f"store, {raw.decode()} on the moved one")
        self._published_upto[node] = k.quorum_id

    def _stop(self, k: QuorumKeeper, now: float) -> None:
        """A stop signal: the keeper publishes a stop quorum (QuorumKeeper.stop), at whose switch its
        members stop and its writer replica says how its save went (protocol.STOP_SAVE); then the
        supervisor stops every worker. Before any quorum, or with nobody holding the trained state,
        there is nothing to save: it stops at once. Else it waits for the word while a member lives,
        as ftrun's supervisor does (policy/stopping.py check_saving), whichever writer a later stop
        quorum names: a later one that names nobody has to say so."""
        if self.stop_sent is None:
            if now < self.sch.stop_at:
                return
            self.stop_sent = now
            before = k.quorum_id
            writer = k.stop()
            published = k.quorum_id != before
            self.log.append(f"{now:.3f}s stop signal: "
                            + (f"stop quorum {k.quorum_id}, writer {writer}" if published else "no quorum yet"))
            self.stopped = writer is None
            return
        if now > self.stop_sent + STOP_BOUND_S:
            self.violation(f"the stop quorum's writer did not say how its save went within {STOP_BOUND_S:g} s "
                           f"({self._where()})")
            return
        raw = self.store.data.get(keys.quorum_key(k.quorum_id))
        quorum = Quorum.from_json(raw) if raw is not None else None
        if quorum is not None and not quorum.stop:
            self.violation(f"quorum {quorum.id}, published after the stop signal, is not a stop quorum")
            return
        word = self.store.data.get(keys.STOP_SAVE)
        live = [r for r in k.members if r in self.members and self.sched.alive(self.members[r].proc)]
        if word is None and live:
            return  # no writer has said how its save went yet
        if word is not None:  # what it saves is the state committed at the step it names
            said = json.loads(word)
            m = self.members.get(said["rank"])
            if m is not None and m.in_sync and said.get("ok", True):
                seen = self.committed.get((m.lineage, m.step))
                if m.step != said["step"] or (seen is not None and seen != m.digest):
                    self.violation(f"rank {m.rank} saves step {said['step']} at the stop holding step {m.step} "
                                   f"({m.digest}; committed there: {seen})")
        self.log.append(f"{now:.3f}s stop quorum {k.quorum_id}'s writer said: every worker is stopped")
        self.stopped = True

    def _supervise_node(self, n: int) -> None:
        """Node n's ftrun: its workers' starts and deaths told to node 0 through the follower
        keeper, and the relay of its workers' votes and reports."""
        keeper = self.followers[n]
        keeper.on_store_ready()
        local = self.node_store[n].client(NODE_OP_TIMEOUT_S)
        run = [self.store.client(NODE_OP_TIMEOUT_S)]  # the run's store, wherever it is
        relay = NodeRelay(n, self.node_ranks(n), lambda: local, lambda: run[0])
        while not self.over() and n not in self.lost_at:
            if self.sched.now >= self.move_at.get(n, float("inf")):
                del self.move_at[n]
                run[0] = self.store.client(NODE_OP_TIMEOUT_S)
                keeper = self._follow_store(n, keeper, relay)
            if self.host == n and n in self.node_run:  # the store moved here: this node's keeper leads
                self._lead(n, keeper)
                steps = (relay.poll,)
            else:
                self._take_events(n, keeper)
                steps = (keeper.poll, relay.poll)
            for step in steps:
                try:
                    step(self.sched.now)
                except Exception:  # noqa: BLE001 - a store does not answer: the next tick tries again
                    pass
            self.sched.sleep(TICK_S)

    def _follow_store(self, n: int, old: QuorumKeeper, relay: NodeRelay) -> QuorumKeeper:
        """Node n's ftrun after the election (supervisor/nodes/node_decisions.py's move_store and
        publish_move): a keeper on the new store after its old one, readied, then the store's new
        place said in the node's own store (its workers' members/moves.py read it there) and the
        relay told that rounds without a decision here never get one."""
        h, gen, addr = self.host, 1, f"node{self.host}"
        alive = {r: self.inc[r] if r in self.members and r not in self.done and self.sched.alive(self.members[r].proc)
                 else None for r in self.node_ranks(n)}
        keeper = (self.bugs.keeper if n == h else self.bugs.follower)(
            _RunStore(self.store.client(600.0)), [r for e in self.elected for r in self.node_ranks(e)],
            local_ranks=self.node_ranks(n), leader=n == h, replica_size=self.k, routes=self.routes,
            settings=self.sch.keeper_settings(), clock=lambda: self.sched.now,
            spares=self.sch.spares)
        keeper.store_moved(old, alive)
        keeper.on_store_ready()
        self.node_keeper[n] = keeper
        self.node_run[n] = (gen, addr)  # the environment of the workers it starts from now on
        self.node_store[n].client(NODE_OP_TIMEOUT_S).set(keys.RUN_STORE, f"{gen} {addr}")
        relay.moved(keeper.quorum_id)
        self.log.append(f"{self.sched.now:.3f}s node {n} follows the run's store to node {h} "
                        f"(keeper {'leader' if n == h else 'follower'} from quorum {keeper.quorum_id})")
        return keeper

    def _take_events(self, node: int, keeper: QuorumKeeper) -> None:
        now = self.sched.now
        due = sorted(e for e in self.events if e[0] <= now and (e[2] < 0 or self.node_of(e[2]) == node))
        self.events = [e for e in self.events if e not in due]
        for _, what, r, inc in due:
            if r in self.gone or (what == "spawn" and r in self.dropped):  # lost or dropped: never back
                continue
            if what == "spawn":
                inc = max(inc, self.inc[r] + 1)  # after an incarnation booked in place (MemberDriver.rejoin)
                self.inc[r] = inc
                keeper.on_spawn(r, inc)
                m = SimWorker(self, r, inc)
                self.members[r] = m
                self.sched.spawn(m.main, "main", m.proc)
            else:  # died, finished (a "noop" wake-up too: an exit of no incarnation, which changes nothing)
                # The process's incarnation as the supervisor knows it when it sees the exit, as the
                # product's worker record (one it booked in place since the exit counts).
                booked = what in ("died", "finished") and self.k == 1
                keeper.on_exit(r, self.inc[r] if booked else inc, finished=what == "finished")

    def on_member_exit(self, m: SimWorker, code: int, why: str, by_peers: bool = False) -> None:
        """The member's process ends (its own thread, just before it unwinds)."""
        self.log.append(f"{self.sched.now:.3f}s rank {m.rank}.{m.inc} exits {code}: {why} (step {m.step})")
        if code == 0:
            self.events.append((self.sched.now + 0.01, "finished", m.rank, m.inc))
            self.done.add(m.rank)
            return
        self._died(m.rank, m.inc, by_peers)

    def _died(self, rank: int, inc: int, by_peers: bool = False) -> None:
        """A worker died or exited to restart: the supervisor sees it, and its failure policy says
        whether the replica restarts whole (with --replica-size K > 1 its other workers are killed
        first, as ftrun does), is dropped, or the run gives up."""
        now = self.sched.now
        self.events.append((now + 0.005 + 0.02 * self.sched.rng.random(), "died", rank, inc))
        replica = rank // self.k
        if self.k > 1:
            if (replica, inc) in self.restarted:
                return
            self.restarted.add((replica, inc))
        verdict = self._decide(replica, by_peers)
        if self.k > 1:
            # A mate still starting (a late start) is part of the incarnation being replaced.
            self.events = [e for e in self.events
                           if not (e[1] == "spawn" and e[2] // self.k == replica and e[3] <= inc)]
            for mate in range(replica * self.k, replica * self.k + self.k):
                m = self.members.get(mate)
                if mate != rank and m is not None and mate not in self.done and self.sched.alive(m.proc):
                    self.sched.kill(m.proc)
                    self.groups.died()
                    self.log.append(f"{now:.3f}s rank {mate}.{m.inc} killed with its replica (step {m.step})")
                    self.events.append((now + 0.005 + 0.02 * self.sched.rng.random(), "died", mate, m.inc))
        if verdict is not RestartVerdict.RESTART_REPLICA:
            return
        back = now + 0.3 + 0.7 * self.sched.rng.random()
        for mate in range(replica * self.k, replica * self.k + self.k):
            if mate == rank or (self.k > 1 and mate not in self.done):
                self.events.append((back, "spawn", mate, inc + 1))

    def _decide(self, replica: int, by_peers: bool) -> RestartVerdict:
        """The failure policy's verdict on the replica's failure, checked against the invariants
        (a budget never overspent, a drop only while --min-replicas others live), and carried out
        where it ends the replica or the run."""
        mates = range(replica * self.k, replica * self.k + self.k)
        live = {r // self.k for r, m in self.members.items()
                if r // self.k != replica and r not in self.done and self.sched.alive(m.proc)}
        act = self.policy.on_replica_failure(ReplicaFailed(replica, len(live), by_peers=by_peers,
                                                           others_done=bool(self.done),
                                                           saving=self.stop_sent is not None))
        v = act.verdict
        self.log.append(f"{self.sched.now:.3f}s replica {replica}: {v.name} ({len(live)} live beside it"
                        f"{', not counted' if not act.counted else ''})")
        if v is RestartVerdict.RESTART_REPLICA:
            if act.counted:
                self.counted[replica] = self.counted.get(replica, 0) + 1
                if self.counted[replica] > self.sch.max_restarts:
                    self.violation(f"replica {replica} restarted {self.counted[replica]} times counted, past its "
                                   f"budget of {self.sch.max_restarts}")
            return v
        if v is RestartVerdict.DROP_REPLICA and len(live) < self.sch.min_replicas:
            self.violation(f"replica {replica} dropped with {len(live)} replicas live beside it, fewer than "
                           f"--min-replicas {self.sch.min_replicas}")
        if v is RestartVerdict.GIVE_UP:
            self.given_up = True  # the supervisor stops every worker: the run ends here
            return v
        self.dropped.update(r for r in mates if r not in self.done)
        # A mate still to start (a late start) never does.
        self.events = [e for e in self.events if not (e[1] == "spawn" and e[2] // self.k == replica)]
        return v

    def kill(self, rank: int) -> None:
        m = self.members.get(rank)
        if m is None or rank in self.done or not self.sched.alive(m.proc):
            return
        self.sched.kill(m.proc)
        self.groups.died()
        self.log.append(f"{self.sched.now:.3f}s rank {rank}.{m.inc} killed (step {m.step}, {m.phase})")
        self._died(rank, m.inc)

    # ------------------------------------------------------------ faults
    def _on_call(self, proc: str) -> None:
        if not self.call_pause and not self.call_kill:
            self.store.on_call = None  # nothing armed any more
            return
        rank = int(proc[1:].split(".")[0]) if proc.startswith("r") else -1
        pause = self.call_pause.get(rank)
        if pause is not None:
            if pause[0] > 0:
                self.call_pause[rank] = (pause[0] - 1, pause[1])
            else:
                del self.call_pause[rank]
                self.sched.pause(proc, self.sched.now + pause[1])
                self.sched.sleep(0.0)  # stopped before its call takes effect
        left = self.call_kill.get(proc)
        if left is None:
            return
        if left > 0:
            self.call_kill[proc] = left - 1
            return
        del self.call_kill[proc]
        self.kill(int(proc[1:].split(".")[0]))
        self.sched.block()  # the caller dies here: its call never reaches the store

    def _faults(self) -> None:
        for f in sorted(self.sch.faults, key=lambda f: f.at):
            self.sched.sleep(f.at - self.sched.now)
            m = self.members.get(f.rank)
            proc = m.proc if m is not None else f"r{f.rank}.?"
            if f.kind == "kill":
                self.kill(f.rank)
            elif f.kind == "kill-call":
                if m is not None and f.rank not in self.done:
                    self.call_kill[m.proc] = int(f.x)
                    self.store.on_call = self._on_call
            elif f.kind == "heal-kill":
                self.heal_kill[f.rank] = True
            elif f.kind == "pause-call":
                self.call_pause[f.rank] = (int(f.x), f.dur)
                self.store.on_call = self._on_call
            elif f.kind == "pause":
                self.sched.pause(proc, self.sched.now + f.dur)
            elif f.kind == "slow":
                self.sched.slow[proc] = f.x
                self.events.append((self.sched.now + f.dur, "noop", f.rank, -1))
            elif f.kind == "store-down":
                self.store.down_until = self.sched.now + f.dur
            elif f.kind == "store-slow":
                self.store.extra_latency = f.x
            elif f.kind == "node-lost":
                self._lose_node(f.rank)
            elif f.kind == "host-lost":
                self._host_lost()
            elif f.kind == "kill-all":
                for r in sorted(self.members):
                    self.kill(r)
        self.sched.sleep(max(0.0, self.last_fault_end - self.sched.now))
        self.sched.slow.clear()
        self.store.extra_latency = 0.0

    def _host_lost(self) -> None:
        """The node hosting the run's store is lost, its workers and its store with it. The others
        agree on the next host, the lowest node left (failover.elect's first candidate that
        answers), if more than half of the run's nodes are left; else every node stops its workers
        (node_decisions' lost_majority: the job is requeued)."""
        h = self.host
        if self.host_lost_at is not None or self.nodes < 3:
            return  # one move a run: a second needs more than half of the layout, which one move leaves
        now = self.sched.now
        self.host_lost_at = now
        self.kept = self._newest_kept(h)
        self.moved_after = self.node_keeper[h].quorum_id
        self.seen_before_move = max((m.driver.latest_seen for r, m in self.members.items()
                                     if self.node_of(r) != h and r not in self.done and self.sched.alive(m.proc)),
                                    default=0)
        self.sched.kill("supervisor" if h == 0 else f"node{h}")
        self.store.lose()
        for r in self.node_ranks(h):
            m = self.members.get(r)
            if m is not None and r not in self.done and self.sched.alive(m.proc):
                self.sched.kill(m.proc)
                self.groups.died()
                self.log.append(f"{now:.3f}s rank {r}.{m.inc} lost with the store's host, node {h} (step {m.step})")
            if r not in self.done:
                self.gone.add(r)
        self.events = [e for e in self.events if e[2] < 0 or self.node_of(e[2]) != h]
        left = [n for n in range(self.nodes) if n != h and n not in self.lost_at]
        if len(left) < failover.majority(self.nodes):
            self.log.append(f"{now:.3f}s the store's host is lost and only nodes {left} are left: requeued")
            self.requeued = True
            return
        self.host, self.elected = left[0], left
        self.routes = _SimRoutes(self, {e: (f"node{e}", self.node_ranks(e)) for e in left})
        on_call, self.store = self.store.on_call, self.node_store[left[0]]
        self.store.on_call = on_call
        self._writes_seen = len(self.store.writes)
        at = now + MOVE_S[0] + (MOVE_S[1] - MOVE_S[0]) * self.sched.rng.random()
        for n in left:
            self.move_at[n] = at + MOVE_SPREAD_S * self.sched.rng.random()
        self.log.append(f"{now:.3f}s node {h}, the store's host, is lost: the store moves to node {left[0]} "
                        f"(newest committed step a survivor holds: {self.kept})")

    def _newest_kept(self, h: int) -> Optional[Tuple[int, int]]:
        """(lineage, step): the newest step committed that a member off node `h` holds in sync."""
        best: Optional[Tuple[int, int]] = None
        for r, m in self.members.items():
            if (self.node_of(r) == h or r in self.done or not self.sched.alive(m.proc) or not m.in_sync
                    or m.driver.heals.tainted):
                continue
            c = max((st for (lin, st) in self.committed if lin == m.lineage and st <= m.step), default=None)
            if c is not None and (best is None or c > best[1]):
                best = (m.lineage, c)
        return best

    def check_source(self, m: SimWorker, quorum: Quorum) -> None:
        """A moved store loses no committed step: a quorum's source after the move sends the newest
        step committed before it, or newer, while a member of that quorum still holds it."""
        if self.kept is None or quorum.id <= self.moved_after:
            return
        lineage, step = self.kept
        if m.lineage == lineage and m.step >= step:
            return
        for r, inc in quorum.members:
            o = self.members.get(r)
            if (o is not None and o.inc == inc and self.sched.alive(o.proc) and o.lineage == lineage
                    and o.step >= step and not o.driver.heals.tainted):
                self.violation(f"the moved store lost committed step {step}: rank {m.rank}, the source of quorum "
                               f"{quorum.id}, sends step {m.step} while rank {r}, a member, holds step {o.step}")
                return

    def check_resume(self, m: SimWorker, marker: Marker) -> None:
        """A resumed checkpoint holds a committed state: every round its writer had stepped on
        was decided to keep its steps, and its state is the one committed at its step."""
        lineage, step, digest, undecided = marker
        for (e, rnd), taken in undecided:
            raw = self.decided.get(keys.decision_key(e, rnd))
            if raw is None and self.host_lost_at is not None and e <= self.moved_after:
                continue  # its decision went with the lost store: the moved store's first source adopted it
            commit, _, kept = keys.parse_decision(raw.decode()) if raw is not None else (False, 0, 0)
            if not commit and taken > (kept or 0):
                self.violation(f"rank {m.rank} resumes checkpoint step {step}, written after round {rnd} of quorum "
                               f"{e}, which was {'voted down' if raw is not None else 'never decided'}")
                return
        seen = self.committed.get((lineage, step))
        if seen is not None and seen != digest:
            self.violation(f"rank {m.rank} resumes checkpoint step {step} holding {digest}, while the committed "
                           f"state there is {seen}")
        self.log.append(f"{self.sched.now:.3f}s rank {m.rank} resumes checkpoint step {step}")

    def _lose_node(self, n: int) -> None:
        if n in self.lost_at or not 0 < n < self.nodes:
            return
        now = self.sched.now
        self.lost_at[n] = now
        self.sched.kill(f"node{n}")
        self.node_store[n].down_until = float("inf")  # its store went with it
        for r in self.node_ranks(n):
            m = self.members.get(r)
            if m is not None and r not in self.done and self.sched.alive(m.proc):
                self.sched.kill(m.proc)
                self.groups.died()
                self.log.append(f"{now:.3f}s rank {r}.{m.inc} lost with node {n} (step {m.step}, {m.phase})")
            if r not in self.done:
                self.gone.add(r)
        self.events = [e for e in self.events if e[2] < 0 or self.node_of(e[2]) != n]

    # ------------------------------------------------------------ invariants
    def violation(self, what: str) -> None:
        if self.first_violation is None:
            self.first_violation = f"t={self.sched.now:.3f}s: {what}"

    def note_commit(self, m: SimWorker, e: int, rnd: int, after: Tuple[int, int, str]) -> None:
        """A member learned that round (e, rnd), on which it stepped to `after`, committed."""
        lineage, step, digest = after
        seen = self.committed.setdefault((lineage, step), digest)
        self._effects_committed(lineage, step)
        if seen != digest:
            self.violation(f"step {step} committed with two states: rank {m.rank} (incarnation {m.inc}) holds "
                           f"{digest}, another member {seen} (round {rnd} of quorum {e})")

    def check_state(self, m: SimWorker) -> None:
        """Before a member sends its gradients: no round it stepped on may have been decided
        otherwise, and its state is the state every member committed at its step."""
        if not m.in_sync:
            return
        d = m.driver
        # A round of several steps is decided at its end: a member mid-round learns it at its vote.
        open_round = (d.quorum.id, d.round) if d.quorum is not None and d.taken else None
        for (e, rnd), taken in m.stepped.items():
            decided = self.decided.get(keys.decision_key(e, rnd))
            if decided is None or (e, rnd) == open_round:
                continue
            commit, _, kept = keys.parse_decision(decided.decode())
            if not commit and taken > (kept or 0):  # a round voted down keeps only its first `kept` steps
                self.violation(f"rank {m.rank} (incarnation {m.inc}) goes on from round {rnd} of quorum {e}, "
                               f"which was voted down (it keeps {kept or 0} of its steps, this member took {taken})")
        seen = self.committed.get((m.lineage, m.step))
        it = d.iteration
        if it.several and (it.taken or it.done):  # inside a loop step: its sub-steps so far are on top of it
            return
        if seen is not None and seen != m.digest:
            self.violation(f"rank {m.rank} (incarnation {m.inc}) goes on at step {m.step} holding {m.digest}, "
                           f"while the committed state is {seen}")

    def check_handout(self, m: SimWorker) -> None:
        """A step the loop hands the script: only to a member in sync (healed, or the source of a
        fresh quorum: never its initial state, nor one it stepped past a round voted down on, until
        it heals). On an evaluation step (every EVAL_EVERY) at a round's top, the script runs its
        side effects unless ft.redo(): never twice on one state (what they changed is the script's
        state, which a heal moves: a healed member's count is its source's), and only on the state
        committed at that step (checked here and as commits are learned, note_commit). Inside a round of several
        steps the steps before are not decided yet: a side effect there may run on a state a
        failure later in the round discards (a limit the docs state), so only a round's top is
        checked."""
        d = m.driver
        if not m.in_sync or d.heals.tainted:
            self.violation(f"rank {m.rank} (incarnation {m.inc}) is handed step {d.step} while out of sync "
                           f"({'tainted' if d.heals.tainted else 'never healed'}; quorum "
                           f"{d.quorum.id if d.quorum else None}, round {d.round})")
            return
        if d.step % EVAL_EVERY or d.taken:
            return
        if d.redo:  # what ft.redo() returns (the script gates its evaluation on it)
            return
        state = (m.lineage, d.step, m.digest)
        if state in m.effects:
            self.violation(f"rank {m.rank} (incarnation {m.inc}) runs step {d.step}'s side effects a second time on "
                           f"one state (its own, or its heal's source's): the step was handed out again without "
                           f"ft.redo()")
        m.effects.add(state)
        self.effects.setdefault((m.lineage, d.step), {})[m.digest] = m.rank
        self._effects_committed(m.lineage, d.step)

    def _effects_committed(self, lineage: int, step: int) -> None:
        """Every side effect of `step` ran on the state committed there (once that is known)."""
        seen = self.committed.get((lineage, step))
        ran = self.effects.get((lineage, step))
        if seen is None or not ran:
            return
        for digest, rank in ran.items():
            if digest != seen:
                self.violation(f"rank {rank} ran step {step}'s side effects on {digest}, a state the run discarded "
                               f"(committed there: {seen}); ft.redo() was False before the decision of the round "
                               f"under it was read")

    def _check(self) -> None:
        s = self.store
        sched = self.sched
        if (len(s.writes) == self._writes_seen and s.max_keys <= self._keys_bound and not self.node_store
                and sched.now <= self._progress_deadline and sched.turns <= TURNS_BOUND and not sched.errors):
            return  # the common turn: nothing new to check
        if len(s.writes) > self._writes_seen:
            for _, op, key, value in s.writes[self._writes_seen:]:
                if "/d/" in key:
                    first = self.decided.setdefault(key, value)
                    if first != value:
                        self.violation(f"{key} decided twice: {first.decode()!r}, then {value.decode()!r}")
            self._writes_seen = len(s.writes)
        if s.max_keys > self._keys_bound:
            self.violation(f"the store grew to {s.max_keys} keys")
        for n, ns in self.node_store.items():
            if ns is not s and ns.max_keys > KEYS_BASE + KEYS_PER_RANK * self.per_node:
                self.violation(f"node {n}'s store grew to {ns.max_keys} keys")
        if self.sched.now > self._progress_deadline:
            self.violation(f"no progress: the run has not finished {PROGRESS_BOUND_S:g} s after the last fault "
                           f"({self._where()})")
        if self.sched.turns > TURNS_BOUND:
            self.violation(f"livelock: {TURNS_BOUND} turns without finishing ({self._where()})")
        if self.sched.errors:
            e = self.sched.errors[0]
            self.violation(f"a crash in protocol code: {type(e).__name__}: {e}")

    def _where(self) -> str:
        return "; ".join(f"rank {r}: {m.info()}" for r, m in sorted(self.members.items()) if r not in self.done)

    # ------------------------------------------------------------ the run
    def run(self) -> Optional[str]:
        self.sched.spawn(self._supervise, "keeper", "supervisor")
        self.sched.spawn(self._faults, "faults", "sim")
        try:
            turn, check, over = self.sched.turn, self._check, self.over
            done, gone, dropped, n = self.done, self.gone, self.dropped, self._ranks_n
            sched, store = self.sched, self.store
            writes, bound, deadline = store.writes, self._keys_bound, self._progress_deadline
            every_turn = bool(self.node_store)  # other nodes' stores: their sizes are checked each turn
            while ((len(done) + len(gone) + len(dropped) < n and not self.given_up and not self.stopped
                    and not self.requeued) or not over()) \
                    and self.first_violation is None:
                try:
                    if not turn():
                        break
                except Deadlock as e:
                    self.violation(f"deadlock: every thread waits for ever ({e}; {self._where()})")
                    break
                # _check's own test of the common turn, inline: nothing new to check
                if (every_turn or len(writes) != self._writes_seen or store.max_keys > bound or sched.now > deadline
                        or sched.turns > TURNS_BOUND or sched.errors):
                    check()
        finally:
            self.sched.shutdown()
        return self.first_violation


class _SimRoutes(Routes):
    """The keeper's clients of the nodes' stores: the simulated ones (None once a node is lost)."""

    def __init__(self, world: World, nodes) -> None:
        super().__init__(nodes)
        self._world = world

    def client(self, node: int):
        if node in self.lost:
            return None
        client = self._clients.get(node)
        if client is None:
            client = self._clients[node] = self._world.node_store[node].client(NODE_OP_TIMEOUT_S)
        return client


class _RunStore:
    """What the keeper holds: its .store is the run's store (supervisor/store.py's RunStore)."""

    def __init__(self, client) -> None:
        self.store = client


def run_schedule(schedule: Schedule, bugs, stats: Optional[Dict[str, float]] = None) -> Optional[str]:
    """The schedule's first violation, or None. `stats` gets the longest time any run took to
    finish after its last fault ended (the margin under PROGRESS_BOUND_S)."""
    sched = Sched(random.Random(schedule.seed))
    world = World(sched, schedule, bugs)
    found = world.run()
    if stats is not None and found is None:
        after = max(0.0, sched.now - world.last_fault_end)
        stats["after_last_fault_s"] = max(stats.get("after_last_fault_s", 0.0), after)
    return found
