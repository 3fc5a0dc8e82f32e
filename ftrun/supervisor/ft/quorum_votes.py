"""The quorum keeper's votes as cast in the store: in the run's store, or on several nodes
through the member's node store while that node relays and answers (ftrun.supervisor.relay),
forwarding a node's count it completes as the node's last voter would; a round's decision
written where a vote closes it, or where its closer died. Which votes are due, and what a count
means, is the keeper core's (ftrun.supervisor.ft.keeper.dead); this component only carries them
out, and owns what it must remember of them (its own votes through node stores, and since when
a node's count waits to be forwarded). Must never import torch, and never touch processes.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from ftrun import keys, votes
from ftrun.supervisor.ft.keeper import dead
from ftrun.supervisor.ft.keeper.core import KeeperSnapshot
from ftrun.supervisor.ft.keeper.dead import KeeperRules
from ftrun.supervisor.relay import Routes


class VoteCaster:
    """Casts the keeper's votes and writes the decisions they close."""

    def __init__(self, run_store, rules: KeeperRules) -> None:
        self._run_store = run_store  # RunStore; its .store is the TCPStore once ready
        self._rules = rules
        self.node_added: Dict[Tuple[int, int, int], List[int]] = {}  # (node, quorum, round) -> the keeper's votes there
        self.orphan_seen: Dict[Tuple[int, int, int], float] = {}  # since when a node's full count is not forwarded

    @property
    def _s(self):
        return self._run_store.store

    def forget_below(self, rnd: int) -> None:
        for where in [w for w in self.node_added if w[2] < rnd]:
            del self.node_added[where]

    def cast(self, s: KeeperSnapshot, e: int, rnd: int, vote: int, member: int, routes: Optional[Routes]) -> bool:
        """Add `vote` in `member`'s place to round `rnd` of quorum `e`; decide the round if it
        closes it. Through the member's node while that node relays and answers; only a node
        the supervisor declared lost has its members' votes go to the run's store. A node store
        that does not answer now is tried again at the next poll (False: not cast), since the
        node's own count could never complete without this vote."""
        node = routes.node_of(member) if routes is not None else None
        if node is None or node in routes.lost:
            self._run_vote(s, e, rnd, vote)
            return True
        local = self._client(routes, node)
        if local is None:
            return False
        try:
            total = local.add(keys.node_count_key(node, e, rnd), vote)
        except Exception:
            routes.drop(node)  # a new connection next time
            return False
        self.node_added.setdefault((node, e, rnd), []).append(vote)
        if dead.closed_round(self._rules, total, vote, dead.node_size(s.quorums[e], routes.ranks(node))) is not None:
            self._forward(s, node, local, e, rnd, total)
        return True

    def close_orphaned(self, s: KeeperSnapshot, e: int, rnd: int) -> None:
        """A round every member voted in but nobody decided (its closer died between its vote and
        its decision): decided by its votes (compare_set: a decision already written stands)."""
        commit = dead.orphan_commit(self._s.add(keys.count_key(e, rnd), 0), len(s.quorums[e]))
        if commit is not None and not self._s.check([keys.decision_key(e, rnd)]):
            self._decide(s, e, rnd, commit)

    def close_orphaned_node(self, s: KeeperSnapshot, member: int, e: int, rnd: int, now: float,
                            routes: Optional[Routes]) -> Optional[str]:
        """Forward a dead member's node count that was never marked forwarded, when the core says
        so (dead.node_forward); the line for the run's history when it was."""
        node = routes.node_of(member) if routes is not None else None
        local = self._client(routes, node)
        if local is None:
            return None
        where = (node, e, rnd)
        try:
            total = local.add(keys.node_count_key(node, e, rnd), 0)
            size = dead.node_size(s.quorums[e], routes.ranks(node))
            forwarded = dead.node_counted(total, size) and local.check([keys.node_forwarded_key(node, e, rnd)])
            step = dead.node_forward(total, size, forwarded, self.orphan_seen.get(where), now,
                                     self.node_added.get(where, []))
            if step.action == "clear":
                self.orphan_seen.pop(where, None)
                return None
            if step.action == "wait":
                self.orphan_seen.setdefault(where, now)
                return None
            self.orphan_seen.pop(where, None)
            self._forward(s, node, local, e, rnd, step.total)
            return (f"round {rnd}: rank {member} died before it forwarded node {node}'s votes; "
                    f"forwarded them in its place")
        except Exception:  # tried again at the next poll
            routes.drop(node)
            return None

    def _client(self, routes: Optional[Routes], node: Optional[int]):
        if node is None:
            return None
        try:
            return routes.client(node)
        except Exception:
            routes.drop(node)
            return None

    def _run_vote(self, s: KeeperSnapshot, e: int, rnd: int, total: int) -> None:
        after = self._s.add(keys.count_key(e, rnd), total)
        commit = dead.closed_round(self._rules, after, total, len(s.quorums[e]))
        if commit is not None:  # this closed the round: nobody else decides it
            self._decide(s, e, rnd, commit)

    def _forward(self, s: KeeperSnapshot, node: int, local, e: int, rnd: int, total: int) -> None:
        """A node's completed count, to the run's store in place of its last voter; the decision
        reaches the node's members through its relay (ftrun.supervisor.relay.NodeRelay)."""
        self._run_vote(s, e, rnd, total)
        local.set(keys.node_forwarded_key(node, e, rnd), "1")

    def _decide(self, s: KeeperSnapshot, e: int, rnd: int, commit: bool) -> None:
        kept = 0 if commit else votes.read_kept(self._s, e, rnd)
        self._s.compare_set(keys.decision_key(e, rnd), "", votes.decision_text(commit, s.quorum_id, kept))
        if rnd > s.top:
            self._s.set(keys.TOP, str(rnd))
