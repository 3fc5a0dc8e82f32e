"""Node relays of the --ft vote, as the supervisors see them (protocol.node_count_key).

On several static nodes a node's workers vote in their node's own store, and
the node's last voter forwards the node's count to the run's store: the run's
store does O(1) work per node and round, not per replica. Two pieces live here:

- `Routes` tells the quorum keeper where a vote in a member's place goes: its
  node's store while that node relays, the run's store once the supervisor
  declared the node lost (its store went with it).
- `NodeRelay` keeps one node's store in order, on that node: it copies a
  decision its forwarder could not deliver (the forwarder died after
  forwarding), ends the members' wait for a decision after the run's store
  moved, and deletes the keys of old rounds.

Must never import torch at module level (the supervisor's torch-free path
imports it), and never decide a round: decisions are the members' and the
keeper's.
"""

from __future__ import annotations

import datetime
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from ftrun import protocol as keys
from ftrun.supervisor.store import BoundedStore, wait_reachable

UPKEEP_EVERY_S = 0.25
ROUND_KEYS_KEPT = 4      # as the keeper keeps the run's store: rounds this far behind the newest decided one
OLD_EPOCH_KEPT_S = 10.0  # decided rounds of an epoch behind the newest seen here go after this long
NODE_OP_TIMEOUT_S = 3.0  # the keeper's calls on another node's store: a node that does not answer is lost


class Routes:
    """Which nodes relay, the global ranks each runs, and the keeper's clients of their stores."""

    def __init__(self, nodes: Dict[int, Tuple[str, List[int]]]) -> None:
        self._addr = {k: addr for k, (addr, _) in nodes.items()}
        self._node_of = {r: k for k, (_, ranks) in nodes.items() for r in ranks}
        self._clients: Dict[int, Any] = {}
        self.lost: Set[int] = set()

    def node_of(self, rank: int) -> Optional[int]:
        """The node whose store `rank` votes in, or None: it votes in the run's store itself."""
        return self._node_of.get(rank)

    def ranks(self, node: int) -> Set[int]:
        return {r for r, k in self._node_of.items() if k == node}

    def client(self, node: int) -> Optional[Any]:
        """A client of the node's store, or None once the node is lost (its store went with it)."""
        if node in self.lost:
            return None
        client = self._clients.get(node)
        if client is None:
            host, _, port = self._addr[node].rpartition(":")
            if wait_reachable(host, int(port), 1.0) is not None:
                return None
            import torch.distributed as dist

            raw = dist.TCPStore(host, int(port), None, False, datetime.timedelta(seconds=NODE_OP_TIMEOUT_S))
            client = self._clients[node] = BoundedStore(raw, NODE_OP_TIMEOUT_S)
        return client

    def add(self, node: int, addr: str, ranks: List[int]) -> None:
        """A node taken into the running run (elastic c10d): its workers vote in its store at `addr`."""
        self._addr[node] = addr
        self._node_of.update({r: node for r in ranks})

    def lose(self, node: int) -> None:
        """The node is lost (the supervisor's node watch said so), its store with it: votes for
        its members go to the run's store from now on."""
        self.lost.add(node)
        self._clients.pop(node, None)

    def drop(self, node: int) -> None:
        """A call on the node's store failed: the next one connects afresh."""
        self._clients.pop(node, None)


def _parse(key: str, node: int) -> Optional[Tuple[str, int, int]]:
    """("ln" | "ld" | "lf", epoch, round) of one of this node's relay keys, else None."""
    if not key.startswith(keys.PREFIX):
        return None
    parts = key[len(keys.PREFIX):].split("/")
    if len(parts) != 4 or parts[0] not in ("ln", "ld", "lf") or parts[1] != str(node):
        return None
    try:
        return parts[0], int(parts[2]), int(parts[3])
    except ValueError:
        return None


class NodeRelay:
    """One node's relay keys, kept by that node's supervisor a few times a second."""

    def __init__(self, node: int, local: Callable[[], Any], run: Callable[[], Any]) -> None:
        self.node = node
        self._local = local  # the node's store client (the run's store itself on the node hosting it)
        self._run = run
        self._last = 0.0
        self._pending: Set[Tuple[int, int]] = set()
        self._decided_at: Dict[Tuple[int, int], float] = {}
        self.lost_up_to: Optional[int] = None  # epochs decided on a store that is gone

    def moved(self, up_to_epoch: int) -> None:
        """The run's store moved: a round of an epoch up to this one that has no decision here
        will never get one (its forwarder lost the old store); its members follow the store."""
        self.lost_up_to = up_to_epoch
        self._last = 0.0

    def poll(self, now: float) -> None:
        if now - self._last < UPKEEP_EVERY_S:
            return
        self._last = now
        local = self._local()
        seen: Dict[Tuple[int, int], Set[str]] = {}
        for key in local.list_keys():
            parsed = _parse(key, self.node)
            if parsed is not None:
                seen.setdefault(parsed[1:], set()).add(parsed[0])
        pending = {er for er, kinds in seen.items() if "ln" in kinds and "ld" not in kinds}
        for e, rnd in sorted(pending & self._pending):  # undecided here for one upkeep at least
            self._deliver(local, e, rnd)
        self._pending = pending
        self._collect(local, seen, now)

    def _deliver(self, local: Any, e: int, rnd: int) -> None:
        if self.lost_up_to is not None and e <= self.lost_up_to:
            local.compare_set(keys.node_decision_key(self.node, e, rnd), "", keys.NODE_LOST_DECISION)
            return
        try:
            run = self._run()
            if not run.check([keys.decision_key(e, rnd)]):
                return
            decision = run.get(keys.decision_key(e, rnd))
        except Exception:  # the run's store is going away: the move ends these waits
            return
        local.compare_set(keys.node_decision_key(self.node, e, rnd), "", decision)

    def _collect(self, local: Any, seen: Dict[Tuple[int, int], Set[str]], now: float) -> None:
        """Delete decided rounds every member is past: those well behind their epoch's newest decided
        round (as the keeper does in the run's store), and those of an older epoch once they have been
        decided for a while (a member that voted there has read its decision long since)."""
        newest: Dict[int, int] = {}
        for (e, rnd), kinds in seen.items():
            if "ld" in kinds:
                newest[e] = max(newest.get(e, -1), rnd)
                self._decided_at.setdefault((e, rnd), now)
        if not newest:
            return
        top_epoch = max(e for e, _ in seen)
        for (e, rnd), kinds in seen.items():
            if "ld" not in kinds:
                continue
            old_epoch = e < top_epoch and now - self._decided_at[(e, rnd)] > OLD_EPOCH_KEPT_S
            if old_epoch or (e == top_epoch and rnd < newest[e] - ROUND_KEYS_KEPT):
                for kind in kinds:
                    local.delete_key(f"{keys.PREFIX}{kind}/{self.node}/{e}/{rnd}")
                self._decided_at.pop((e, rnd), None)
