"""The simulated ftrun of a --ft run: node 0's supervisor (the leader keeper, its workers' starts and
deaths, the stop, lost nodes) and every other node's (a follower keeper and the node relay), each
a thread of the scheduler that ticks as ftrun's loop does. What it does about an event is the
product's own: the real keeper (QuorumKeeper), the real failure policy, and the supervisor's pure
reactions (ftrun.supervisor.workers.replica: the mates stopped with a failed worker and the
incarnation of a restart; accounting/checkpoints.stop_outcome: when the stop-save is over;
nodes/failover.next_host: the store's next host). It owns the simulated processes: which worker
runs as which incarnation, which are done, lost or dropped, and the events ftrun has still to see.
Must never check an invariant of its own (sim/invariants.py does) nor be imported by the product.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Set, Tuple

from ftrun import keys
from ftrun.sim.worker import SimWorker
from ftrun.supervisor.accounting.checkpoints import stop_outcome
from ftrun.supervisor.ft.quorum import QuorumKeeper
from ftrun.supervisor.nodes import failover
from ftrun.supervisor.policy.failure_policy import ReplicaFailed, RestartVerdict
from ftrun.supervisor.relay import NODE_OP_TIMEOUT_S, NodeRelay, Routes
from ftrun.supervisor.workers import replica as replica_rules
from ftrun.wire import Quorum

TICK_S = 0.05  # the supervisor's loop under --ft (supervisor/loop/run.py)
STOP_BOUND_S = 30.0  # after a stop quorum, its members stop (and its writer says how its save went) within this
NODE_LOST_S = 3.0  # node 0 declares a node lost this long after its beats stop (supervisor/nodes/node_watch.py)
# After the store's host is lost, the others notice (their node watch), agree on the next host
# (supervisor/nodes/failover.py: at once once every candidate chose it) and start their keepers on it
# this long after, give or take MOVE_SPREAD_S between the nodes.
MOVE_S = (0.3, 1.5)
MOVE_SPREAD_S = 0.2


class SimSupervisor:
    def __init__(self, world: Any) -> None:  # sim/world.World, which imports this module
        self.w = world
        sch, bugs, sched = world.sch, world.bugs, world.sched
        self.sched, self.sch, self.k, self.nodes, self.log = sched, sch, world.k, world.nodes, world.log
        first = world.ranks[:sch.replicas * self.k]  # the run's ranks at its start
        self.joining = world.ranks[len(first):]  # a late node's: node 0 admits them at join_at
        self._ranks_n = len(world.ranks)
        self.members: Dict[int, SimWorker] = {}
        self.inc: Dict[int, int] = {r: -1 for r in world.ranks}  # each worker's incarnation as ftrun booked it
        self.done: Set[int] = set()
        self.gone: Set[int] = set()  # ranks of lost nodes: never back
        self.lost_at: Dict[int, float] = {}  # node -> when it was lost
        self.events: List[Tuple[float, str, int, int]] = []  # (when, what, rank, inc) for the supervisor
        self.restarted: Set[Tuple[int, int]] = set()  # (replica, incarnation) already restarted whole
        # The supervisor's own failure policy (supervisor/policy/failure_policy.py) decides each
        # failure: restart the replica, drop it, leave it failed, or give the run up.
        self.policy = bugs.policy(ft=True, max_restarts=sch.max_restarts, min_replicas=sch.min_replicas)
        self.counted: Dict[int, int] = {}  # replica -> restarts charged to its budget (the invariant's own count)
        self.dropped: Set[int] = set()  # ranks of replicas dropped or left failed: never back
        self.given_up = False  # the policy gave the run up: it ends (every worker is stopped)
        self.stop_sent: Optional[float] = None  # when the stop signal reached the supervisor
        self.stopped = False  # the stop is done: every worker is stopped, the run ends
        self.routes: Optional[Routes] = None
        # What each node's ftrun announced after a move; the store's host, and what its loss left.
        self.node_run: Dict[int, Tuple[int, str]] = {}
        self.host = 0
        self.host_lost_at: Optional[float] = None
        self.move_at: Dict[int, float] = {}  # node -> when its ftrun follows the store to the next host
        self.requeued = False  # too few nodes were left to move the store: every node stopped its workers
        self.elected: List[int] = []  # the nodes the run goes on with after the move
        shape = {}
        if self.nodes > 1:
            self.routes = _SimRoutes(world, {n: (f"node{n}", world.node_ranks(n)) for n in range(1, self.nodes)})
            shape = {"local_ranks": world.node_ranks(0), "routes": self.routes}
        self.keeper = bugs.keeper(_RunStore(world.store.client(600.0)), first, replica_size=self.k,
                                  settings=sch.keeper_settings(), clock=lambda: sched.now,
                                  spares=sch.spares, **shape)
        # Every other node's ftrun: a follower keeper (it reports its workers to node 0's) and the relay.
        self.followers: Dict[int, QuorumKeeper] = {
            n: bugs.follower(_RunStore(world.store.client(600.0)), world.ranks, local_ranks=world.node_ranks(n),
                             leader=False, replica_size=self.k, routes=self.routes,
                             settings=sch.keeper_settings(),
                             clock=lambda: sched.now)
            for n in range(1, self.nodes)}
        self.node_keeper: Dict[int, QuorumKeeper] = {0: self.keeper, **self.followers}

    def over(self) -> bool:
        if self.given_up or self.stopped or self.requeued:
            return True
        ended = len(self.done) + len(self.gone) + len(self.dropped)
        return ended >= self._ranks_n and len(self.done | self.gone | self.dropped) >= self._ranks_n

    def supervise(self) -> None:
        """Node 0's ftrun: the leader keeper, its own workers' starts and deaths, lost nodes."""
        k = self.keeper
        k.on_store_ready()
        for n in range(1, self.nodes):
            self.sched.spawn(lambda n=n: self._supervise_node(n), "ftrun", f"node{n}")
        late = {f.rank: f.dur for f in self.sch.faults if f.kind == "late"}
        for r in self.w.ranks:
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
                k.on_node_lost(n, self.w.node_ranks(n))  # as node 0's ftrun does on its node watch's word
        try:
            k.poll(now)
        except Exception:  # noqa: BLE001 - the store is down: the next tick tries again
            pass
        if self.dropped:  # the leader, told of a dropped replica's exit, lists it in no quorum again
            listed = sorted(r for r in self.dropped if r in k.members and k.alive.get(r) is None)
            if listed:
                self.w.invariants.violation(f"quorum {k.quorum_id} lists rank(s) {listed} of a replica dropped from the run")
        for r, inc in k.take_rejoined():  # the supervisor books a worker's next incarnation, its process the same
            self.inc[r] = inc
        if self.sch.spares:
            self.w.invariants.spares_held(k)
        self.w.invariants.quorums_published(node, k)

    def _stop(self, k: QuorumKeeper, now: float) -> None:
        """A stop signal: the keeper publishes a stop quorum (QuorumKeeper.stop), at whose switch its
        members stop and its writer replica says how its save went (keys.STOP_SAVE); then the
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
            self.w.invariants.violation(f"the stop quorum's writer did not say how its save went within {STOP_BOUND_S:g} s "
                           f"({self.w.invariants.where()})")
            return
        raw = self.w.store.data.get(keys.quorum_key(k.quorum_id))
        quorum = Quorum.from_json(raw) if raw is not None else None
        if quorum is not None and not quorum.stop:
            self.w.invariants.violation(f"quorum {quorum.id}, published after the stop signal, is not a stop quorum")
            return
        raw = self.w.store.data.get(keys.STOP_SAVE)
        said = json.loads(raw) if raw is not None else None
        live = [r for r in k.members if r in self.members and self.sched.alive(self.members[r].proc)]
        # ftrun's own rule (no deadline here: STOP_BOUND_S above is the invariant's)
        if stop_outcome(said, now, self.stop_sent, float("inf"), bool(live)) is None:
            return  # no writer has said how its save went yet
        if said is not None:  # what it saves is the state committed at the step it names
            m = self.members.get(said["rank"])
            if m is not None and m.in_sync and said.get("ok", True):
                seen = self.w.invariants.committed.get((m.lineage, m.step))
                if m.step != said["step"] or (seen is not None and seen != m.digest):
                    self.w.invariants.violation(f"rank {m.rank} saves step {said['step']} at the stop holding step {m.step} "
                                   f"({m.digest}; committed there: {seen})")
        self.log.append(f"{now:.3f}s stop quorum {k.quorum_id}'s writer said: every worker is stopped")
        self.stopped = True

    def _supervise_node(self, n: int) -> None:
        """Node n's ftrun: its workers' starts and deaths told to node 0 through the follower
        keeper, and the relay of its workers' votes and reports."""
        keeper = self.followers[n]
        keeper.on_store_ready()
        local = self.w.node_store[n].client(NODE_OP_TIMEOUT_S)
        run = [self.w.store.client(NODE_OP_TIMEOUT_S)]  # the run's store, wherever it is
        relay = NodeRelay(n, self.w.node_ranks(n), lambda: local, lambda: run[0])
        while not self.over() and n not in self.lost_at:
            if self.sched.now >= self.move_at.get(n, float("inf")):
                del self.move_at[n]
                run[0] = self.w.store.client(NODE_OP_TIMEOUT_S)
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
                 else None for r in self.w.node_ranks(n)}
        keeper = (self.w.bugs.keeper if n == h else self.w.bugs.follower)(
            _RunStore(self.w.store.client(600.0)), [r for e in self.elected for r in self.w.node_ranks(e)],
            local_ranks=self.w.node_ranks(n), leader=n == h, replica_size=self.k, routes=self.routes,
            settings=self.sch.keeper_settings(), clock=lambda: self.sched.now,
            spares=self.sch.spares)
        keeper.store_moved(old, alive)
        keeper.on_store_ready()
        self.node_keeper[n] = keeper
        self.node_run[n] = (gen, addr)  # the environment of the workers it starts from now on
        self.w.node_store[n].client(NODE_OP_TIMEOUT_S).set(keys.RUN_STORE, f"{gen} {addr}")
        relay.moved(keeper.quorum_id)
        self.log.append(f"{self.sched.now:.3f}s node {n} follows the run's store to node {h} "
                        f"(keeper {'leader' if n == h else 'follower'} from quorum {keeper.quorum_id})")
        return keeper

    def _take_events(self, node: int, keeper: QuorumKeeper) -> None:
        now = self.sched.now
        per_node = self.w.per_node
        due = [e for e in self.events if e[0] <= now and (e[2] < 0 or e[2] // per_node == node)]
        if not due:
            return  # the common tick: nothing due
        due.sort()
        self.events = [e for e in self.events if e not in due]
        for _, what, r, inc in due:
            if r in self.gone or (what == "spawn" and r in self.dropped):  # lost or dropped: never back
                continue
            if what == "spawn":
                self.inc[r] = inc
                keeper.on_spawn(r, inc)
                m = SimWorker(self.w, r, inc)
                self.members[r] = m
                self.sched.spawn(m.main, "main", m.proc)
            else:  # died, finished (a "noop" wake-up too: an exit of no incarnation, which changes nothing)
                # The process's incarnation as ftrun's worker record has it when it sees the exit (one
                # it booked in place since counts); a "noop" wake-up names no incarnation.
                keeper.on_exit(r, self.inc[r] if what != "noop" else inc, finished=what == "finished")

    def on_member_exit(self, m: SimWorker, code: int, why: str, by_peers: bool = False) -> None:
        """The member's process ends (its own thread, just before it unwinds)."""
        self.log.append(f"{self.sched.now:.3f}s rank {m.rank}.{m.inc} exits {code}: {why} (step {m.step})")
        if code == 0:
            self.events.append((self.sched.now + 0.01, "finished", m.rank, m.inc))
            self.done.add(m.rank)
            return
        self.died(m.rank, m.inc, by_peers)

    def _runs(self, rank: int) -> bool:
        m = self.members.get(rank)
        return m is not None and rank not in self.done and self.sched.alive(m.proc)

    def died(self, rank: int, inc: int, by_peers: bool = False) -> None:
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
            for mate in replica_rules.stopped_with(replica, self.k, rank, self._runs):
                m = self.members[mate]
                self.sched.kill(m.proc)
                self.w.groups.died()
                self.log.append(f"{now:.3f}s rank {mate}.{m.inc} killed with its replica (step {m.step})")
                self.events.append((now + 0.005 + 0.02 * self.sched.rng.random(), "died", mate, m.inc))
        if verdict is not RestartVerdict.RESTART_REPLICA:
            return
        back = now + 0.3 + 0.7 * self.sched.rng.random()
        # As ftrun's worker table: one incarnation for the whole replica, past each record's.
        nxt = replica_rules.next_incarnation(self.inc[m] for m in replica_rules.ranks_of(replica, self.k))
        for mate in replica_rules.ranks_of(replica, self.k):
            if mate == rank or (self.k > 1 and mate not in self.done):
                self.events.append((back, "spawn", mate, nxt))

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
                    self.w.invariants.violation(f"replica {replica} restarted {self.counted[replica]} times counted, past its "
                                   f"budget of {self.sch.max_restarts}")
            return v
        if v is RestartVerdict.DROP_REPLICA and len(live) < self.sch.min_replicas:
            self.w.invariants.violation(f"replica {replica} dropped with {len(live)} replicas live beside it, fewer than "
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
        self.w.groups.died()
        self.log.append(f"{self.sched.now:.3f}s rank {rank}.{m.inc} killed (step {m.step}, {m.phase})")
        self.died(rank, m.inc)

    def host_lost(self) -> None:
        """The node hosting the run's store is lost, its workers and its store with it. The others
        agree on the next host (failover.next_host: the first candidate whose standby store answers),
        if more than half of the run's nodes are left; else every node stops its workers
        (node_decisions' lost_majority: the job is requeued)."""
        h = self.host
        if self.host_lost_at is not None or self.nodes < 3:
            return  # one move a run: a second needs more than half of the layout, which one move leaves
        now = self.sched.now
        self.host_lost_at = now
        self.w.invariants.store_lost(h, self.node_keeper[h].quorum_id)
        self.sched.kill("supervisor" if h == 0 else f"node{h}")
        self.w.store.lose()
        self._node_gone(h, "the store's host")
        left = failover.candidates(range(self.nodes), {h, *self.lost_at}, range(self.nodes))
        if len(left) < failover.majority(self.nodes):
            self.log.append(f"{now:.3f}s the store's host is lost and only nodes {left} are left: requeued")
            self.requeued = True
            return
        # Each node left turns to the host ftrun's election rule gives it; every other node's
        # standby store answers here (the lost ones are not candidates), so they all agree.
        hosts = {failover.next_host(left, n, lambda c: c not in self.lost_at) for n in left}
        if len(hosts) != 1 or None in hosts:
            self.w.invariants.violation(f"the nodes left after the store's host was lost turn to hosts {hosts}")
            return
        self.host, self.elected = hosts.pop(), left
        self.routes = _SimRoutes(self.w, {e: (f"node{e}", self.w.node_ranks(e)) for e in left})
        self.w.move_store(self.host)
        at = now + MOVE_S[0] + (MOVE_S[1] - MOVE_S[0]) * self.sched.rng.random()
        for n in left:
            self.move_at[n] = at + MOVE_SPREAD_S * self.sched.rng.random()
        self.log.append(f"{now:.3f}s node {h}, the store's host, is lost: the store moves to node {self.host} "
                        f"(newest committed step a survivor holds: {self.w.invariants.kept})")

    def lose_node(self, n: int) -> None:
        if n in self.lost_at or not 0 < n < self.nodes:
            return
        now = self.sched.now
        self.lost_at[n] = now
        self.sched.kill(f"node{n}")
        self.w.node_store[n].down_until = float("inf")  # its store went with it
        self._node_gone(n, "its node")

    def _node_gone(self, n: int, what: str) -> None:
        """Node n's workers are gone with it, for good; nothing of theirs is started again."""
        now = self.sched.now
        for r in self.w.node_ranks(n):
            m = self.members.get(r)
            if m is not None and r not in self.done and self.sched.alive(m.proc):
                self.sched.kill(m.proc)
                self.w.groups.died()
                self.log.append(f"{now:.3f}s rank {r}.{m.inc} lost with {what}, node {n} (step {m.step}, {m.phase})")
            if r not in self.done:
                self.gone.add(r)
        self.events = [e for e in self.events if e[2] < 0 or self.w.node_of(e[2]) != n]


class _SimRoutes(Routes):
    """The keeper's clients of the nodes' stores: the simulated ones (None once a node is lost)."""

    def __init__(self, world: Any, nodes) -> None:
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
