"""Joining a multi-node run: every node claims its rank and waits for the others before any worker
starts; a late node (--ft, elastic c10d) joins a running round without a barrier.

Each node bumps ``claim/K`` (a second claimant of rank K sees 2 and stops: exit 2) and waits
until every rank is claimed. A failed join is one line and JOIN_FAILED, nothing started.
The coordinator (ftrun.supervisor.nodes.coordinator) calls join_nodes() and takes what it returns, a
NodesJoined (the nodes' names and standby stores, where the store is now): the join reads the
coordinator and the store, and writes none of the coordinator's fields.
Must never start, stop or signal a worker, nor start the node watch.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

from ftrun.keys import RDZV_HOST
from ftrun.supervisor.nodes import node_common as nc
from ftrun.supervisor.nodes.node_common import INJECT_JOIN_HOLD_ENV, JOIN_FAILED, POLL_S
from ftrun.wire import one_line


@dataclass(frozen=True)


class NodesJoined:
    """The outcome of a join: `code` None when joined (else ftrun's exit status, `summary` its line),
    the other nodes' names and standby stores (this node's own too), the store's host node and move."""

    code: Optional[int] = None
    summary: str = ""
    who: Dict[int, str] = field(default_factory=dict)
    standby: Dict[int, str] = field(default_factory=dict)
    host_node: int = 0
    gen: int = 0


def join_nodes(c: Any) -> NodesJoined:
    """Block until every node has joined, reading the coordinator `c` (ftrun.supervisor.nodes.coordinator)."""
    self = c
    cfg = self.cfg
    t0 = time.monotonic()
    deadline = t0 + cfg.join_timeout
    where = f"{self.host}:{self.port}"
    while not self.run_store.ready.is_set():
        code = self._wait_signal(POLL_S)
        if code is not None:
            return NodesJoined(code)
    if self.run_store.store is None:
        err = self.run_store.error
        if self.me == 0:
            return _join_failed(self, f"node 0 could not host the run's store on {where}: {one_line(err)}")
        return _join_failed(
            self,
            f"node {self.me} could not reach node 0's store at {where}: {one_line(err)}; "
            f"check that node 0's ftrun runs with --master-port {self.port} and that {self.host} "
            f"is node 0's address as seen from this machine")
    store = self.store
    if self.late:
        return _join_late(self, t0, where)
    who: Dict[int, str] = {}
    standby: Dict[int, str] = {}
    layout = f"{cfg.nnodes} {cfg.nproc} {cfg.run_id}"
    try:
        if self.me == 0:
            store.set(nc.KEYS.live, json.dumps(self.live))
            store.set(nc.KEYS.layout, layout)
        else:
            while not store.check([nc.KEYS.layout]):
                code = self._wait_signal(POLL_S)
                if code is not None:
                    return NodesJoined(code)
                if time.monotonic() > deadline:
                    return _join_failed(self, f"{where} answers but is not an ftrun store of this run")
            theirs = store.get(nc.KEYS.layout).decode()
            if theirs != layout:
                nn, npr, rid = theirs.split(" ", 2)
                return _join_failed(
            self,
                    f"node 0 runs --nnodes {nn} --nproc {npr} --run-id {rid}, this node --nnodes {cfg.nnodes} "
                    f"--nproc {cfg.nproc} --run-id {cfg.run_id}; every node needs the same three")
        # This node's keys exist before it claims its rank, so the others'
        # multi_get never waits on a key that is not there yet.
        store.set(nc.KEYS.beat(self.me), "0")
        store.set(nc.KEYS.final(self.me), "")
        store.set(nc.KEYS.table(self.me), "[]")
        store.compare_set(nc.KEYS.fail(0), "", "")
        if self.node_store is not None:
            store.set(nc.KEYS.standby(self.me), f"{self.node_store.host}:{self.node_store.port}")
        if store.add(nc.KEYS.claim(self.me), 1) > 1:
            holder = store.get(nc.KEYS.who(self.me)).decode() if store.check([nc.KEYS.who(self.me)]) else "another ftrun"
            return _join_failed(
            self,
                f"node rank {self.me} is already taken by {holder}; give each node its own --node-rank "
                f"(0..{cfg.nnodes - 1})")
        store.set(nc.KEYS.who(self.me), f"{socket.gethostname()} pid {os.getpid()}")
        claims = [nc.KEYS.claim(k) for k in range(self.nnodes)]
        since = time.time()
        while True:
            if store.check(claims):
                break
            if self.waits is not None and self.waits.enabled:  # a person waits at a terminal
                joined = sum(1 for c in claims if store.check([c]))
                self.waits.sync({"nodes": (f"waiting for the nodes of run {cfg.run_id} to join", since, joined,
                                           self.nnodes)}, time.time())
            if time.monotonic() > deadline:
                missing = [str(k) for k in range(self.nnodes) if not store.check([nc.KEYS.claim(k)])]
                hint = (" (under Slurm: start ftrun with srun, one task per node)"
                        if os.environ.get("SLURM_JOB_ID") else "")
                return _join_failed(
            self,
                    f"node{'s' if len(missing) > 1 else ''} {', '.join(missing)} of {self.nnodes} did not join "
                    f"within --join-timeout {cfg.join_timeout:g} s; start ftrun there with the same --nnodes, "
                    f"--master-addr {self.host} and --master-port {self.port}{hint}")
            code = self._wait_signal(POLL_S)
            if code is not None:
                return NodesJoined(code)
        for k in self.others:
            if store.check([nc.KEYS.who(k)]):
                who[k] = store.get(nc.KEYS.who(k)).decode()
            if (cfg.ft or self.node_store is not None) and store.check([nc.KEYS.standby(k)]):  # node 0 routes votes there
                standby[k] = store.get(nc.KEYS.standby(k)).decode()
        if self.node_store is not None:
            standby[self.me] = f"{self.node_store.host}:{self.node_store.port}"
    except Exception as e:  # node 0 went away while we joined
        return _join_failed(self, f"lost node 0's store at {where} while joining: {one_line(e)}")
    self._note(f"node {self.me} of {self.nnodes}: all nodes joined run {cfg.run_id} at {where} "
               f"in {time.monotonic() - t0:.1f} s; ranks {self.me * cfg.nproc}..{(self.me + 1) * cfg.nproc - 1} "
               f"of {cfg.world_size} start here", style="bold blue")
    return NodesJoined(who=who, standby=standby)


def _join_late(self: Any, t0: float, where: str) -> NodesJoined:
    """A node node 0 took into a running --ft round (ftrun.supervisor.nodes.rendezvous): the
    others are already training, so there is no barrier; its replicas join the quorum and heal."""
    cfg = self.cfg
    hold = os.environ.get(INJECT_JOIN_HOLD_ENV)
    if hold:
        deadline = time.monotonic() + 60
        while not os.path.exists(hold) and time.monotonic() < deadline:
            code = self._wait_signal(POLL_S)
            if code is not None:
                return NodesJoined(code)
    who: Dict[int, str] = {}
    standby: Dict[int, str] = {}
    host_node, gen = 0, 0
    try:  # its beat, final, table, standby and who keys were written when it asked in
        self.store.add(nc.KEYS.claim(self.me), 1)
        if self.store.check([RDZV_HOST]):  # a store that moved: its host, and how often it moved
            host, moves = self.store.get(RDZV_HOST).decode().split()
            host_node, gen = int(host), int(moves)
        for k in self.others:
            name, addr = learn_who(self.store, self.cfg, k)
            who.update({k: name} if name else {})
            standby.update({k: addr} if addr else {})
        if self.node_store is not None:
            standby[self.me] = f"{self.node_store.host}:{self.node_store.port}"
    except Exception as e:
        return _join_failed(self, f"lost node 0's store at {where} while joining: {one_line(e)}")
    self._note(f"node {self.me}: joined the running run {cfg.run_id} at {where} in {time.monotonic() - t0:.1f} s "
               f"beside node{'s' if len(self.others) > 1 else ''} {', '.join(map(str, self.others))}; ranks "
               f"{self.me * cfg.nproc}..{(self.me + 1) * cfg.nproc - 1} start here and heal from a peer",
               style="bold blue")
    return NodesJoined(who=who, standby=standby, host_node=host_node, gen=gen)


def _join_failed(self: Any, text: str) -> NodesJoined:
    # One line, as for any bad input: nothing was started.
    self.console.note(f"error: {text}", style="bold red")
    return NodesJoined(JOIN_FAILED, text)


def learn_who(store: Any, cfg: Any, k: int) -> Tuple[Optional[str], Optional[str]]:
    """Node k's name, and its store (where its workers vote, and where the run's store may move)."""
    name = addr = None
    try:
        if store.check([nc.KEYS.who(k)]):
            name = store.get(nc.KEYS.who(k)).decode()
        if cfg.ft and store.check([nc.KEYS.standby(k)]):
            addr = store.get(nc.KEYS.standby(k)).decode()
    except Exception:
        pass  # the watch reports a lost store
    return name, addr
