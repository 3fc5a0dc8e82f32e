"""The node watch: this node's heartbeat, and the other nodes' beats, final words, tables and
first failures, read on a thread of its own.

A beat counter that stops moving for NODE_TIMEOUT_S (by the reader's own clock, so clocks need
not agree) makes that node LOST; a final word makes it ENDED; a store that cannot be reached is
LOST with node 0. The watch only records what it saw and wakes the loop
(the coordinator's check() turns a copy of it into a NodeEvent).
The thread shares nothing with the coordinator but messages: it works from the WatchPlan it
was last sent (follow(), admit(), publish()), and the coordinator reads a WatchView, a copy
taken under the watch's lock (view()).
Must never decide or act on what it sees (no stop, no restart, no console line).
"""

from __future__ import annotations

import datetime
import json
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Tuple

from ftrun.supervisor.nodes import node_common as nc
from ftrun.supervisor.nodes.node_common import BEAT_S, NODE_TIMEOUT_S, NodeState, StoreState, node_list
from ftrun.wire import one_line
from ftrun.supervisor.store import BoundedStore


@dataclass(frozen=True)
class WatchPlan:
    """What the watch works from, as the coordinator last sent it."""

    me: int
    host: str
    port: int
    others: Tuple[int, ...]   # the nodes to watch
    attempt: int              # whose first failure to read (fail/N)
    arrivals_key: str = ""    # node 0 of an elastic --ft run: the round's arrivals counter


@dataclass(frozen=True)
class WatchView:
    """A copy of what the watch saw, taken at one moment."""

    store_state: StoreState = StoreState.UP
    store_error: str = ""
    states: Dict[int, NodeState] = field(default_factory=dict)
    finals: Dict[int, str] = field(default_factory=dict)
    silent_s: Dict[int, float] = field(default_factory=dict)
    tables: Dict[int, List[Dict[str, Any]]] = field(default_factory=dict)
    fail: Dict[int, str] = field(default_factory=dict)   # attempt -> first failure (JSON), once set
    joined: Tuple[int, ...] = ()   # late nodes seen in the live list since the last view that took them
    arrived: int = 0               # node 0: arrivals at the round (node ranks 1..arrived-1 asked in)
    beaten: FrozenSet[int] = frozenset()   # nodes seen to beat at least once


class NodeWatch(threading.Thread):
    """Heartbeats for this node, and the other nodes' beats, final words, tables and failures.

    Runs on its own store connection so a main loop busy stopping workers
    (up to the shutdown grace) never misses a beat. `wake` posts to the loop's queue."""

    def __init__(self, plan: WatchPlan, wake: Callable[[], None]) -> None:
        super().__init__(name="ftrun-nodes", daemon=True)
        self._plan = plan
        self._wake = wake
        self._lock = threading.Lock()
        self.stop = threading.Event()
        self._store_state = StoreState.UP
        self._store_error = ""
        self._states: Dict[int, NodeState] = {k: NodeState.RUNNING for k in plan.others}
        self._finals: Dict[int, str] = {}
        self._tables: Dict[int, List[Dict[str, Any]]] = {}
        self._fail: Dict[int, str] = {}
        self._silent_s: Dict[int, float] = {}
        self._local_table: Optional[str] = None
        self._published: Optional[str] = None
        self._joined: List[int] = []
        self._arrived = 0
        self._beaten: set = set()

    # ------------------------------------------------------------ messages (any thread)
    def follow(self, plan: WatchPlan) -> None:
        """The coordinator's new plan (a new attempt, the arrivals of a moved store); nodes this
        watch found in the live list meanwhile stay watched."""
        with self._lock:
            extra = tuple(k for k in self._plan.others if k not in plan.others)
            self._plan = replace(plan, others=plan.others + extra)

    def admit(self, k: int) -> None:
        """Node 0 took late node k in: watch it, running from now (before the others learn of it)."""
        with self._lock:
            self._states[k] = NodeState.RUNNING
            if k not in self._plan.others:
                self._plan = replace(self._plan, others=self._plan.others + (k,))

    def publish(self, table: str) -> None:
        """This node's replica table, written at the next beat when it changed."""
        with self._lock:
            self._local_table = table

    def view(self, take_joined: bool = False) -> WatchView:
        """What the watch saw; `take_joined`: the late nodes found are handed over (once)."""
        with self._lock:
            joined = tuple(self._joined)
            if take_joined:
                self._joined.clear()
            return WatchView(self._store_state, self._store_error, dict(self._states), dict(self._finals),
                             dict(self._silent_s), dict(self._tables), dict(self._fail), joined, self._arrived,
                             frozenset(self._beaten))

    # ------------------------------------------------------------ the thread
    def run(self) -> None:
        plan = self._plan
        try:
            import torch.distributed as dist

            # Bounded: a machine that vanished without a reset would hold an add for ever.
            store = BoundedStore(dist.TCPStore(plan.host, plan.port, None, False,
                                               datetime.timedelta(seconds=NODE_TIMEOUT_S)), NODE_TIMEOUT_S)
        except Exception as e:  # node 0 went away between the join and now
            self._lose_store(e)
            return
        last_value: Dict[int, bytes] = {}
        last_change: Dict[int, float] = {k: time.monotonic() for k in plan.others}
        while not self.stop.is_set():
            with self._lock:
                plan, table = self._plan, self._local_table
            others = list(plan.others)
            try:
                store.add(nc.KEYS.beat(plan.me), 1)
                if table is not None and table != self._published:
                    store.set(nc.KEYS.table(plan.me), table)
                    self._published = table
                attempt = plan.attempt
                keys = ([nc.KEYS.beat(k) for k in others] + [nc.KEYS.final(k) for k in others]
                        + [nc.KEYS.table(k) for k in others] + [nc.KEYS.fail(attempt), nc.KEYS.live])
                values = store.multi_get(keys)
                # node 0 alone: how many nodes asked to join the round (--ft takes late nodes in)
                arrived = 1 + int(store.add(plan.arrivals_key, 0)) if plan.arrivals_key else 0
            except Exception as e:
                if not self.stop.is_set():
                    self._lose_store(e)
                return
            now = time.monotonic()
            n = len(others)
            changed = False
            with self._lock:
                for i, k in enumerate(others):
                    beat, final, table_raw = values[i], values[n + i], values[2 * n + i]
                    last_change.setdefault(k, now)  # admitted since the last beat
                    if beat != last_value.get(k):
                        last_value[k] = beat
                        last_change[k] = now
                        if beat and beat != b"0":  # its first beat: a late node has finished joining
                            self._beaten.add(k)
                    self._silent_s[k] = now - last_change[k]
                    try:
                        self._tables[k] = json.loads(table_raw or b"[]")
                    except ValueError:
                        pass
                    old = self._states.setdefault(k, NodeState.RUNNING)
                    if final:
                        self._finals[k] = final.decode(errors="replace")
                        new = NodeState.ENDED
                    elif old is NodeState.LOST or now - last_change[k] > NODE_TIMEOUT_S:
                        new = NodeState.LOST
                    else:
                        new = NodeState.RUNNING
                    if new is not old:
                        self._states[k] = new
                        changed = True
                fail = values[-2]
                if fail and attempt not in self._fail:
                    self._fail[attempt] = fail.decode(errors="replace")
                    changed = True
                for k in node_list(values[-1]):
                    if k != plan.me and k not in self._states:  # node 0 took a late node in
                        self._states[k] = NodeState.RUNNING
                        last_change[k] = now
                        self._plan = replace(self._plan, others=self._plan.others + (k,))
                        self._joined.append(k)
                        changed = True
                if arrived > self._arrived:
                    self._arrived = arrived
                    changed = True
            if changed:
                self._wake()
            self.stop.wait(BEAT_S)

    def _lose_store(self, e: BaseException) -> None:
        with self._lock:
            self._store_state = StoreState.LOST
            self._store_error = one_line(e)
        self._wake()
