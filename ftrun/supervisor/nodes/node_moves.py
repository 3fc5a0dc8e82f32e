"""The run's store moves (--ft, three nodes or more, static or elastic c10d): the standby stores
and the election that follows a lost store host.

Every node but node 0 hosts a standby store and publishes its address in ``standby/K`` (a late
node as it asks in); when the store is lost, fail_over() carries out the election of
ftrun.supervisor.nodes.failover and follows the new host (which then plays node 0's part, but for
taking late nodes in); majority_kept() says whether the host may go on after losing nodes.
Under c10d without --ft the rendezvous moves the store between two rounds; a round only says
whether a move may follow (may_move_between_rounds()).
Functions of a MoveView, the coordinator's (ftrun.supervisor.nodes.coordinator) facts a move is
decided from, copied when asked: the rules (may_move, may_move_between_rounds, majority_kept) are
pure; elect_host returns what the election chose, and the coordinator takes its new host, live
list and watch from that.
Must never start, stop or signal a worker, never write the coordinator's fields, and never decide
what the run does after a move.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Set, Tuple

from ftrun.keys import RDZV, RDZV_HOST, rdzv_arrivals
from ftrun.supervisor.nodes import failover
from ftrun.supervisor.nodes import node_common as nc
from ftrun.supervisor.nodes.node_common import NODE_TIMEOUT_S


@dataclass(frozen=True)
class MoveView:
    """What the store's moves are decided from, as the coordinator sees it when asked
    (NodeCoordinator.move_view): the functions below read nothing else of it."""

    me: int
    host_node: int                 # the node hosting the run's store now
    layout_size: int               # the run's nodes a majority counts (NodeCoordinator.layout_size)
    live: Tuple[int, ...]          # the run's nodes on this store
    others: Tuple[int, ...]        # live but this node
    lost: Tuple[int, ...]          # nodes gone silent or ended with a failure
    can_move: bool                 # --ft on an elastic run, or on three nodes or more
    elastic: bool                  # c10d: the host keeps going only with more than half
    ft: bool
    has_store: bool                # this node hosts a store of its own (a standby)
    standby: Mapping[int, str] = field(default_factory=dict)  # each node's standby store, host:port
    gen: int = 0                   # how often the store moved
    attempt: int = 0


def may_move(v: MoveView) -> bool:
    """Whether this node can take part in moving the run's store (ftrun.supervisor.nodes.failover)."""
    return v.can_move and v.me != v.host_node and v.has_store and v.layout_size >= 3


def elect_host(v: MoveView, node_store: Any, stopped: Callable[[], bool]) -> failover.Elected:
    """The run's store is lost: agree with the surviving nodes on the next host (the coordinator
    follows it). `node_store`: this node's standby store (RunStore); `stopped`: a signal asked the
    run to stop. Raises failover.NoMajority when this node may not go on."""
    candidates = failover.candidates(v.live, {v.host_node, *v.lost}, v.standby)
    if not node_store.wait(NODE_TIMEOUT_S):
        raise failover.NoMajority(f"this node's standby store is not up ({node_store.error})")
    gen = v.gen + 1

    def prepare(store: Any) -> None:
        # This node's keys exist in the new store before the layout forms: the others' watch
        # reads them all at once from then on.
        store.set(nc.KEYS.beat(v.me), "0")
        store.set(nc.KEYS.final(v.me), "")
        store.set(nc.KEYS.table(v.me), "[]")
        store.set(nc.KEYS.who(v.me), f"{socket.gethostname()} pid {os.getpid()}")
        store.set(nc.KEYS.standby(v.me), v.standby[v.me])  # for nodes that join there later
        store.compare_set(nc.KEYS.fail(v.attempt), "", "")
        store.compare_set(nc.KEYS.live, "", "[]")

    elected = failover.elect(v.me, gen, candidates, dict(v.standby), node_store.store, v.layout_size,
                             NODE_TIMEOUT_S, prepare, stopped)
    if elected.host == v.me:
        elected.store.set(nc.KEYS.live, json.dumps(sorted(elected.nodes)))
    return elected


def open_to_late_nodes(v: MoveView, cfg: Any, store: Any, seen: Set[int], master_addr: str) -> Tuple[int, str]:
    """The new host of an elastic --ft run: nodes that come now (sent here from the original
    endpoint, ftrun.supervisor.nodes.redirect) ask this store to take them in, as they asked node 0's.
    Their node ranks come after every rank the run has used (`seen`). The next arrival's node
    rank and the arrivals key, for the coordinator to follow."""
    n, s = cfg.round, store
    top = max(seen | set(v.live) | {v.me})
    s.set(nc.KEYS.layout, f"{cfg.nnodes} {cfg.nproc} {cfg.run_id}")
    s.set(RDZV_HOST, f"{v.me} {v.gen}")
    s.set(RDZV + "master_addr", master_addr)
    s.set(RDZV + f"{n}/size", str(len(v.live)))
    s.set(RDZV + "round", str(n))
    s.add(rdzv_arrivals(n), top - int(s.add(rdzv_arrivals(n), 0)))  # the next one is node top + 1
    return top + 1, rdzv_arrivals(n)


def may_move_between_rounds(v: MoveView) -> bool:
    """c10d without --ft: whether the run's store, lost with its node, can move to the nodes
    that remain (a round of three nodes or more; the rendezvous moves it and re-forms)."""
    return v.has_store and not v.ft and v.me != v.host_node and v.layout_size >= 3


def majority_kept(v: MoveView) -> bool:
    """The host's side goes on while it holds at least half of the run's nodes: a side
    without it needs more than half to move the store, so the two never both go on."""
    if not v.can_move or v.me != v.host_node or v.layout_size < 3:  # nobody could move it
        return True
    return failover.keeps_running(1 + len(v.others) - len(v.lost), v.layout_size, strict=v.elastic)
