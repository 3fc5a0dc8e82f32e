"""The replicas' status reports as the quorum keeper last read them: each replica's own key, or
on several nodes the one key per relaying node where the node's ftrun copies its replicas'
reports (ftrun.supervisor.relay). A component of quorum.QuorumKeeper that owns what it read;
the figures made of it are the keeper core's (ftrun.supervisor.ft.keeper.core). Must never write
to the store, and never import torch.
"""

from __future__ import annotations

import json
from typing import Dict, List, Optional, Sequence, Tuple

from ftrun import keys
from ftrun.supervisor.relay import Routes
from ftrun.wire import WIRE_VERSION, MemberReport, version_refused


class ReplicaReports:
    """Each replica's newest report (`info`) and when it last changed (`seen`, the keeper's clock).
    A report of another wire version is refused: its replica has none here, and `refusals` holds
    the one line saying so (said once a rank and version)."""

    def __init__(self) -> None:
        self.info: Dict[int, MemberReport] = {}
        # When each replica's info last changed: a replica whose reports stopped says nothing
        # true about what it is doing now.
        self.seen: Dict[int, float] = {}
        self._raw: Dict[int, object] = {}  # the raw text of its own key, or the object its node relayed
        self._relayed: Dict[int, bytes] = {}  # node -> its reports key as last read
        self._refused: Dict[int, int] = {}  # rank -> the other wire version it was refused for
        self.refusals: List[str] = []

    def read(self, store, wanted: List[str], ranks: Sequence[int],
             routes: Optional[Routes]) -> Tuple[List[bytes], List[object]]:
        """Read `wanted` and every replica's status report in one multi_get: (the values of
        `wanted`, the reports in `ranks` order). A report is the raw text of the replica's own
        key, or the object its node relayed; None when its node's key has not changed since the
        last read (nothing new from any of its replicas)."""
        nodes = routes.nodes if routes is not None else []
        direct = [r for r in ranks if routes is None or routes.node_of(r) is None]
        n, d = len(wanted), len(direct)
        vals = store.multi_get(wanted + [keys.info_key(r) for r in direct] + [keys.node_info_key(k) for k in nodes])
        reports: Dict[int, object] = dict(zip(direct, vals[n:n + d]))
        for k, raw in zip(nodes, vals[n + d:]):
            if raw == self._relayed.get(k):
                continue
            self._relayed[k] = raw
            try:
                relayed = json.loads(raw)
            except ValueError:
                continue
            for r in routes.ranks(k):
                reports[r] = relayed.get(str(r))
        return vals[:n], [reports.get(r) for r in ranks]

    def absorb(self, ranks: Sequence[int], reports: List[object], now: float) -> None:
        """Take in the reports (as read gives them) that changed since the last read."""
        for r, info in zip(ranks, reports):
            # "{}": no report yet (a new store, or a worker of a relaying node that has not reported)
            if info is None or info == self._raw.get(r) or info == b"{}" or info == {}:
                continue
            self._raw[r] = info
            self.seen[r] = now
            report = MemberReport.from_object(info) if isinstance(info, dict) else MemberReport.decode(info)
            if report is None:
                continue
            if report.version != WIRE_VERSION:
                self.info.pop(r, None)
                if self._refused.get(r) != report.version:
                    self._refused[r] = report.version
                    self.refusals.append(version_refused(r, report.version))
                continue
            self._refused.pop(r, None)
            self.info[r] = report

    def take_refusals(self) -> List[str]:
        """The refusal lines since the last call."""
        taken, self.refusals = self.refusals, []
        return taken
