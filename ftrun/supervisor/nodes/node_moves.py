"""The run's store moves (--ft, three nodes or more, static or elastic c10d): the standby stores
and the election that follows a lost store host.

Every node but node 0 hosts a standby store and publishes its address in ``standby/K`` (a late
node as it asks in); when the store is lost, fail_over() carries out the election of
ftrun.supervisor.nodes.failover and follows the new host (which then plays node 0's part, but for
taking late nodes in); majority_kept() says whether the host may go on after losing nodes.
Under c10d without --ft the rendezvous moves the store between two rounds; a round only says
whether a move may follow (may_move_between_rounds()).
Functions of the coordinator (ftrun.supervisor.nodes.coordinator), which they read: they return what a move
elected, and the coordinator takes its new host, live list and watch from that.
Must never start, stop or signal a worker, never write the coordinator's fields, and never decide
what the run does after a move.
"""

from __future__ import annotations

import json
import os
import socket
from typing import Any, Tuple

from ftrun.protocol import RDZV, RDZV_HOST, rdzv_arrivals
from ftrun.supervisor.nodes import failover
from ftrun.supervisor.nodes import node_common as nc
from ftrun.supervisor.nodes.node_common import NODE_TIMEOUT_S


def may_move(self: Any) -> bool:
    """Whether this node can take part in moving the run's store (ftrun.supervisor.nodes.failover)."""
    return (self.can_move and self.me != self.host_node and self.node_store is not None
            and self.layout_size >= 3)


def elect_host(self: Any) -> failover.Elected:
    """The run's store is lost: agree with the surviving nodes on the next host (the
    coordinator follows it). Raises failover.NoMajority when this node may not go on."""
    lost = self.host_node
    gone = set(self.lost_nodes())
    candidates = [k for k in sorted(self.live) if k != lost and k not in gone and k in self.standby]
    if not self.node_store.wait(NODE_TIMEOUT_S):
        raise failover.NoMajority(f"this node's standby store is not up ({self.node_store.error})")
    gen = self.gen + 1

    def prepare(store: Any) -> None:
        # This node's keys exist in the new store before the layout forms: the others' watch
        # reads them all at once from then on.
        store.set(nc.KEYS.beat(self.me), "0")
        store.set(nc.KEYS.final(self.me), "")
        store.set(nc.KEYS.table(self.me), "[]")
        store.set(nc.KEYS.who(self.me), f"{socket.gethostname()} pid {os.getpid()}")
        store.set(nc.KEYS.standby(self.me), self.standby[self.me])  # for nodes that join there later
        store.compare_set(nc.KEYS.fail(self.attempt), "", "")
        store.compare_set(nc.KEYS.live, "", "[]")

    elected = failover.elect(self.me, gen, candidates, self.standby, self.node_store.store, self.layout_size,
                             NODE_TIMEOUT_S, prepare, lambda: self._signalled(0) is not None)
    if elected.host == self.me:
        elected.store.set(nc.KEYS.live, json.dumps(sorted(elected.nodes)))
    return elected


def open_to_late_nodes(self: Any, master_addr: str) -> Tuple[int, str]:
    """The new host of an elastic --ft run: nodes that come now (sent here from the original
    endpoint, ftrun.supervisor.redirect) ask this store to take them in, as they asked node 0's.
    Their node ranks come after every rank the run has used. The next arrival's node rank and
    the arrivals key, for the coordinator to follow."""
    n, s = self.cfg.round, self.store
    top = max(self._seen | set(self.live) | {self.me})
    s.set(nc.KEYS.layout, f"{self.nnodes} {self.cfg.nproc} {self.cfg.run_id}")
    s.set(RDZV_HOST, f"{self.me} {self.gen}")
    s.set(RDZV + "master_addr", master_addr)
    s.set(RDZV + f"{n}/size", str(len(self.live)))
    s.set(RDZV + "round", str(n))
    s.add(rdzv_arrivals(n), top - int(s.add(rdzv_arrivals(n), 0)))  # the next one is node top + 1
    return top + 1, rdzv_arrivals(n)


def may_move_between_rounds(self: Any) -> bool:
    """c10d without --ft: whether the run's store, lost with its node, can move to the nodes
    that remain (a round of three nodes or more; the rendezvous moves it and re-forms)."""
    return (self.node_store is not None and not self.cfg.ft and self.me != self.host_node
            and self.layout_size >= 3)


def majority_kept(self: Any) -> bool:
    """The host's side goes on while it holds at least half of the run's nodes: a side
    without it needs more than half to move the store, so the two never both go on."""
    if not self.can_move or self.me != self.host_node or self.layout_size < 3:  # nobody could move it
        return True
    return failover.keeps_running(1 + len(self.others) - len(self.lost_nodes()), self.layout_size,
                                  strict=self.elastic)
