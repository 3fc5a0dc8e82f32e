"""What the loop decides on another node's news: a node lost or ended, the store gone (move it,
re-form the round, or stop for a requeue), a late node waiting or taken in, another node's failure.

The node coordinator (ftrun.supervisor.nodes.coordinator) reports a NodeEvent; NodeNews decides what it
means for this node's workers and returns the action the loop carries out: a StopRun, a
RemoteFailure for the failures component, or a StoreMoved (the new quorum keeper and worker
environment after the run's store moved). It owns only the pace of the late nodes' admission.
Must never be called from outside the loop's thread, never read the watch's state but through
NodeEvent and the coordinator's answers, and never signal, start or stop a worker.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union

from ftrun.config import RunConfig
from ftrun.keys import RUN_STORE
from ftrun.supervisor.nodes.failover import NoMajority
from ftrun.supervisor.nodes.node_common import NODE_LOST, REQUEUE, NodeEvent
from ftrun.supervisor.nodes.redirect import Redirect
from ftrun.supervisor.relay import Routes
from ftrun.supervisor.policy.stopping import AfterStop, StopRun
from ftrun.supervisor.ft.quorum import QuorumKeeper
from ftrun.supervisor.workers.logs import ConsoleOut
from ftrun.supervisor.workers.worker import Worker
from ftrun.wire import FirstFailure

ADMIT_GAP_S = 1.0  # --ft, elastic: at most one late node taken in per this long (admit_waiting)


@dataclass(frozen=True)
class RemoteFailure:
    """An action for the loop: another node's failure (agreed in the store) fails the group here."""

    failure: Optional[FirstFailure]


@dataclass(frozen=True)
class StoreMoved:
    """An action for the loop: the run's store moved; the new quorum keeper, the workers' new
    environment entries, and the first quorum above every quorum a replica may have seen."""

    quorum: QuorumKeeper
    env: Dict[str, str] = field(default_factory=dict)
    first_quorum_id: int = 0
    elected: Any = None      # failover.Elected
    before: int = 0          # the run's nodes before the move
    t0: float = 0.0          # when the move began (time.monotonic)


NodeAction = Union[StopRun, RemoteFailure, StoreMoved, None]


def node_ranks(cfg: RunConfig, k: int) -> List[int]:
    return list(range(k * cfg.nproc, (k + 1) * cfg.nproc))


def routes(cfg: RunConfig, nodes: Any, live: List[int]) -> Optional[Routes]:
    """The nodes of `live` whose workers vote through their node's store (each published its
    store as it joined; node 0's workers vote in the run's store it hosts)."""
    if nodes is None or not nodes.standby:
        return None
    return Routes({k: (nodes.standby[k], node_ranks(cfg, k)) for k in live if k in nodes.standby})


def can_reform(cfg: RunConfig) -> bool:
    """c10d without --ft: torchrun's restart is a new round of the rendezvous, within its budget."""
    return cfg.rdzv == "c10d" and not cfg.ft and cfg.total_restarts is not None and cfg.round < cfg.total_restarts


class NodeNews:
    """The multi-node part of the supervisor's loop."""

    def __init__(self, cfg: RunConfig, console: ConsoleOut) -> None:
        self.cfg = cfg
        self.console = console
        self._told_full = False
        self._admitted_at = 0.0

    def add_node(self, quorum: QuorumKeeper, nodes: Any, k: int) -> None:
        """Late node k's replicas become ranks of the quorum, voting through its own store."""
        standby = nodes.standby.get(k)
        quorum.add_ranks(node_ranks(self.cfg, k), (k, standby) if standby else None)

    def admit_waiting(self, quorum: QuorumKeeper, nodes: Any) -> None:
        """Node 0, --ft on an elastic run: late nodes take free places, first come first served,
        one a second at most (the tick calls again): every other node learns of one from the node
        list before the next comes, so no two nodes count the run's nodes more than one apart
        (ftrun.supervisor.nodes.failover.keeps_running)."""
        while nodes.waiting and len(nodes.live) < self.cfg.max_nodes:
            if time.monotonic() - self._admitted_at < ADMIT_GAP_S:
                return
            k = nodes.next_waiting()
            if not nodes.still_waiting(k):
                continue
            self.add_node(quorum, nodes, k)  # their keys exist before anyone reads them
            nodes.admit(k)
            self._admitted_at = time.monotonic()
            self.console.note(f"node {k} joins the running run ({len(nodes.live)} of at most {self.cfg.max_nodes} "
                              f"nodes); its replicas heal from a peer", style="bold cyan")
        if nodes.waiting and not self._told_full:
            self._told_full = True
            self.console.note(f"node{'s' if len(nodes.waiting) > 1 else ''} {', '.join(map(str, nodes.waiting))} "
                              f"wait{'s' if len(nodes.waiting) == 1 else ''} for a place: the run has its "
                              f"{self.cfg.max_nodes} nodes", style="yellow")

    def on_event(self, ev: NodeEvent, nodes: Any, quorum: Optional[QuorumKeeper], workers: List[Worker],
                 store: Any, k: int) -> NodeAction:
        """What the other nodes' coordinator saw: the store gone, a node lost, another node's failure."""
        cfg = self.cfg
        if ev.kind == "remote_failure":
            return RemoteFailure(ev.failure)
        live = [w for w in workers if w.alive]
        if ev.kind == "node_waiting":
            nodes.ask_place(ev.node)
            self.admit_waiting(quorum, nodes)
            return None
        if ev.kind == "node_joined":
            if quorum is not None:
                self.add_node(quorum, nodes, ev.node)
            self.console.note(f"{ev.text}; its replicas heal from a peer", style="cyan")
            return None
        if ev.kind == "store_gone" and cfg.ft and nodes.may_move():
            return self.move_store(ev, nodes, quorum, workers, store, k)
        if ev.kind == "store_gone" and can_reform(cfg) and nodes.may_move_between_rounds():
            self.console.note(f"{ev.text}; ending round {cfg.round}: the nodes that remain move the run's store "
                              f"and re-form the run (restart {cfg.round + 1} of {cfg.total_restarts})",
                              style="bold yellow")
            return StopRun(signal.SIGTERM, cfg.shutdown_timeout, AfterStop.EXIT, NODE_LOST,
                           summary="node 0 (the run's store) went away", reform=True, store_lost=True)
        if ev.kind == "node_lost" and cfg.ft and not nodes.majority_kept():
            return self.lost_majority(f"{ev.text}; this node and the nodes it still sees are fewer than half of the "
                                      f"run's {nodes.layout_size}")
        if ev.kind == "node_lost" and cfg.ft:
            self.console.note(f"{ev.text}; carrying on without its replicas (--ft)", style="bold yellow")
            if quorum is not None and quorum.leader:  # a lost node's replicas are dead in the quorum at once
                quorum.on_node_lost(ev.node, node_ranks(cfg, ev.node))
            if cfg.admits_late and nodes.me == nodes.host_node:
                nodes.drop(ev.node)
                self._told_full = False
                self.admit_waiting(quorum, nodes)
            return None
        reform = ev.kind == "node_lost" and can_reform(cfg)
        if reform:
            self.console.note(f"{ev.text}; ending round {cfg.round}: the nodes that remain re-form the run "
                              f"(restart {cfg.round + 1} of {cfg.total_restarts})", style="bold yellow")
        elif ev.kind == "node_lost":
            self.console.note(f"{ev.text}; stopping this node's workers (without --ft the run needs every node)",
                              style="bold red")
        else:
            what = (f"stopping this node's {len(live)} worker{'s' if len(live) != 1 else ''}" if live
                    else "ending this node's run")
            self.console.note(f"{ev.text}; {what}", style="bold red")
        summary = ev.text if ev.kind == "node_lost" else "node 0 (the run's store) went away"
        code = NODE_LOST
        if ev.kind == "store_gone" and cfg.ft:
            # Nothing here can go on without the store: a scheduler that requeues on this status
            # restarts the job, which resumes from --checkpoint-dir (docs/guides/checkpoints.md: requeue).
            code = REQUEUE
            self.console.note(f"exit {REQUEUE}: requeue the job to resume"
                              f"{' from ' + cfg.checkpoint_dir if cfg.checkpoint_dir else ''}", style="bold yellow")
        return StopRun(signal.SIGTERM, cfg.shutdown_timeout, AfterStop.EXIT, code, summary=summary, reform=reform)

    def move_store(self, ev: NodeEvent, nodes: Any, old: QuorumKeeper, workers: List[Worker], store: Any,
                   k: int) -> Union[StopRun, StoreMoved]:
        """--ft: the run's store is lost with its node; the surviving nodes agree on a new host
        (ftrun.supervisor.nodes.failover), and this node's keeper and workers follow it. The replicas
        keep their state: each rejoins, and the first quorum on the new store is healed from the
        replica holding the newest complete step. The loop takes the new keeper, readies it, then
        publish_move() tells the workers."""
        cfg = self.cfg
        t0 = time.monotonic()
        self.console.note(f"{ev.text}; moving the run's store to a surviving node", style="bold yellow")
        before = nodes.layout_size  # an elastic run counts only the new layout after the move
        try:
            elected = nodes.fail_over()
        except NoMajority as e:
            return self.lost_majority(f"the run's store could not move: {e}")
        host, _, port = elected.addr.rpartition(":")
        env = {} if cfg.workers_master_addr else {"MASTER_ADDR": host}
        env.update({"MASTER_PORT": port, "FTRUN_STORE": elected.addr})
        quorum = QuorumKeeper(store, [r for n in elected.nodes for r in node_ranks(cfg, n)],
                              [w.rank for w in workers], leader=elected.host == cfg.node_rank,
                              replica_size=k, routes=routes(cfg, nodes, elected.nodes), spares=cfg.spares)
        quorum.store_moved(old, {w.rank: w.incarnation if w.alive else None for w in workers})
        return StoreMoved(quorum, env, quorum.quorum_id, elected, before, t0)

    def publish_move(self, mv: StoreMoved, nodes: Any, relay: Any) -> None:
        """After the loop took the new keeper: the workers learn the store's new address, late nodes
        find the run at its new host, members waiting on the old store follow."""
        cfg, elected = self.cfg, mv.elected
        nodes.node_store.store.set(RUN_STORE, f"{nodes.gen} {elected.addr}")
        if cfg.admits_late and elected.host == cfg.node_rank:
            # Nodes started from now on with the run's line find the run here (c10d, elastic).
            nodes.open_to_late_nodes(elected.addr.rpartition(":")[0])
            Redirect(cfg.endpoint, cfg.run_id, elected.addr).start()
        if relay is not None:  # members waiting for a decision of the old store follow the new one
            relay.moved(mv.first_quorum_id)
        self.console.note(f"node {elected.host} hosts the run's store now, at {elected.addr} ({len(elected.nodes)} "
                          f"of {mv.before} nodes, agreed in {time.monotonic() - mv.t0:.1f} s); the "
                          f"replicas keep their state and rejoin", style="bold cyan")

    def lost_majority(self, why: str) -> StopRun:
        """--ft: this node may no longer go on (a second run could form elsewhere): stop its workers."""
        text = f"{why}; stopping this node so that no second run can form"
        self.console.note(text, style="bold red")
        self.console.note(f"exit {REQUEUE}: requeue the job to resume"
                          f"{' from ' + self.cfg.checkpoint_dir if self.cfg.checkpoint_dir else ''}",
                          style="bold yellow")
        return StopRun(signal.SIGTERM, self.cfg.shutdown_timeout, AfterStop.EXIT, REQUEUE, summary=text)
