"""The quorum keeper of --ft: the supervisor decides who takes part, and speaks for the dead.

On several machines node 0's keeper (the leader) keeps the quorum of every
global rank; the other nodes' keepers only report their replicas' births
and deaths to it through a store queue, and read the epochs it publishes.

It publishes an epoch (members, and which of them must heal) whenever
membership changes: when every first replica has asked to join, when a
restarted replica asks to join, and when a member dies. For a member that
died it writes "dead" into the votes its peers are waiting for
(compare_set: a vote the member managed to cast is kept), so the survivors
decide the round alike and move on without it. Status figures come back
from the replicas' info keys.
Must never import torch (it talks to the store through RunStore), and never
touch processes.
"""

from __future__ import annotations

import json
import time
from typing import Dict, List, Optional, Set, Tuple

from ftrun.worker.ft import keys
from ftrun.worker.ft.keys import Epoch

FIRST_EPOCH_WAIT_S = 30.0  # how long the first epoch waits for slow first replicas
INFO_FRESH_S = 1.0  # a replica reports every 0.25 s: silent for longer, its last report is stale
EVENTS = keys.PREFIX + "events"  # queue: "<rank> <incarnation> spawn|died|finished" from the other nodes


class QuorumKeeper:
    def __init__(self, store, ranks: List[int], local_ranks: Optional[List[int]] = None, leader: bool = True) -> None:
        self.store = store  # RunStore; its .store is the TCPStore once ready
        self.ranks = sorted(ranks)              # every replica of the run (all nodes)
        self.local = set(local_ranks if local_ranks is not None else ranks)
        self.leader = leader
        self.epoch_id = 0
        self.members: Dict[int, int] = {}
        self.healed: Set[Tuple[int, int]] = set()
        self.pending: Dict[int, int] = {}
        self.alive: Dict[int, Optional[int]] = {r: 0 for r in ranks}
        self.info: Dict[int, dict] = {}
        self.first_join: Optional[float] = None
        self.ready = False
        self.history: List[str] = []
        self._dead_pending: List[Tuple[int, int]] = []
        # Members that died while listed in an epoch: (rank, incarnation) -> last round
        # filled with "dead". Filled on every poll up to two rounds past the newest
        # vote, for as long as some live replica may still be in an epoch that lists them.
        self.dead: Dict[Tuple[int, int], int] = {}
        self.epochs: Dict[int, Set[Tuple[int, int]]] = {}
        # When each replica's info last changed (by this keeper's clock): a replica whose
        # reports stopped says nothing true about what it is doing now.
        self.info_seen: Dict[int, float] = {}
        self._info_raw: Dict[int, bytes] = {}
        # Since when the others have been waiting for each replica, continuously.
        self.waited_since: Dict[int, float] = {}

    # ------------------------------------------------------------ store
    @property
    def _s(self):
        return self.store.store

    def on_store_ready(self) -> None:
        s = self._s
        if not self.leader:
            self.ready = True
            for r in self.local:
                inc = self.alive.get(r)
                if inc is not None:
                    self._report(r, inc, "spawn")
            for r, k in self._dead_pending:
                self._report(r, k, "died")
            self._dead_pending.clear()
            return
        s.compare_set(keys.LATEST, "", "0")
        for r in self.ranks:
            s.compare_set(keys.round_key(r), "", "-1")
            s.compare_set(keys.join_key(r), "", "-1")
            s.compare_set(keys.healed_key(r), "", "-1")
            s.compare_set(keys.entered_key(r), "", "-1")
            s.compare_set(keys.info_key(r), "", "{}")
            if r in self.local:
                inc = self.alive.get(r)
                s.set(keys.inc_key(r), "dead" if inc is None else str(inc))
            else:
                s.compare_set(keys.inc_key(r), "", "0")
        self.ready = True
        for r, k in self._dead_pending:
            self.on_exit(r, k)
        self._dead_pending.clear()

    # ------------------------------------------------------------ events from the supervisor
    def _report(self, rank: int, inc: int, what: str) -> None:
        """A follower node tells the leader about its replica."""
        if what == "spawn":
            self._s.set(keys.inc_key(rank), str(inc))
        self._s.queue_push(EVENTS, f"{rank} {inc} {what}")

    def on_spawn(self, rank: int, inc: int) -> None:
        self.alive[rank] = inc
        if self.ready:
            if self.leader:
                self._s.set(keys.inc_key(rank), str(inc))
            else:
                self._report(rank, inc, "spawn")

    def on_exit(self, rank: int, inc: int, finished: bool = False) -> None:
        """A replica incarnation died (or finished): take it out and vote for it where it can't."""
        if self.alive.get(rank) == inc:
            self.alive[rank] = None
        if not self.ready:
            if not finished:
                self._dead_pending.append((rank, inc))
            return
        if not self.leader and rank in self.local:
            self._report(rank, inc, "finished" if finished else "died")
            return
        self.pending.pop(rank, None)
        if self.members.get(rank) == inc:
            del self.members[rank]
            if finished:  # it left the loop with the others: nobody waits for it
                return
            if self.members:
                self._publish(f"rank {rank} left")
            self._fill_votes(rank, inc)
        if self.alive.get(rank) is None:
            self._s.set(keys.inc_key(rank), "dead")

    def _fill_votes(self, rank: int, inc: int, top: Optional[int] = None) -> None:
        s = self._s
        if top is None:
            top = max(int(v) for v in s.multi_get([keys.round_key(r) for r in self.ranks]))
        # A live member waits at most two rounds past the newest vote anyone cast.
        first = self.dead.get((rank, inc), max(-1, top - 2)) + 1
        for rnd in range(first, top + 3):
            s.compare_set(keys.vote_key(rnd, rank, inc), "", f"dead {self.epoch_id}")
        self.dead[(rank, inc)] = max(top + 2, first - 1)

    def _refill(self, top: int) -> None:
        """Keep voting "dead" for dead members some live replica may still wait for."""
        live_epochs = set()
        for r, inc in self.alive.items():
            info = self.info.get(r) or {}
            if inc is not None and info.get("inc") == inc and info.get("epoch"):
                live_epochs.add(int(info["epoch"]))
        for member in list(self.dead):
            if any(member in self.epochs.get(e, ()) for e in live_epochs) or not live_epochs:
                if self.dead[member] < top + 2:
                    self._fill_votes(member[0], member[1], top)
            elif live_epochs and min(live_epochs) > max(e for e, m in self.epochs.items() if member in m):
                del self.dead[member]

    # ------------------------------------------------------------ polling
    def _drain_events(self) -> None:
        s = self._s
        for _ in range(s.queue_len(EVENTS)):
            rank, inc, what = s.queue_pop(EVENTS, False).decode().split()
            rank, inc = int(rank), int(inc)
            if what == "spawn":
                self.alive[rank] = inc
                s.set(keys.inc_key(rank), str(inc))  # after any "died" of the previous incarnation
            else:
                self.on_exit(rank, inc, finished=what == "finished")

    def _follow(self) -> None:
        """A follower reads what the leader decided, for status and hang detection."""
        s = self._s
        latest = int(s.get(keys.LATEST)) if s.check([keys.LATEST]) else 0
        if latest != self.epoch_id and latest > 0:
            epoch = Epoch.from_json(s.get(keys.epoch_key(latest)))
            self.epoch_id = latest
            self.members = dict(epoch.members)
        n = len(self.ranks)
        vals = s.multi_get([keys.healed_key(r) for r in self.ranks] + [keys.info_key(r) for r in self.ranks])
        self._absorb(vals[:n], vals[n:])

    def _absorb(self, healed: List[bytes], infos: List[bytes]) -> None:
        """Take in the replicas' healed incarnations and status counters."""
        now = time.monotonic()
        for r, h, info in zip(self.ranks, healed, infos):
            if int(h) >= 0:
                self.healed.add((r, int(h)))
            if info == self._info_raw.get(r):
                continue
            self._info_raw[r] = info
            self.info_seen[r] = now
            try:
                self.info[r] = json.loads(info)
            except ValueError:
                pass
        self._track_waits(now)

    def poll(self, now: float) -> None:
        if not self.ready:
            return
        if not self.leader:
            if self._s.check([keys.LATEST]):
                self._follow()
            return
        self._drain_events()
        s = self._s
        if self.dead:
            self._refill(max(int(v) for v in s.multi_get([keys.round_key(r) for r in self.ranks])))
        n = len(self.ranks)
        vals = s.multi_get([keys.join_key(r) for r in self.ranks] + [keys.healed_key(r) for r in self.ranks]
                           + [keys.info_key(r) for r in self.ranks])
        self._absorb(vals[n:2 * n], vals[2 * n:])
        for r, j in zip(self.ranks, vals[:n]):
            inc = self.alive.get(r)
            if inc is not None and int(j) == inc and r not in self.members and r not in self.pending:
                self.pending[r] = inc
                if self.first_join is None:
                    self.first_join = now
        if not self.pending:
            return
        if self.epoch_id == 0:
            waiting_for = [r for r in self.ranks if self.alive.get(r) is not None and r not in self.pending]
            if waiting_for and now - (self.first_join or now) < FIRST_EPOCH_WAIT_S:
                return
            self._publish("first replicas joined")
        else:
            self._publish(f"rank{'s' if len(self.pending) > 1 else ''} {', '.join(map(str, sorted(self.pending)))} joined")

    def _publish(self, why: str) -> None:
        s = self._s
        # Members that have entered an epoch switch by their votes; the others are still joining.
        entered = s.multi_get([keys.entered_key(r) for r in self.members])
        continuing = {r: k for (r, k), e in zip(self.members.items(), entered) if int(e) == k}
        self.members.update(self.pending)
        self.pending.clear()
        # Read who holds the committed state now, not as of the last poll: a replica
        # that healed a moment ago must not be taken for one that has nothing.
        healed = s.multi_get([keys.healed_key(r) for r in self.members])
        for r, h in zip(self.members, healed):
            if int(h) >= 0:
                self.healed.add((r, int(h)))
        holders = [r for r, k in self.members.items() if (r, k) in self.healed]
        fresh = self.epoch_id == 0 or not holders
        self.epoch_id += 1
        members = tuple(sorted(self.members.items()))
        start = -1
        if not continuing:
            rounds = [int(v) for v in s.multi_get([keys.round_key(r) for r in self.ranks])]
            start = max(rounds) + 1
        if fresh:
            src = min(self.members)
            epoch = Epoch(self.epoch_id, members, tuple(r for r in self.members if r != src), True, start)
            if self.epoch_id > 1:
                why += "; no replica holding the trained state is left: starting again from the first step"
        else:
            epoch = Epoch(self.epoch_id, members, tuple(sorted(r for r in self.members if r not in holders)),
                          False, start)
        self.epochs[self.epoch_id] = set(members)
        s.set(keys.epoch_key(self.epoch_id), epoch.to_json())
        s.set(keys.LATEST, str(self.epoch_id))
        self.history.append(f"epoch {self.epoch_id}: {len(members)} replicas ({why})")

    # ------------------------------------------------------------ status and hangs
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
        live = [self.info.get(r) or {} for r in self.members]
        return {
            "quorum_id": self.epoch_id,
            "quorum_size": len(self.members),
            "steps_committed": max((i.get("step", 0) for i in live), default=0),
            "steps_discarded": max((i.get("discarded", 0) for i in live), default=0),
        }

    def _fresh(self, rank: int, now: float) -> bool:
        return now - self.info_seen.get(rank, -1e9) <= INFO_FRESH_S

    def _waited_on(self, rank: int, now: float) -> bool:
        """The others of its epoch have voted in its round and it has not: they wait for it.
        Only replicas that still report count, on both sides: a stopped replica's last report
        is stale (its heartbeat check catches it), and must not make a waiting peer look hung."""
        mine = self.info.get(rank) or {}
        if rank not in self.members or not self._fresh(rank, now) or mine.get("phase") in ("vote", "done", None):
            return False
        others = [r for r in self.members if r != rank]
        return bool(others) and any(self._fresh(r, now) and (self.info.get(r) or {}).get("phase") == "vote"
                                    and (self.info.get(r) or {}).get("round", -1) >= mine.get("round", 0)
                                    for r in others)

    def _track_waits(self, now: float) -> None:
        for r in self.ranks:
            if self._waited_on(r, now):
                self.waited_since.setdefault(r, now)
            else:
                self.waited_since.pop(r, None)

    def waited_for_s(self, rank: int) -> float:
        """How long the others have been waiting for this replica without a break (0: they are not)."""
        since = self.waited_since.get(rank)
        return time.monotonic() - since if since is not None else 0.0

    def global_step(self) -> int:
        return max((int((self.info.get(r) or {}).get("step", 0)) for r in self.ranks), default=0)


def now() -> float:
    return time.time()
