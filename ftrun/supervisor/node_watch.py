"""The node watch: this node's heartbeat, and the other nodes' beats, final words, tables and
first failures, read on a thread of its own.

A beat counter that stops moving for NODE_TIMEOUT_S (by the reader's own clock, so clocks need
not agree) makes that node LOST; a final word makes it ENDED; a store that cannot be reached is
LOST with node 0. The watch only records what it saw and wakes the loop
(NodeCoordinator.check() turns it into a NodeEvent).
Must never decide or act on what it sees (no stop, no restart, no console line).
"""

from __future__ import annotations

import datetime
import json
import threading
import time
from typing import TYPE_CHECKING, Any, Dict, List, Optional

from ftrun.supervisor import node_common as nc
from ftrun.supervisor.node_common import BEAT_S, NODE_TIMEOUT_S, NodeState, StoreState, node_list, one_line
from ftrun.supervisor.store import BoundedStore

if TYPE_CHECKING:
    from ftrun.supervisor.nodes import NodeCoordinator


class NodeWatch(threading.Thread):
    """Heartbeats for this node, and the other nodes' beats, final words, tables and failures.

    Runs on its own store connection so a main loop busy stopping workers
    (up to the shutdown grace) never misses a beat."""

    def __init__(self, coord: "NodeCoordinator") -> None:
        super().__init__(name="ftrun-nodes", daemon=True)
        self.coord = coord
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.store_state = StoreState.UP
        self.store_error = ""
        self.states: Dict[int, NodeState] = {k: NodeState.RUNNING for k in coord.others}
        self.finals: Dict[int, str] = {}
        self.tables: Dict[int, List[Dict[str, Any]]] = {}
        self.fail: Dict[int, str] = {}      # attempt -> first failure (JSON), once set
        self.silent_s: Dict[int, float] = {}
        self.local_table: Optional[str] = None
        self._published: Optional[str] = None
        self.joined: List[int] = []   # late nodes seen in the live list, not yet reported
        self.arrived = 0              # node 0: arrivals at the round (node ranks 1..arrived-1 asked in)

    def run(self) -> None:
        c = self.coord
        try:
            import torch.distributed as dist

            # Bounded: a machine that vanished without a reset would hold an add for ever.
            store = BoundedStore(dist.TCPStore(c.host, c.port, None, False, datetime.timedelta(seconds=NODE_TIMEOUT_S)),
                                 NODE_TIMEOUT_S)
        except Exception as e:  # node 0 went away between the join and now
            self._lose_store(e)
            return
        last_value: Dict[int, bytes] = {}
        last_change: Dict[int, float] = {k: time.monotonic() for k in c.others}
        while not self.stop.is_set():
            others = list(c.others)
            try:
                store.add(nc.KEYS.beat(c.me), 1)
                table = self.local_table
                if table is not None and table != self._published:
                    store.set(nc.KEYS.table(c.me), table)
                    self._published = table
                attempt = c.attempt
                keys = ([nc.KEYS.beat(k) for k in others] + [nc.KEYS.final(k) for k in others]
                        + [nc.KEYS.table(k) for k in others] + [nc.KEYS.fail(attempt), nc.KEYS.live])
                values = store.multi_get(keys)
                # node 0 alone: how many nodes asked to join the round (--ft takes late nodes in)
                arrived = 1 + int(store.add(c.arrivals_key, 0)) if c.arrivals_key else 0
            except Exception as e:
                if not self.stop.is_set():
                    self._lose_store(e)
                return
            now = time.monotonic()
            n = len(others)
            changed = False
            with self.lock:
                for i, k in enumerate(others):
                    beat, final, table_raw = values[i], values[n + i], values[2 * n + i]
                    if beat != last_value.get(k):
                        last_value[k] = beat
                        last_change[k] = now
                        if beat and beat != b"0":  # its first beat: a late node has finished joining
                            c.beaten.add(k)
                    self.silent_s[k] = now - last_change[k]
                    try:
                        self.tables[k] = json.loads(table_raw or b"[]")
                    except ValueError:
                        pass
                    old = self.states[k]
                    if final:
                        self.finals[k] = final.decode(errors="replace")
                        new = NodeState.ENDED
                    elif old is NodeState.LOST or now - last_change[k] > NODE_TIMEOUT_S:
                        new = NodeState.LOST
                    else:
                        new = NodeState.RUNNING
                    if new is not old:
                        self.states[k] = new
                        changed = True
                fail = values[-2]
                if fail and attempt not in self.fail:
                    self.fail[attempt] = fail.decode(errors="replace")
                    changed = True
                for k in node_list(values[-1]):
                    if k != c.me and k not in self.states:  # node 0 took a late node in
                        self.states[k] = NodeState.RUNNING
                        last_change[k] = now
                        c.others.append(k)
                        self.joined.append(k)
                        changed = True
                if arrived > self.arrived:
                    self.arrived = arrived
                    changed = True
            if changed:
                c.wake()
            self.stop.wait(BEAT_S)

    def _lose_store(self, e: BaseException) -> None:
        with self.lock:
            self.store_state = StoreState.LOST
            self.store_error = one_line(e)
        self.coord.wake()

