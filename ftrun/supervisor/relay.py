"""Node relays of --ft, as the supervisors see them: votes (keys.node_count_key) and
status reports (keys.node_info_key).

On several nodes (static or elastic c10d) a node's workers vote in their node's own store, and
the node's last voter forwards the node's count to the run's store; they
write their status reports there too, and the node's ftrun copies them into
one key of the run's store. The run's store does O(1) work per node, not per
replica, for both. Two pieces live here:

- `Routes` tells the quorum keeper which ranks each relaying node runs: where
  their reports are (the node's one key), and where a vote in a member's
  place goes (its node's store while that node relays, the run's store once
  the supervisor declared the node lost: its store went with it).
- `NodeRelay` keeps one node's store in order, on that node: it relays the
  node's reports to the run's store when one changed, copies a decision its
  forwarder could not deliver (the forwarder died after forwarding), ends the
  members' wait for a decision after the run's store moved, and deletes the
  keys of old rounds.

Must never import torch at module level (the supervisor's torch-free path
imports it), and never decide a round: decisions are the members' and the
keeper's.
"""

from __future__ import annotations

import datetime
import json
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from ftrun import keys, votes
from ftrun.supervisor.store import BoundedStore, wait_reachable

UPKEEP_EVERY_S = 0.25
ROUND_KEYS_KEPT = 4      # as the keeper keeps the run's store: rounds this far behind the newest decided one
OLD_QUORUM_KEPT_S = 10.0  # decided rounds of a quorum behind the newest seen here go after this long
NODE_OP_TIMEOUT_S = 3.0  # the keeper's calls on another node's store: a node that does not answer is lost


class Routes:
    """Which nodes relay, the global ranks each runs, and the keeper's clients of their stores."""

    def __init__(self, nodes: Dict[int, Tuple[str, List[int]]]) -> None:
        self._addr = {k: addr for k, (addr, _) in nodes.items()}
        self._node_of = {r: k for k, (_, ranks) in nodes.items() for r in ranks}
        self._ranks = {k: set(ranks) for k, (_, ranks) in nodes.items()}
        self._clients: Dict[int, Any] = {}
        self.lost: Set[int] = set()

    def node_of(self, rank: int) -> Optional[int]:
        """The node whose store `rank` votes in, or None: it votes in the run's store itself."""
        return self._node_of.get(rank)

    def ranks(self, node: int) -> Set[int]:
        return self._ranks.get(node, set())

    @property
    def nodes(self) -> List[int]:
        """The relaying nodes, lost ones too: a lost node's relayed reports are its last words."""
        return sorted(self._ranks)

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
        self._ranks.setdefault(node, set()).update(ranks)

    def lose(self, node: int) -> None:
        """The node is lost (the supervisor's node watch said so), its store with it: votes for
        its members go to the run's store from now on."""
        self.lost.add(node)
        self._clients.pop(node, None)

    def drop(self, node: int) -> None:
        """A call on the node's store failed: the next one connects afresh."""
        self._clients.pop(node, None)


def _parse(key: str, node: int) -> Optional[Tuple[str, int, int]]:
    """("ln" | "ld" | "lf", quorum, round) of one of this node's relay keys, else None."""
    parsed = keys.parse_key(key)
    if parsed is None or parsed[0] not in ("ln", "ld", "lf") or len(parsed[1]) != 3 or parsed[1][0] != node:
        return None
    return parsed[0], parsed[1][1], parsed[1][2]


class NodeRelay:
    """One node's relay keys, kept by that node's supervisor a few times a second."""

    def __init__(self, node: int, ranks: List[int], local: Callable[[], Any], run: Callable[[], Any]) -> None:
        self.node = node
        self.ranks = list(ranks)  # the global ranks the node runs
        self._info_keys = [keys.info_key(r) for r in self.ranks]
        self._info_made = False
        self._relayed: Optional[List[bytes]] = None  # the reports the run's store holds from this relay
        self._local = local  # the node's store client (the run's store itself on the node hosting it)
        self._run = run
        self._last = 0.0
        self._pending: Set[Tuple[int, int]] = set()
        self._decided_at: Dict[Tuple[int, int], float] = {}
        self.lost_up_to: Optional[int] = None  # quorums decided on a store that is gone

    def moved(self, up_to_quorum: int) -> None:
        """The run's store moved: a round of a quorum up to this one that has no decision here
        will never get one (its forwarder lost the old store); its members follow the store."""
        self.lost_up_to = up_to_quorum
        self._last = 0.0
        self._relayed = None  # the new store has none of this node's reports yet

    def poll(self, now: float) -> None:
        if now - self._last < UPKEEP_EVERY_S:
            return
        self._last = now
        local = self._local()
        self._relay_reports(local)
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

    def push_reports(self) -> None:
        """Relay the workers' reports now: their last ones, written as they exited."""
        self._relay_reports(self._local())

    def _relay_reports(self, local: Any) -> None:
        """Copy the node's workers' --ft reports (info keys, each a JSON object the keeper tells
        live from stale by its "beat") into the node's one key of the run's store, as written."""
        if not self._info_made:  # a worker's first report may be far off: multi_get must not wait for it
            for key in self._info_keys:
                local.compare_set(key, "", "{}")
            self._info_made = True
        raw = local.multi_get(self._info_keys)
        if raw == self._relayed:
            return
        reports = {}
        for rank, text in zip(self.ranks, raw):
            try:
                reports[str(rank)] = json.loads(text)
            except ValueError:
                continue
        try:
            self._run().set(keys.node_info_key(self.node), json.dumps(reports, separators=(",", ":")))
        except Exception:  # the run's store is going away: the next poll writes them to the one it moves to
            return
        self._relayed = raw

    def _deliver(self, local: Any, e: int, rnd: int) -> None:
        if self.lost_up_to is not None and e <= self.lost_up_to:
            local.compare_set(keys.node_decision_key(self.node, e, rnd), "", votes.NODE_LOST_DECISION)
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
        """Delete decided rounds every member is past: those well behind their quorum's newest decided
        round (as the keeper does in the run's store), and those of an older quorum once they have been
        decided for a while (a member that voted there has read its decision long since)."""
        newest: Dict[int, int] = {}
        for (e, rnd), kinds in seen.items():
            if "ld" in kinds:
                newest[e] = max(newest.get(e, -1), rnd)
                self._decided_at.setdefault((e, rnd), now)
        if not newest:
            return
        top_quorum = max(e for e, _ in seen)
        for (e, rnd), kinds in seen.items():
            if "ld" not in kinds:
                continue
            old_quorum = e < top_quorum and now - self._decided_at[(e, rnd)] > OLD_QUORUM_KEPT_S
            if old_quorum or (e == top_quorum and rnd < newest[e] - ROUND_KEYS_KEPT):
                for kind in sorted(kinds):  # in one order in every process (the simulator replays it)
                    local.delete_key(f"{keys.PREFIX}{kind}/{self.node}/{e}/{rnd}")
                self._decided_at.pop((e, rnd), None)
