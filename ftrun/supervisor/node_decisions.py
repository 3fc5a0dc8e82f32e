"""What the loop decides on another node's news: a node lost or ended, the store gone (move it,
re-form the round, or stop for a requeue), a late node waiting or taken in, another node's failure.

The node coordinator (ftrun.supervisor.nodes) reports a NodeEvent; here the
loop decides what it means for this node's workers and carries it out through
the quorum keeper, the stopping state and the coordinator's agreements.
Part of the Supervisor (a mixin: the decisions rebuild the loop's own quorum
keeper, worker environment and status). Must never be called from outside the
loop's thread, and never read the watch's state but through NodeEvent and
the coordinator's answers.
"""

from __future__ import annotations

import signal
import time
from typing import List, Optional

from ftrun.protocol import RUN_STORE
from ftrun.supervisor.failover import NoMajority
from ftrun.supervisor.nodes import NODE_LOST, REQUEUE, NodeEvent
from ftrun.supervisor.quorum import QuorumKeeper
from ftrun.supervisor.redirect import Redirect
from ftrun.supervisor.relay import Routes
from ftrun.supervisor.stopping import AfterStop

ADMIT_GAP_S = 1.0  # --ft, elastic: at most one late node taken in per this long (_admit_waiting)



class NodeDecisions:
    """The multi-node part of the Supervisor's loop (ftrun.supervisor.run holds the state)."""

    def _node_ranks(self, k: int) -> List[int]:
        return list(range(k * self.cfg.nproc, (k + 1) * self.cfg.nproc))

    def _routes(self, live: List[int]) -> Optional[Routes]:
        """The nodes of `live` whose workers vote through their node's store (each published its
        store as it joined; node 0's workers vote in the run's store it hosts)."""
        if self.nodes is None or not self.nodes.standby:
            return None
        return Routes({k: (self.nodes.standby[k], self._node_ranks(k)) for k in live if k in self.nodes.standby})

    def _add_node(self, k: int) -> None:
        """Late node k's replicas become ranks of the quorum, voting through its own store."""
        standby = self.nodes.standby.get(k)
        self.quorum.add_ranks(self._node_ranks(k), (k, standby) if standby else None)

    def _admit_waiting(self) -> None:
        """Node 0, --ft on an elastic run: late nodes take free places, first come first served,
        one a second at most (the tick calls again): every other node learns of one from the node
        list before the next comes, so no two nodes count the run's nodes more than one apart
        (ftrun.supervisor.failover.keeps_running)."""
        nodes = self.nodes
        while nodes.waiting and len(nodes.live) < self.cfg.max_nodes:
            if time.monotonic() - self._admitted_at < ADMIT_GAP_S:
                return
            k = nodes.waiting.pop(0)
            if not nodes.still_waiting(k):
                continue
            self._add_node(k)  # their keys exist before anyone reads them
            nodes.admit(k)
            self._admitted_at = time.monotonic()
            self.console.note(f"node {k} joins the running run ({len(nodes.live)} of at most {self.cfg.max_nodes} "
                              f"nodes); its replicas heal from a peer", style="bold cyan")
        if nodes.waiting and not self._told_full:
            self._told_full = True
            self.console.note(f"node{'s' if len(nodes.waiting) > 1 else ''} {', '.join(map(str, nodes.waiting))} "
                              f"wait{'s' if len(nodes.waiting) == 1 else ''} for a place: the run has its "
                              f"{self.cfg.max_nodes} nodes", style="yellow")

    def _on_node_event(self, ev: NodeEvent) -> None:
        """What the other nodes' coordinator saw: the store gone, a node lost, another node's failure."""
        if ev.kind == "remote_failure":
            self.ledger.remote_failure(ev.failure, time.time())
            self._group_failure(None, None, ev.failure)
            return
        live = [w for w in self.workers if w.alive]
        if ev.kind == "node_waiting":
            self.nodes.waiting.append(ev.node)
            self._admit_waiting()
            return
        if ev.kind == "node_joined":
            if self.quorum is not None:
                self._add_node(ev.node)
            self.console.note(f"{ev.text}; its replicas heal from a peer", style="cyan")
            return
        if ev.kind == "store_gone" and self.cfg.ft and self.nodes.may_move():
            self._move_store(ev)
            return
        if ev.kind == "store_gone" and self._can_reform() and self.nodes.may_move_between_rounds():
            self.reform = self.store_lost = True
            self.status.exit_summary = "node 0 (the run's store) went away"
            self.console.note(f"{ev.text}; ending round {self.cfg.round}: the nodes that remain move the run's store "
                              f"and re-form the run (restart {self.cfg.round + 1} of {self.cfg.total_restarts})",
                              style="bold yellow")
            self._begin_stop(signal.SIGTERM, self.cfg.shutdown_timeout, AfterStop.EXIT, NODE_LOST)
            return
        if ev.kind == "node_lost" and self.cfg.ft and not self.nodes.majority_kept():
            self._lost_majority(f"{ev.text}; this node and the nodes it still sees are fewer than half of the "
                                f"run's {self.nodes.layout_size}")
            return
        if ev.kind == "node_lost" and self.cfg.ft:
            self.console.note(f"{ev.text}; carrying on without its replicas (--ft)", style="bold yellow")
            self._on_node_lost(ev.node)
            if self.cfg.admits_late and self.nodes.me == self.nodes.host_node:
                self.nodes.drop(ev.node)
                self._told_full = False
                self._admit_waiting()
            return
        if ev.kind == "node_lost" and self._can_reform():
            self.reform = True
            self.console.note(f"{ev.text}; ending round {self.cfg.round}: the nodes that remain re-form the run "
                              f"(restart {self.cfg.round + 1} of {self.cfg.total_restarts})", style="bold yellow")
        elif ev.kind == "node_lost":
            self.console.note(f"{ev.text}; stopping this node's workers (without --ft the run needs every node)",
                              style="bold red")
        else:
            what = (f"stopping this node's {len(live)} worker{'s' if len(live) != 1 else ''}" if live
                    else "ending this node's run")
            self.console.note(f"{ev.text}; {what}", style="bold red")
        self.status.exit_summary = ev.text if ev.kind == "node_lost" else "node 0 (the run's store) went away"
        code = NODE_LOST
        if ev.kind == "store_gone" and self.cfg.ft:
            # Nothing here can go on without the store: a scheduler that requeues on this status
            # restarts the job, which resumes from --checkpoint-dir (docs/guides/checkpoints.md: requeue).
            code = REQUEUE
            self.console.note(f"exit {REQUEUE}: requeue the job to resume"
                              f"{' from ' + self.cfg.checkpoint_dir if self.cfg.checkpoint_dir else ''}",
                              style="bold yellow")
        self._begin_stop(signal.SIGTERM, self.cfg.shutdown_timeout, AfterStop.EXIT, code)

    def _move_store(self, ev: NodeEvent) -> None:
        """--ft: the run's store is lost with its node; the surviving nodes agree on a new host
        (ftrun.supervisor.failover), and this node's keeper and workers follow it. The replicas
        keep their state: each rejoins, and the first epoch on the new store is healed from the
        replica holding the newest complete step."""
        t0 = time.monotonic()
        self.console.note(f"{ev.text}; moving the run's store to a surviving node", style="bold yellow")
        before = self.nodes.layout_size  # an elastic run counts only the new layout after the move
        try:
            elected = self.nodes.fail_over()
        except NoMajority as e:
            self._lost_majority(f"the run's store could not move: {e}")
            return
        host, _, port = elected.addr.rpartition(":")
        if not self.cfg.workers_master_addr:
            self.common["MASTER_ADDR"] = host
        self.common["MASTER_PORT"] = port
        self.common["FTRUN_STORE"] = elected.addr
        old = self.quorum
        self.quorum = QuorumKeeper(self.store, [r for k in elected.nodes for r in self._node_ranks(k)],
                                   [w.rank for w in self.workers], leader=elected.host == self.cfg.node_rank,
                                   replica_size=self.k, routes=self._routes(elected.nodes))
        self.quorum.fresh_start = old.fresh_start
        self.quorum.epoch_id = old.epoch_id + 1  # above every epoch a replica may have seen
        self.quorum.info = dict(old.info)  # the replicas' last words, until they speak again
        self.quorum.moved = True
        self.quorum.awaited = set(old.members) or None
        for w in self.workers:
            self.quorum.alive[w.rank] = w.incarnation if w.alive else None
        self._on_store_ready()
        self.nodes.node_store.store.set(RUN_STORE, f"{self.nodes.gen} {elected.addr}")
        if self.cfg.admits_late and elected.host == self.cfg.node_rank:
            # Nodes started from now on with the run's line find the run here (c10d, elastic).
            self.nodes.open_to_late_nodes(host)
            Redirect(self.cfg.endpoint, self.cfg.run_id, elected.addr).start()
        if self.relay is not None:  # members waiting for a decision of the old store follow the new one
            self.relay.moved(old.epoch_id + 1)
        self.console.note(f"node {elected.host} hosts the run's store now, at {elected.addr} ({len(elected.nodes)} "
                          f"of {before} nodes, agreed in {time.monotonic() - t0:.1f} s); the "
                          f"replicas keep their state and rejoin", style="bold cyan")
        self._dirty = True

    def _lost_majority(self, why: str) -> None:
        """--ft: this node may no longer go on (a second run could form elsewhere): stop its workers."""
        text = f"{why}; stopping this node so that no second run can form"
        self.console.note(text, style="bold red")
        self.status.exit_summary = text
        self.console.note(f"exit {REQUEUE}: requeue the job to resume"
                          f"{' from ' + self.cfg.checkpoint_dir if self.cfg.checkpoint_dir else ''}",
                          style="bold yellow")
        self._begin_stop(signal.SIGTERM, self.cfg.shutdown_timeout, AfterStop.EXIT, REQUEUE)

    def _can_reform(self) -> bool:
        """c10d without --ft: torchrun's restart is a new round of the rendezvous, within its budget."""
        return (self.cfg.rdzv == "c10d" and not self.cfg.ft and self.cfg.total_restarts is not None
                and self.cfg.round < self.cfg.total_restarts)

    def _on_node_lost(self, node: int) -> None:
        """--ft: a lost node's replicas are dead in the quorum at once (only node 0's keeper decides)."""
        q = self.quorum
        if q is None or not q.leader:
            return
        q.on_node_lost(node, self._node_ranks(node))
