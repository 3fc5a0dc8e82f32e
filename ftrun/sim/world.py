"""One simulated run of --ft: the real keeper (ftrun.supervisor.ft.quorum.QuorumKeeper) polled by a
simulated supervisor that sees deaths and restarts replicas (sim/supervisor.py), simulated worker
processes running the product's member driver (sim/worker.py), simulated process groups
(sim/groups.py: a collective succeeds only if every member of the group reaches it and none has
died or left it), a schedule of faults (sim/schedule.py, carried out by sim/faults.py), and the
protocol's invariants (sim/invariants.py), checked after every scheduled turn that wrote to a
store. `run_schedule(schedule, bugs)` returns the first violation, or None.
This module holds the machines the parts share (the scheduler, the run's store and each node's,
the run's layout, its log) and the run loop; each part owns its own state.
On several nodes every node but node 0 has its own store, through which its workers vote and
report, kept by the real node relay (ftrun.supervisor.relay.NodeRelay) and a follower keeper
that tells node 0's leader of its workers' starts and deaths; a lost node's workers die with
it and its store is gone, and node 0 declares it lost a few seconds later, as its node watch does.
On three nodes or more the node hosting the run's store may be lost (host-lost): the others agree
on the next host, whose standby store (its node store) becomes the run's, and each surviving
node's ftrun starts the product's keeper there after its old one (QuorumKeeper.store_moved), says
where the store went in its own store (keys.RUN_STORE) and tells its relay; its workers follow
through the product's member/moves.py.
Must never be imported by the product.
"""

from __future__ import annotations

import random
from typing import Dict, List, Optional

from ftrun.sim.checkpoint import Marker
from ftrun.sim.faults import Faults
from ftrun.sim.groups import Groups
from ftrun.sim.invariants import TURNS_BOUND, Invariants
from ftrun.sim.schedule import Schedule
from ftrun.sim.sched import Deadlock, Sched
from ftrun.sim.store import SimStore
from ftrun.sim.supervisor import SimSupervisor

STEP_S = 0.05  # a training step's compute, on average (virtual)


class World:
    def __init__(self, sched: Sched, schedule: Schedule, bugs) -> None:
        self.sched = sched
        self.sch = schedule
        self.bugs = bugs
        self.total = schedule.total
        self.step_s = STEP_S
        self.k = schedule.k
        self.ranks = list(range((schedule.replicas + schedule.joiners) * self.k))
        self.nodes = schedule.nodes
        self.per_node = len(self.ranks) // self.nodes
        self.store = SimStore(sched)  # the run's store: node 0's until its host is lost, then the next host's
        self.node_store: Dict[int, SimStore] = {n: SimStore(sched) for n in range(1, self.nodes)}
        # Where the run's store is, by address: a node's standby store is its node store.
        self.first_addr = "node0"
        self.stores: Dict[str, SimStore] = {"node0": self.store,
                                            **{f"node{n}": st for n, st in self.node_store.items()}}
        self.checkpoints: Dict[str, Marker] = {}  # the run's checkpoint folder (sim/checkpoint.py): name -> marker
        self.log: List[str] = []  # what happened to the replicas, for a violation's report
        self.faults = Faults(self)
        self.invariants = Invariants(self, self.faults.last_fault_end)
        self.groups = Groups(sched, self.invariants.violation)
        self.supervisor = SimSupervisor(self)

    def node_of(self, rank: int) -> int:
        return rank // self.per_node

    def node_ranks(self, node: int) -> List[int]:
        return list(range(node * self.per_node, (node + 1) * self.per_node))

    def move_store(self, node: int) -> None:
        """The run's store is node `node`'s standby store from now on (the old one's host is lost);
        a fault armed on the old one's calls stays armed."""
        on_call, self.store = self.store.on_call, self.node_store[node]
        self.store.on_call = on_call
        self.invariants.store_switched()

    def run(self) -> Optional[str]:
        sup, inv, sched = self.supervisor, self.invariants, self.sched
        sched.spawn(sup.supervise, "keeper", "supervisor")
        sched.spawn(self.faults.run, "faults", "sim")
        check, over = inv.check, sup.over
        done, gone, dropped, n = sup.done, sup.gone, sup.dropped, len(self.ranks)
        store = self.store
        writes, bound, deadline = store.writes, inv._keys_bound, inv._progress_deadline
        every_turn = bool(self.node_store)  # other nodes' stores: their sizes are checked each turn

        def go_on() -> bool:
            return (((len(done) + len(gone) + len(dropped) < n and not sup.given_up and not sup.stopped
                      and not sup.requeued) or not over())
                    and inv.first_violation is None)

        def between() -> None:
            # check()'s own test of the common turn, inline: nothing new to check
            if (every_turn or len(writes) != inv._writes_seen or store.max_keys > bound or sched.now > deadline
                    or sched.turns > TURNS_BOUND or sched.errors):
                check()

        try:
            sched.run(go_on, between)
        except Deadlock as e:
            inv.violation(f"deadlock: every thread waits for ever ({e}; {inv.where()})")
        finally:
            sched.shutdown()
        return inv.first_violation


def run_schedule(schedule: Schedule, bugs, stats: Optional[Dict[str, float]] = None) -> Optional[str]:
    """The schedule's first violation, or None. `stats` gets the longest time any run took to
    finish after its last fault ended (the margin under PROGRESS_BOUND_S)."""
    sched = Sched(random.Random(schedule.seed))
    world = World(sched, schedule, bugs)
    found = world.run()
    if stats is not None and found is None:
        after = max(0.0, sched.now - world.faults.last_fault_end)
        stats["after_last_fault_s"] = max(stats.get("after_last_fault_s", 0.0), after)
    return found
