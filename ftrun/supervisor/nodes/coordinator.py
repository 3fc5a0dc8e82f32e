"""Several machines, one run: the node coordinator, an event source for the supervisor's loop.

One ftrun per node; node 0's supervisor hosts the run's TCPStore and every
supervisor (node 0 included) talks to it as a client. Everything the nodes
agree on is a key under ``ftrun/nodes/`` (keys.NodeKeys). The parts:

- join (node_join): every rank claimed before any worker starts; late nodes;
- liveness (node_watch): beats, final words, tables and first failures, read
  on a thread; ``final/K`` holds a node's exit status once it ends, so an
  ended node is never mistaken for a lost one. The thread is sent a WatchPlan
  and read through a WatchView copy: it never holds the coordinator;
- group restarts without --ft (node_restart): first_failure(), attempt_barrier();
- the store moves under --ft (node_moves): standby stores, fail_over();
- here: check(), which turns what the watch saw into one NodeEvent per call;
  the late nodes' admission on node 0 (--ft on an elastic c10d run: ``live``
  is the run's node list; a late node is reported "node_waiting", and
  admit() carries out the loop's decision to take it in; every other node
  reports a node new in ``live`` as "node_joined"); the replica tables of
  every node for `ftrun status`; leaving (node 0 keeps the store up until the
  others have ended).

The node_*.py modules are functions that read the coordinator and return what they found;
the coordinator alone writes its fields (none of them import this module).
Majorities count the run's nodes (layout_size): a static layout's, or on an
elastic run every node taken in on this store but those that ended and said
so, and late nodes never seen to beat.
The loop decides and acts (ftrun.supervisor.loop.run). Must never start, stop or
signal a worker, never decide a restart, never hold the Supervisor, and never
import torch at module level (the store it uses is built off the CLI path).
"""

from __future__ import annotations

import json
import signal
import time
from dataclasses import asdict
from typing import Any, Callable, Dict, List, Optional, Set

from ftrun.exits import EXIT_SIGNAL_BASE
from ftrun.keys import rdzv_admit, rdzv_arrivals
from ftrun.status.state import ReplicaStatus
from ftrun.supervisor.nodes import failover, node_join, node_moves, node_restart
from ftrun.supervisor.nodes import node_common as nc
from ftrun.supervisor.workers.logs import ConsoleOut
# The names other modules use from here (ftrun.supervisor.nodes.rendezvous, run).
from ftrun.supervisor.nodes.node_common import (BEAT_S, JOIN_FAILED, NODE_LOST, NODE_TIMEOUT_S, POLL_S,  # noqa: F401
                                          REQUEUE, NodeEvent, NodeState, StoreState, route_ip, use_round)
from ftrun.wire import one_line  # noqa: F401 - the name rendezvous.py and run.py use from here
from ftrun.supervisor.nodes.node_restart import NextAttempt
from ftrun.supervisor.nodes.node_watch import NodeWatch, WatchPlan, WatchView
from ftrun.supervisor.store import RunStore, bind_listener
from ftrun.supervisor.workers.worker import Failure
from ftrun.wire import FirstFailure, ProgressReport


class NodeCoordinator:
    """This node's side of a multi-node run: an event source and the agreements between nodes.

    `wake` posts an event to the supervisor's queue (its loop then calls check());
    `signalled` says whether a signal asked the run to stop (waits here end at once)."""

    def __init__(self, cfg: Any, run_store: RunStore, console: ConsoleOut, wake: Callable[[], None],
                 signalled: Callable[[float], Optional[int]], standby: Optional[RunStore] = None,
                 waits: Any = None) -> None:
        self.run_store = run_store
        self.console = console
        self._wake = wake
        self._signalled = signalled
        self.summary = ""  # the one line a failed join ended with
        self.cfg = cfg
        self.me = cfg.node_rank
        self.nnodes = cfg.nnodes
        self.host = cfg.master_addr
        self.port = cfg.master_port
        self.attempt = 0
        self._handled_attempt = -1
        self._reported: Dict[int, NodeState] = {}
        self.watch: Optional[NodeWatch] = None
        self.who: Dict[int, str] = {}
        # --ft on an elastic c10d run: nodes may join the running round. `live` is the run's
        # node list as node 0 keeps it; node 0 watches the round's arrivals for late nodes.
        self.late = cfg.nodes_live is not None
        self.live: List[int] = list(cfg.nodes_live) if self.late else list(range(cfg.nnodes))
        self.others = [k for k in self.live if k != cfg.node_rank]
        self.arrivals_key = rdzv_arrivals(cfg.round) if cfg.admits_late and self.me == 0 else ""
        self._next_arrival = cfg.nnodes
        self.waiting: List[int] = []  # node 0: late nodes waiting for a place (the run has max nodes)
        self._joined: List[int] = []  # late nodes the watch found in the live list, not yet reported
        self.waits: Any = waits  # ftrun.supervisor.accounting.waits.Waits: progress while the nodes join, on a terminal
        # --ft on three nodes or more: the store moves when its node is lost
        # (ftrun.supervisor.nodes.failover). Every node but node 0 hosts a standby store from the start.
        self.host_node = 0
        self.gen = 0
        # The run's nodes on this store, the lost included: majorities count them all. A static
        # layout has its nnodes; an elastic one also counts every node taken in since (_seen).
        self._seen = set(self.live)
        # Late nodes taken in (elastic) and the nodes seen to beat: a late node counts in majorities
        # once it has beaten, i.e. finished its join (see layout_size).
        self._late: Set[int] = set()
        self._beaten: Set[int] = set()
        self.elastic = cfg.rdzv == "c10d"
        self.can_move = bool(cfg.ft and (self.elastic or cfg.nnodes >= 3))
        self.standby: Dict[int, str] = {}
        # c10d: the rendezvous keeps this node's standby store for the whole run (ftrun.supervisor.
        # rendezvous); without --ft it moves the store between two rounds, this round publishes it.
        self.node_store: Optional[RunStore] = standby
        # --ft: every node but node 0 (which hosts the run's store) has a store of its own, through
        # which its workers vote (ftrun.supervisor.relay); on three nodes or more it is also the
        # node's standby store. A static layout's is made here, an elastic one's by the rendezvous.
        if cfg.ft and standby is None and cfg.rdzv == "static" and cfg.nnodes >= 2 and self.me != 0:
            ip = route_ip(self.host)
            listener = bind_listener(ip, 0)
            self.node_store = RunStore(ip, listener.getsockname()[1], listener)

    # ------------------------------------------------------------ helpers
    @property
    def layout_size(self) -> int:
        """The run's nodes a majority is counted from: the lost ones too (a node cut off may still
        run), but on an elastic run not the nodes that ended and said so (they never act again),
        nor late nodes never seen to beat. Such a node lost the store before it finished joining
        and stops; it can take part in no move, and counting it could leave the nodes that remain
        short of a majority they hold. Sides that differ by a node in this way can never both hold
        a majority: floor((n-1)/2) + 1 + floor(n/2) + 1 nodes are more than the n - 1 beside the
        lost host."""
        if not (self.elastic and self.cfg.ft):  # without --ft every node ends a round that re-forms
            return self.nnodes
        ended = {k for k, _ in self._ended_nodes()}  # (reads the watch: the nodes seen to beat too)
        return len(self._seen - ended - (self._late - self._beaten))

    def wake(self) -> None:
        self._wake()

    @property
    def store(self) -> Any:
        return self.run_store.store

    def _note(self, text: str, style: str = "bold yellow") -> None:
        self.console.note(text, style=style)

    def _wait_signal(self, timeout: float) -> Optional[int]:
        """Wait up to `timeout` (a poll interval of a store wait); a signal that asks the run
        to stop ends it at once with that signal's exit status."""
        signum = self._signalled(timeout)
        if signum is not None:
            self._note(f"received {signal.Signals(signum).name}: stopping", style="bold yellow")
            return EXIT_SIGNAL_BASE + signum
        return None

    def _view(self, take_joined: bool = False) -> WatchView:
        """What the watch saw; the nodes seen to beat are kept across watches (a store move starts a new one)."""
        view = self.watch.view(take_joined) if self.watch is not None else WatchView()
        self._beaten |= view.beaten
        return view

    def _plan(self) -> WatchPlan:
        return WatchPlan(self.me, self.host, self.port, tuple(self.others), self.attempt, self.arrivals_key)

    def _start_watch(self) -> None:
        self.watch = NodeWatch(self._plan(), self.wake)
        self.watch.start()

    # ------------------------------------------------------------ join, restarts, moves (node_*.py)
    def join(self) -> Optional[int]:
        """Block until every node has joined (node_join). None when joined, else ftrun's exit status."""
        joined = node_join.join_nodes(self)
        if joined.code is not None:
            self.summary = joined.summary
            return joined.code
        self.who.update(joined.who)
        self.standby.update(joined.standby)
        if self.late:
            self.host_node, self.gen = joined.host_node, joined.gen
        self._start_watch()
        return None

    def _learn_who(self, k: int) -> None:
        name, addr = node_join.learn_who(self.store, self.cfg, k)
        if name:
            self.who[k] = name
        if addr:
            self.standby[k] = addr

    def first_failure(self, failure: Optional[Failure], remote: Optional[FirstFailure] = None) -> FirstFailure:
        """The first failure of the current attempt, the same on every node (node_restart)."""
        self._handled_attempt = self.attempt
        return node_restart.first_failure(self, failure, remote)

    def attempt_barrier(self, fail_code: int) -> Optional[NodeEvent | int]:
        """Wait until every node stopped the current attempt (node_restart). None when the next
        attempt may start (the coordinator is then in it); else ftrun's exit status or the NodeEvent."""
        out = node_restart.attempt_barrier(self, fail_code)
        if isinstance(out, NextAttempt):
            self.attempt = int(out)
            if self.watch is not None:
                self.watch.follow(self._plan())
            return None
        return out

    def store_reachable(self, probes: int = 5) -> bool:
        return node_restart.store_reachable(self.host, self.port, probes)

    def rank0_report(self, n: int) -> Optional[ProgressReport]:
        return node_restart.rank0_report(self.store, n)

    def move_view(self) -> node_moves.MoveView:
        """What the store's moves are decided from, as this node sees it now (node_moves)."""
        return node_moves.MoveView(
            self.me, self.host_node, self.layout_size, tuple(self.live), tuple(self.others), tuple(self.lost_nodes()),
            self.can_move, self.elastic, bool(self.cfg.ft), self.node_store is not None, dict(self.standby),
            self.gen, self.attempt)

    def may_move(self) -> bool:
        return node_moves.may_move(self.move_view())

    def may_move_between_rounds(self) -> bool:
        return node_moves.may_move_between_rounds(self.move_view())

    def majority_kept(self) -> bool:
        return node_moves.majority_kept(self.move_view())

    def fail_over(self) -> failover.Elected:
        """The run's store is lost: agree with the surviving nodes on the next host (node_moves), and
        follow it. Raises failover.NoMajority when this node may not go on."""
        elected = node_moves.elect_host(self.move_view(), self.node_store, lambda: self._signalled(0) is not None)
        host, _, port = elected.addr.rpartition(":")
        self.gen += 1
        self.host_node = elected.host
        self.host, self.port = host, int(port)
        self.run_store.adopt(elected.store, host, int(port))
        self.live = sorted(elected.nodes)
        self.others = [k for k in self.live if k != self.me]
        if self.elastic:  # the nodes that did not choose the new host stop: they count no more
            self._seen = set(self.live)
        self._start_watch()
        return elected

    def open_to_late_nodes(self, master_addr: str) -> None:
        """The new host of an elastic --ft run takes late nodes in (node_moves)."""
        self._next_arrival, self.arrivals_key = node_moves.open_to_late_nodes(self.move_view(), self.cfg, self.store,
                                                                              self._seen, master_addr)
        if self.watch is not None:
            self.watch.follow(self._plan())

    def _node_name(self, k: int) -> str:
        who = self.who.get(k)
        return f"node {k}" + (f" ({who})" if who else "")

    # ------------------------------------------------------------ watching (every tick)
    def check(self) -> Optional[NodeEvent]:
        """After each tick: what happened to the store, the other nodes, and their failures."""
        if self.watch is None:
            return None
        view = self._view(take_joined=True)
        self._joined.extend(view.joined)
        states, finals, silent, arrived = view.states, view.finals, view.silent_s, view.arrived
        fail = view.fail.get(self.attempt)
        joined = self._joined.pop(0) if self._joined else None
        if view.store_state is StoreState.LOST:
            return self.store_gone(view.store_error)
        # Another node's failure first: a node that gave up on it also ends, and
        # its end must not be reported as the cause.
        if fail and not self.cfg.ft and self._handled_attempt < self.attempt:
            return NodeEvent("remote_failure", failure=FirstFailure.decode(fail))
        if joined is not None:
            self._learn_who(joined)
            if joined not in self.others:
                self.others.append(joined)
            if joined not in self.live:
                self.live.append(joined)
            self._seen.add(joined)
            self._late.add(joined)
            return NodeEvent("node_joined", f"{self._node_name(joined)} joined the running run", node=joined)
        if arrived > self._next_arrival:
            k = self._next_arrival
            try:
                ready = self.store.check([nc.KEYS.who(k)])  # it wrote its keys: the others may read them
            except Exception as e:
                return self.store_gone(one_line(e))
            if ready:
                self._next_arrival += 1
                if self.still_waiting(k):  # not withdrawn (stopped) already
                    self._learn_who(k)
                    return NodeEvent("node_waiting", f"{self._node_name(k)} asks to join the running run", node=k)
        for k, st in states.items():
            if st is NodeState.RUNNING or self._reported.get(k) is st:
                continue
            self._reported[k] = st
            if st is NodeState.ENDED and finals.get(k) == "0":
                continue  # its workers finished; ours are finishing too
            what = (f"went away (no heartbeat for {silent.get(k, NODE_TIMEOUT_S):.1f} s)" if st is NodeState.LOST
                    else f"ended (exit {finals.get(k)})")
            return NodeEvent("node_lost", f"{self._node_name(k)} {what}", node=k)
        return None


    # ------------------------------------------------------------ late nodes (node 0, --ft, elastic c10d)
    def admit(self, k: int) -> None:
        """Take late node k into the running round: the others learn of it from the live list,
        it learns from its admit key. The agent decided there is a place for it."""
        self.watch.admit(k)  # running from now on: the watch reads it from the next beat
        self.others.append(k)
        self.live.append(k)
        self._seen.add(k)
        self._late.add(k)
        self.store.set(nc.KEYS.live, json.dumps(self.live))
        self.store.set(rdzv_admit(self.cfg.round, k), "1")

    def ask_place(self, k: int) -> None:
        """Late node k waits for a place (node 0: the loop decides when it is taken in)."""
        self.waiting.append(k)

    def next_waiting(self) -> int:
        """The late node that waited longest, no longer counted as waiting."""
        return self.waiting.pop(0)

    def still_waiting(self, k: int) -> bool:
        """Whether late node k still waits for a place (it withdraws when stopped or when the round ends)."""
        try:
            return not self.store.get(nc.KEYS.final(k))
        except Exception:
            return False

    def drop(self, k: int) -> None:
        """A lost node leaves the live list (a late node admitted next is not told to wait for it)."""
        if k in self.live:
            self.live.remove(k)
            try:
                self.store.set(nc.KEYS.live, json.dumps(self.live))
            except Exception:
                pass  # the watch reports a lost store

    def store_gone(self, why: str) -> NodeEvent:
        if self.watch is not None:
            self.watch.stop.set()
        return NodeEvent("store_gone", f"node {self.host_node} (the run's store at {self.host}:{self.port}) "
                                       f"went away ({why})", node=self.host_node)


    def lost_nodes(self, ended: bool = True) -> List[int]:
        """Nodes gone silent, and (`ended`) those that ended with a failure."""
        if self.watch is None:
            return []
        view = self._view()
        return [k for k, st in view.states.items() if st is NodeState.LOST
                or ended and st is NodeState.ENDED and view.finals.get(k) != "0"]

    def _ended_nodes(self) -> List[tuple]:
        view = self._view()
        return [(k, view.finals.get(k)) for k, st in sorted(view.states.items()) if st is NodeState.ENDED]

    def _store_lost(self) -> bool:
        return self.watch is not None and self._view().store_state is StoreState.LOST


    # ------------------------------------------------------------ status
    def all_replicas(self, local: List[ReplicaStatus]) -> List[ReplicaStatus]:
        """This node's replicas (published for the others) followed by every other node's."""
        if self.watch is None:
            return local
        self.watch.publish(json.dumps([asdict(r) for r in local], separators=(",", ":")))
        known = set(ReplicaStatus.__dataclass_fields__)
        out = list(local)
        view = self._view()
        tables, states = view.tables, view.states
        for k in sorted(tables):
            for r in tables[k]:
                rep = ReplicaStatus(**{key: v for key, v in r.items() if key in known})
                if states.get(k) is NodeState.LOST and rep.state not in ("done", "failed", "stopped"):
                    rep.state = "lost"
                out.append(rep)
        out.sort(key=lambda r: r.rank)
        return out

    # ------------------------------------------------------------ leaving
    def leave(self, code: int) -> None:
        """Say how this node ended; node 0 keeps the store up until every other node has said so too."""
        w = self.watch
        if w is None:
            return
        try:
            if not self._store_lost():
                self.store.set(nc.KEYS.final(self.me), str(code))
        except Exception:
            pass
        if self.me == self.host_node:
            self._wait_for_others()
        w.stop.set()

    def _wait_for_others(self) -> None:
        """Node 0 hosts the store: leaving before the others have ended would strand them.

        --rdzv-conf close_timeout=S bounds the wait (torchrun's time for a run to close);
        without it node 0 waits as long as the others keep beating."""
        announced = False
        close = self.cfg.close_timeout if "close_timeout" in self.cfg.rdzv_conf else None
        deadline = time.monotonic() + close if close is not None else None
        while True:
            if deadline is not None and time.monotonic() > deadline:
                self._note(f"other nodes still running after close_timeout={close:g} s; leaving", style="bold red")
                return
            view = self._view()
            pending = [k for k, st in view.states.items() if st is NodeState.RUNNING]
            lost = [k for k, st in view.states.items() if st is NodeState.LOST]
            for k in lost:
                if self._reported.get(k) is not NodeState.LOST:
                    self._reported[k] = NodeState.LOST
                    self._note(f"{self._node_name(k)} went away (no heartbeat for {NODE_TIMEOUT_S:g} s)",
                               style="bold red")
            if not pending or view.store_state is StoreState.LOST:
                return
            if not announced:
                announced = True
                self._note(f"waiting for node{'s' if len(pending) > 1 else ''} {', '.join(map(str, pending))} "
                           f"to end (this node hosts the run's store)", style="dim")
            if self._wait_signal(POLL_S) is not None:
                return
