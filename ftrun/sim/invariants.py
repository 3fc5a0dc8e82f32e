"""The protocol's invariants over a simulated --ft run, and what they need to remember: every
decision written, the state committed at each step of each lineage, the side effects run on
each, the quorums each keeper published, and what the survivors held when the store's host was
lost. Members, groups and the simulated supervisor report to it (note_commit, check_state,
check_handout, check_source, check_resume, violation); the world's run loop calls check() after a
turn that wrote to the store. The first violation is kept; it ends the run.
Must never change what happens in a run (it only reads and remembers), nor be imported by the
product.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple

from ftrun import keys, votes
from ftrun.sim.checkpoint import Marker
from ftrun.supervisor.ft.quorum import QuorumKeeper
from ftrun.wire import Quorum

if TYPE_CHECKING:
    from ftrun.sim.worker import SimWorker

PROGRESS_BOUND_S = 60.0  # after the last fault ends, the run finishes within this (virtual) time:
# six group formations' timeouts, more than any schedule of the product's own code has needed
TURNS_BOUND = 400_000  # a livelock that keeps time from moving is a violation too
EVAL_EVERY = 2  # the simulated script evaluates (a side effect gated on ft.redo()) every this many steps
KEYS_PER_RANK = 40  # the store holds at most this many keys per rank, plus KEYS_BASE (rounds in flight)
KEYS_BASE = 100


class Invariants:
    def __init__(self, world: Any, last_fault_end: float) -> None:  # world: sim/world.World
        self.w = world
        self.sched, self.sch, self.k, self.log = world.sched, world.sch, world.k, world.log
        self.decided: Dict[str, bytes] = {}
        self.committed: Dict[Tuple[int, int], str] = {}  # (lineage, step) -> the digest of the state committed
        self.effects: Dict[Tuple[int, int], Dict[str, int]] = {}  # (lineage, step) -> {state: a rank} side effects ran on
        self.first_violation: Optional[str] = None
        self._writes_seen = 0
        self._progress_deadline = last_fault_end + PROGRESS_BOUND_S
        self._keys_bound = KEYS_BASE + KEYS_PER_RANK * len(world.ranks)
        # The newest step committed before the move that a surviving member held then (lineage,
        # step), and the old keeper's last quorum: a source of a quorum after it sends nothing older.
        self.kept: Optional[Tuple[int, int]] = None
        self.moved_after = 0
        # Every quorum published, on any store: a quorum id names one quorum for the whole run (a
        # moved store's keeper counts on above the lost store's), and up to which each keeper was read.
        self.published: Dict[int, bytes] = {}
        self._published_upto: Dict[int, int] = {}
        self.seen_before_move = 0  # the newest quorum a member that lived on had seen when the store moved

    def spares_held(self, k: QuorumKeeper) -> None:
        """Hot spares (--spares): a replica the keeper holds back is in none of its quorums, and a
        quorum trains at most the run's replicas less the spares."""
        both = sorted(r for r in k.held if r in k.members)
        if both:
            self.violation(f"rank(s) {both} held back as spares are members of quorum {k.quorum_id}")
        most = max(1, len(k.ranks) // self.k - self.sch.spares)  # one trains at least (keeper/spares.py target)
        training = {r // self.k for r in k.members}
        if len(training) > most:
            self.violation(f"quorum {k.quorum_id} trains {len(training)} replicas ({sorted(training)}), more than the "
                           f"{most} the run's replicas less its {self.sch.spares} spare(s) leave")

    def quorums_published(self, node: int, k: QuorumKeeper) -> None:
        """The quorums node's keeper published since the last tick: none published twice otherwise
        while a member that lived on had seen the first (one the lost store published just before
        it went, which no survivor saw, may be published again)."""
        if k.quorum_id <= self._published_upto.get(node, 0):
            return
        data = self.w.store.data
        for q in range(self._published_upto.get(node, 0) + 1, k.quorum_id + 1):
            raw = data.get(keys.quorum_key(q))
            if raw is not None and self.published.setdefault(q, raw) != raw and q <= self.seen_before_move:
                self.violation(f"quorum {q} published twice, otherwise: {self.published[q].decode()} on the lost "
                               f"store, {raw.decode()} on the moved one")
        self._published_upto[node] = k.quorum_id

    def store_lost(self, h: int, last_quorum: int) -> None:
        """The node `h` hosting the run's store is lost, its keeper's last quorum `last_quorum`:
        what the survivors held then, which a quorum after the move may not lose."""
        self.kept = self._newest_kept(h)
        self.moved_after = last_quorum
        sup = self.w.supervisor
        self.seen_before_move = max((m.driver.latest_seen for r, m in sup.members.items()
                                     if self.w.node_of(r) != h and r not in sup.done and self.sched.alive(m.proc)),
                                    default=0)

    def store_switched(self) -> None:
        """The run's store is another one now: its writes are checked from its present length."""
        self._writes_seen = len(self.w.store.writes)

    def _newest_kept(self, h: int) -> Optional[Tuple[int, int]]:
        """(lineage, step): the newest step committed that a member off node `h` holds in sync."""
        best: Optional[Tuple[int, int]] = None
        for r, m in self.w.supervisor.members.items():
            if (self.w.node_of(r) == h or r in self.w.supervisor.done or not self.sched.alive(m.proc) or not m.in_sync
                    or m.driver.heals.tainted):
                continue
            c = max((st for (lin, st) in self.committed if lin == m.lineage and st <= m.step), default=None)
            if c is not None and (best is None or c > best[1]):
                best = (m.lineage, c)
        return best

    def check_source(self, m: "SimWorker", quorum: Quorum) -> None:
        """A moved store loses no committed step: a quorum's source after the move sends the newest
        step committed before it, or newer, while a member of that quorum still holds it."""
        if self.kept is None or quorum.id <= self.moved_after:
            return
        lineage, step = self.kept
        if m.lineage == lineage and m.step >= step:
            return
        for r, inc in quorum.members:
            o = self.w.supervisor.members.get(r)
            if (o is not None and o.inc == inc and self.sched.alive(o.proc) and o.lineage == lineage
                    and o.step >= step and not o.driver.heals.tainted):
                self.violation(f"the moved store lost committed step {step}: rank {m.rank}, the source of quorum "
                               f"{quorum.id}, sends step {m.step} while rank {r}, a member, holds step {o.step}")
                return

    def check_resume(self, m: "SimWorker", marker: Marker) -> None:
        """A resumed checkpoint holds a committed state: every round its writer had stepped on
        was decided to keep its steps, and its state is the one committed at its step."""
        lineage, step, digest, undecided = marker
        for (e, rnd), taken in undecided:
            raw = self.decided.get(keys.decision_key(e, rnd))
            if raw is None and self.w.supervisor.host_lost_at is not None and e <= self.moved_after:
                continue  # its decision went with the lost store: the moved store's first source adopted it
            commit, _, kept = votes.parse_decision(raw.decode()) if raw is not None else (False, 0, 0)
            if not commit and taken > (kept or 0):
                self.violation(f"rank {m.rank} resumes checkpoint step {step}, written after round {rnd} of quorum "
                               f"{e}, which was {'voted down' if raw is not None else 'never decided'}")
                return
        seen = self.committed.get((lineage, step))
        if seen is not None and seen != digest:
            self.violation(f"rank {m.rank} resumes checkpoint step {step} holding {digest}, while the committed "
                           f"state there is {seen}")
        self.log.append(f"{self.sched.now:.3f}s rank {m.rank} resumes checkpoint step {step}")

    def violation(self, what: str) -> None:
        if self.first_violation is None:
            self.first_violation = f"t={self.sched.now:.3f}s: {what}"

    def note_commit(self, m: "SimWorker", e: int, rnd: int, after: Tuple[int, int, str]) -> None:
        """A member learned that round (e, rnd), on which it stepped to `after`, committed."""
        lineage, step, digest = after
        seen = self.committed.setdefault((lineage, step), digest)
        self._effects_committed(lineage, step)
        if seen != digest:
            self.violation(f"step {step} committed with two states: rank {m.rank} (incarnation {m.inc}) holds "
                           f"{digest}, another member {seen} (round {rnd} of quorum {e})")

    def check_state(self, m: "SimWorker") -> None:
        """Before a member sends its gradients: no round it stepped on may have been decided
        otherwise, and its state is the state every member committed at its step."""
        if not m.in_sync:
            return
        d = m.driver
        # A round of several steps is decided at its end: a member mid-round learns it at its vote.
        open_round = (d.quorum.id, d.round) if d.quorum is not None and d.taken else None
        for (e, rnd), taken in m.stepped.items():
            decided = self.decided.get(keys.decision_key(e, rnd))
            if decided is None or (e, rnd) == open_round:
                continue
            commit, _, kept = votes.parse_decision(decided.decode())
            if not commit and taken > (kept or 0):  # a round voted down keeps only its first `kept` steps
                self.violation(f"rank {m.rank} (incarnation {m.inc}) goes on from round {rnd} of quorum {e}, "
                               f"which was voted down (it keeps {kept or 0} of its steps, this member took {taken})")
        seen = self.committed.get((m.lineage, m.step))
        it = d.iteration
        if it.several and (it.taken or it.done):  # inside a loop step: its sub-steps so far are on top of it
            return
        if seen is not None and seen != m.digest:
            self.violation(f"rank {m.rank} (incarnation {m.inc}) goes on at step {m.step} holding {m.digest}, "
                           f"while the committed state is {seen}")

    def check_handout(self, m: "SimWorker") -> None:
        """A step the loop hands the script: only to a member in sync (healed, or the source of a
        fresh quorum: never its initial state, nor one it stepped past a round voted down on, until
        it heals). On an evaluation step (every EVAL_EVERY) at a round's top, the script runs its
        side effects unless ft.redo(): never twice on one state (what they changed is the script's
        state, which a heal moves: a healed member's count is its source's), and only on the state
        committed at that step (checked here and as commits are learned, note_commit). Inside a round of several
        steps the steps before are not decided yet: a side effect there may run on a state a
        failure later in the round discards (a limit the docs state), so only a round's top is
        checked."""
        d = m.driver
        if not m.in_sync or d.heals.tainted:
            self.violation(f"rank {m.rank} (incarnation {m.inc}) is handed step {d.step} while out of sync "
                           f"({'tainted' if d.heals.tainted else 'never healed'}; quorum "
                           f"{d.quorum.id if d.quorum else None}, round {d.round})")
            return
        if d.step % EVAL_EVERY or d.taken:
            return
        if d.redo:  # what ft.redo() returns (the script gates its evaluation on it)
            return
        state = (m.lineage, d.step, m.digest)
        if state in m.effects:
            self.violation(f"rank {m.rank} (incarnation {m.inc}) runs step {d.step}'s side effects a second time on "
                           f"one state (its own, or its heal's source's): the step was handed out again without "
                           f"ft.redo()")
        m.effects.add(state)
        self.effects.setdefault((m.lineage, d.step), {})[m.digest] = m.rank
        self._effects_committed(m.lineage, d.step)

    def _effects_committed(self, lineage: int, step: int) -> None:
        """Every side effect of `step` ran on the state committed there (once that is known)."""
        seen = self.committed.get((lineage, step))
        ran = self.effects.get((lineage, step))
        if seen is None or not ran:
            return
        for digest, rank in ran.items():
            if digest != seen:
                self.violation(f"rank {rank} ran step {step}'s side effects on {digest}, a state the run discarded "
                               f"(committed there: {seen}); ft.redo() was False before the decision of the round "
                               f"under it was read")

    def check(self) -> None:
        s = self.w.store
        sched = self.sched
        if (len(s.writes) == self._writes_seen and s.max_keys <= self._keys_bound and not self.w.node_store
                and sched.now <= self._progress_deadline and sched.turns <= TURNS_BOUND and not sched.errors):
            return  # the common turn: nothing new to check
        if len(s.writes) > self._writes_seen:
            for _, op, key, value in s.writes[self._writes_seen:]:
                if "/d/" in key:
                    first = self.decided.setdefault(key, value)
                    if first != value:
                        self.violation(f"{key} decided twice: {first.decode()!r}, then {value.decode()!r}")
            self._writes_seen = len(s.writes)
        if s.max_keys > self._keys_bound:
            self.violation(f"the store grew to {s.max_keys} keys")
        for n, ns in self.w.node_store.items():
            if ns is not s and ns.max_keys > KEYS_BASE + KEYS_PER_RANK * self.w.per_node:
                self.violation(f"node {n}'s store grew to {ns.max_keys} keys")
        if self.sched.now > self._progress_deadline:
            self.violation(f"no progress: the run has not finished {PROGRESS_BOUND_S:g} s after the last fault "
                           f"({self.where()})")
        if self.sched.turns > TURNS_BOUND:
            self.violation(f"livelock: {TURNS_BOUND} turns without finishing ({self.where()})")
        if self.sched.errors:
            e = self.sched.errors[0]
            self.violation(f"a crash in protocol code: {type(e).__name__}: {e}")

    def where(self) -> str:
        return "; ".join(f"rank {r}: {m.info()}" for r, m in sorted(self.w.supervisor.members.items()) if r not in self.w.supervisor.done)
