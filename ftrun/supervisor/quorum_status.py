"""The quorum keeper's view of the replicas' reports (mixed into quorum.QuorumKeeper): each
replica's status key (or its node's relayed copy), which member the others wait for, the
figures `ftrun status` shows, and the run's pace. Must never write to the store, and never
import torch.
"""

from __future__ import annotations

import json
from collections import deque
from typing import Deque, Dict, List, Optional, Tuple

from ftrun import protocol as keys
from ftrun.wire import InfoReport

INFO_FRESH_S = 1.0  # a replica reports every 0.25 s: silent for longer, its last report is stale


class StatusReports:
    """Reading and summing up the replicas' reports; the state is QuorumKeeper's."""
    def _node_of(self, rank: int) -> Optional[int]:
        return self.routes.node_of(rank) if self.routes is not None else None

    def _read_with_reports(self, wanted: List[str]) -> Tuple[List[bytes], List[object]]:
        """Read `wanted` and every replica's status report in one multi_get: (the values of
        `wanted`, the reports in self.ranks order). A report is the raw text of the replica's own
        key, or the object its node relayed (ftrun.supervisor.relay); None when its node's key
        has not changed since the last read (nothing new from any of its replicas)."""
        nodes = self.routes.nodes if self.routes is not None else []
        direct = [r for r in self.ranks if self._node_of(r) is None]
        n, d = len(wanted), len(direct)
        vals = self._s.multi_get(wanted + [keys.info_key(r) for r in direct] + [keys.node_info_key(k) for k in nodes])
        reports: Dict[int, object] = dict(zip(direct, vals[n:n + d]))
        for k, raw in zip(nodes, vals[n + d:]):
            if raw == self._relayed_raw.get(k):
                continue
            self._relayed_raw[k] = raw
            try:
                relayed = json.loads(raw)
            except ValueError:
                continue
            for r in self.routes.ranks(k):
                reports[r] = relayed.get(str(r))
        return vals[:n], [reports.get(r) for r in self.ranks]

    def _absorb(self, healed: List[bytes], infos: List[object], now: float) -> None:
        """Take in the replicas' healed incarnations and status counters (as _read_with_reports gives them)."""
        for r, h, info in zip(self.ranks, healed, infos):
            if int(h) >= 0:
                self.healed.add((r, int(h)))
            # "{}": no report yet (a new store, or a worker of a relaying node that has not reported)
            if info is None or info == self._info_raw.get(r) or info == b"{}" or info == {}:
                continue
            self._info_raw[r] = info
            self.info_seen[r] = now
            report = InfoReport.from_object(info) if isinstance(info, dict) else InfoReport.decode(info)
            if report is not None:
                self.info[r] = {**report.fields, "beat": report.beat}
        self._track_waits(now)

    def replica_fields(self, rank: int) -> dict:
        info = self.info.get(rank) or {}
        inc = self.alive.get(rank)
        return {
            "in_quorum": inc is not None and self.members.get(rank) == inc and (rank, inc) in self.healed,
            "healing": bool(info.get("healing")) and info.get("inc") == inc,
            "last_heal_s": info.get("last_heal_s"),
            "ft_phase": info.get("phase") if info.get("inc") == inc else None,
        }

    def run_fields(self) -> dict:
        """The run's figures for `ftrun status`. From every replica's last report, not only the
        members': after the run (or while a replica heals) the members may be few or none, and
        a replica's last report still holds the steps it saw. Committed steps are the global
        step (the furthest replica's); discarded rounds are counted by each incarnation, so the
        longest-lived replica's count is the run's (a lower bound once every first replica
        has been restarted)."""
        reports = [self.info.get(r) or {} for r in self.ranks]
        return {
            "quorum_id": self.epoch_id,
            "quorum_size": len(self.members),
            "steps_committed": max((int(i.get("step", 0)) for i in reports), default=0),
            "steps_discarded": max((int(i.get("discarded", 0)) for i in reports), default=0),
        }

    def _fresh(self, rank: int, now: float) -> bool:
        return now - self.info_seen.get(rank, -1e9) <= INFO_FRESH_S

    def _track_waits(self, now: float) -> None:
        """A member is waited on when others of its epoch have voted in its round and it has
        not. Only replicas that still report count, on both sides: a stopped replica's last
        report is stale (its heartbeat check catches it) and must not make a waiting peer
        look hung. O(N) per poll: the newest round any fresh member is voting in is enough."""
        fresh = {r for r in self.members if self._fresh(r, now)}
        voting = [int((self.info.get(r) or {}).get("round", -1)) for r in fresh
                  if (self.info.get(r) or {}).get("phase") == "vote"]
        newest_vote = max(voting, default=None)
        for r in self.ranks:
            mine = self.info.get(r) or {}
            waited = (newest_vote is not None and r in fresh and mine.get("phase") not in ("vote", "done", None)
                      and newest_vote >= int(mine.get("round", 0)))
            if waited:
                self.waited_since.setdefault(r, now)
            else:
                self.waited_since.pop(r, None)

    def waited_for_s(self, rank: int) -> float:
        """How long the others have been waiting for this replica without a break (0: they are not)."""
        since = self.waited_since.get(rank)
        return self.clock() - since if since is not None else 0.0

    def global_step(self) -> int:
        return max((int((self.info.get(r) or {}).get("step", 0)) for r in self.ranks), default=0)


class Pace:
    """The run's recent time per step, from the global step the keeper sees rise: the last
    WINDOW_S seconds of it, so that a run that slows down (or speeds up) is followed."""

    WINDOW_S = 30.0

    def __init__(self) -> None:
        self.samples: Deque[Tuple[float, int]] = deque()
        self.noted_at = float("-inf")

    def note(self, t: float, step: int) -> None:
        self.noted_at = t
        if self.samples and step < self.samples[-1][1]:  # a fresh start: the old pace says nothing
            self.samples.clear()
        if step == 0:  # no step reported yet: a resumed run's first report (its checkpoint's step) is no pace
            self.samples.clear()
            return
        if self.samples and step == self.samples[-1][1]:
            return
        self.samples.append((t, step))
        while len(self.samples) > 2 and t - self.samples[0][0] > self.WINDOW_S:
            self.samples.popleft()

    def step_s(self) -> Optional[float]:
        """Seconds per step, or None before a few steps over half a second at least were seen."""
        if len(self.samples) < 2:
            return None
        (t0, s0), (t1, s1) = self.samples[0], self.samples[-1]
        if s1 - s0 < 3 or t1 - t0 < 0.5:
            return None
        return (t1 - t0) / (s1 - s0)
