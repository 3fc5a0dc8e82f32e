"""Simulated process groups: formed once every rank arrives; a collective completes once every
rank of the group reaches it, and fails at once when one of them died or left it (a reset
connection), as gloo and NCCL do.
Must never decide anything of the protocol (the member driver does), nor block on a real
primitive: its waits are the scheduler's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Set, Tuple

from ftrun.sim.sched import Sched

if TYPE_CHECKING:
    from ftrun.sim.worker import SimWorker

FORM_TIMEOUT_S = 10.0  # FTRUN_FT_TIMEOUT's default: a group formation, a collective's settle


class Group:
    def __init__(self, key: str, ranks: List[int]) -> None:
        self.key, self.ranks = key, list(ranks)
        self.procs: Dict[int, str] = {}
        self.left: Set[int] = set()
        self.seq: Dict[int, int] = {}
        self.ops: Dict[int, Set[int]] = {}
        self.payload: Optional[tuple] = None  # what a heal sends: (snapshot, digest, lineage, side effects run)
        self.waiters: list = []  # threads parked in one of its collectives
        self.kinds: Dict[int, Tuple[str, int]] = {}  # collective index -> (what it is, the first rank in it)
        self.prints: Dict[int, Dict[int, int]] = {}  # a check's collective index -> each rank's digest
        # A heal's comparison of fed states: collective index -> each end's word, and the one result
        # every end reads (computed once, by the first end out of the collective).
        self.fed: Dict[int, Dict[int, tuple]] = {}
        self.fed_found: Dict[int, tuple] = {}


class Groups:
    """Process groups: formed once every rank arrives; a collective completes once every rank
    reaches it, and fails at once when a rank of the group died or left it (a reset connection)."""

    def __init__(self, sched: Sched, violation: Callable[[str], None]) -> None:
        self.sched = sched
        self.violation = violation  # the run's invariants hear of collectives that would mix
        self.groups: Dict[str, Group] = {}

    def _broken(self, g: Group) -> bool:
        if g.left:
            return True
        alive = self.sched.alive
        for p in g.procs.values():
            if not alive(p):
                return True
        return False

    def form(self, m: "SimWorker", key: str, ranks: List[int], why: Callable[[], Optional[str]]) -> Optional[Group]:
        g = self.groups.setdefault(key, Group(key, ranks))
        g.procs[m.rank] = m.proc
        g.left.discard(m.rank)
        m.store.set(f"{key}{m.rank}", m.proc)  # the formation's own store traffic
        deadline = self.sched.now + FORM_TIMEOUT_S
        while True:
            if len(g.procs) == len(g.ranks) and not self._broken(g):
                return g
            if why() or self.sched.now >= deadline:
                self.leave(m, g)
                return None
            m.sleep(0.05)

    def leave(self, m: "SimWorker", g: Optional[Group]) -> None:
        if g is not None:
            g.left.add(m.rank)
            self._wake(g)

    def _wake(self, g: Group) -> None:
        """Something changed for the group's collective: its waiters look again."""
        waiters, g.waiters = g.waiters, []
        for t in waiters:
            self.sched.wake(t)

    def died(self) -> None:
        """A process died: every collective waiting on it fails now (a reset connection)."""
        for g in self.groups.values():
            if g.waiters:
                self._wake(g)

    def allreduce(self, m: "SimWorker", g: Group, what: str = "step") -> Optional[str]:
        """One collective of `what` (a step's gradients, a heal, the guard's check): members that
        reach the same collective with different ones would mix them (torch would, silently)."""
        i = g.seq.get(m.rank, 0)
        g.seq[m.rank] = i + 1
        first = g.kinds.setdefault(i, (what, m.rank))
        if first[0] != what:
            self.violation(f"rank {m.rank}'s collective {i} on {g.key} is a {what} where rank {first[1]}'s is a "
                             f"{first[0]}")
        arrived = g.ops.setdefault(i, set())
        arrived.add(m.rank)
        whole = len(g.ranks)
        sched = self.sched
        if len(arrived) == whole:
            self._wake(g)
            sched.block()  # still a yield point
            return None
        deadline = sched.now + FORM_TIMEOUT_S
        me = sched.current
        while len(arrived) < whole and not self._broken(g) and sched.now < deadline:
            g.waiters.append(me)
            try:
                sched.park(deadline)
            finally:
                if me in g.waiters:
                    g.waiters.remove(me)
        if len(arrived) == whole:
            return None
        return "a peer left mid-collective" if self._broken(g) else "the collective timed out"
