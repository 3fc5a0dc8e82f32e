"""Cooperative, seeded scheduling of simulated threads on a virtual clock.

Every simulated thread is a greenlet (its own stack, switched in user space: a turn costs
microseconds, where handing the turn between OS threads cost about 90), and only one runs at
a time: it runs until it reaches a yield point (a store call, a sleep, a wait on a queue or a
future), and there the scheduler picks, with its seeded random source, which thread goes next. Time is virtual: it
moves by a small random latency per scheduled turn, and jumps to the earliest deadline when
every thread waits. The same seed gives the same interleaving, so a failing schedule replays.
A killed thread is resumed once more to raise SimKilled, so that its stack unwinds.
Must never let two simulated threads run at once, and simulated code must never block on a
real primitive (a lock, a real sleep): the whole simulator would wait with it.
"""

from __future__ import annotations

import heapq
import random
from typing import Any, Callable, Dict, List, Optional, Tuple

import greenlet


_JUMP = object()  # _pick's word for a turn without a thread: the clock jumped to the next deadline
_HALT = object()  # what a thread's switch back to the hub says: the run is over (Sched.run)


class SimKilled(BaseException):
    """Raised in a simulated thread whose process was killed (not an Exception: code that
    catches Exception must not survive its own death)."""


class Deadlock(Exception):
    """Every live thread waits for something no other thread can bring, with no deadline."""


class SimThread:
    __slots__ = ("sched", "fn", "name", "proc", "done", "killed", "until", "pred", "error", "glet", "token", "pooled", "fresh")

    def __init__(self, sched: "Sched", fn: Callable[[], Any], name: str, proc: str) -> None:
        self.sched, self.fn, self.name, self.proc = sched, fn, name, proc
        self.done = False
        self.killed = False
        self.until: Optional[float] = None          # runnable again at this virtual time
        self.pred: Optional[Callable[[], bool]] = None  # runnable again once this holds
        self.error: Optional[BaseException] = None
        self.glet = greenlet.greenlet(self._body, parent=sched.hub)
        self.token = 0  # counts its blocks: a heap entry of an older one is stale
        self.pooled = True  # in the scheduler's pool (else waiting on a condition, or on time)
        # Resumed and has done nothing another thread could see yet: its next store call needs no
        # yield point of its own (the turn that resumed it was one; see store.SimClient._enter).
        self.fresh = False

    def _body(self) -> None:
        try:
            if self.killed:
                raise SimKilled()
            self.fn()
        except SimKilled:
            pass
        except BaseException as e:  # a crash in simulated code: the simulator reports it
            self.error = e
        finally:
            self.done = True  # returning switches back to the scheduler (the hub)
            self.sched._ended(self)


class Sched:
    """The scheduler: one turn at a time, chosen by `rng` among the threads that can run. A turn
    costs what the simulated code does plus one look at each thread waiting on a condition:
    threads that wait on time alone sit in a heap until their time comes, and the live threads
    of each process are counted as they start, end or are killed."""

    def __init__(self, rng: random.Random, latency_s: float = 0.0005) -> None:
        self.rng = rng
        self.now = 0.0
        self.latency_s = latency_s
        self.threads: List[SimThread] = []  # every thread not done
        self.current: Optional[SimThread] = None
        self.hub = greenlet.getcurrent()  # the scheduler's own greenlet: every turn comes back to it
        self.turns = 0
        self.errors: List[BaseException] = []
        self.slow: Dict[str, float] = {}  # proc -> its turns cost this much more time (a slow member)
        self.paused: Dict[str, float] = {}  # proc -> paused until (SIGSTOP); set through pause()
        self._pauses_end = 0.0  # the last pause's end: past it, `paused` is emptied
        self._live: Dict[str, int] = {}  # proc -> its threads neither done nor killed
        self._pool: List[SimThread] = []  # runnable whatever happens: their time came, or they yielded
        self._waiting: List[SimThread] = []  # waiting on a condition (and maybe a deadline)
        self._heap: List[Tuple[float, int, int, SimThread]] = []  # (until, seq, token, thread): time alone
        self._seq = 0
        self._direct = False  # inside run(): a thread's yield point begins the next turn itself

    # ------------------------------------------------------------ for simulated code
    def spawn(self, fn: Callable[[], Any], name: str, proc: str) -> SimThread:
        t = SimThread(self, fn, name, proc)
        self.threads.append(t)
        self._pool.append(t)
        self._live[proc] = self._live.get(proc, 0) + 1
        return t

    def _ended(self, t: SimThread) -> None:
        if not t.killed:
            self._live[t.proc] -= 1

    def me(self) -> SimThread:
        t = self.current
        assert t is not None, "a yield point outside a simulated thread"
        return t

    def block(self, pred: Optional[Callable[[], bool]] = None, until: Optional[float] = None) -> None:
        """Give the turn back; come back when `pred()` holds or at `until` (both None: at once)."""
        t = self.current
        assert t is not None, "a yield point outside a simulated thread"
        t.pred, t.until = pred, until
        t.token += 1
        t.pooled = False
        if pred is not None:
            self._waiting.append(t)
        elif until is None or until <= self.now:
            t.pooled = True
            self._pool.append(t)
        else:
            self._seq += 1
            heapq.heappush(self._heap, (until, self._seq, t.token, t))
        self._give_back(t)
        t.pred = t.until = None
        if t.killed:
            raise SimKilled()

    def park(self, until: Optional[float] = None) -> None:
        """Give the turn back until another thread wakes this one (`wake`), or `until`. The cheap
        wait: nothing is evaluated for it on each turn (the store's key waits, a signal's)."""
        t = self.current
        assert t is not None and t.glet is greenlet.getcurrent(), "a yield point outside a simulated thread"
        t.pred, t.until = None, until
        t.token += 1
        t.pooled = False
        if until is not None:
            self._seq += 1
            heapq.heappush(self._heap, (until, self._seq, t.token, t))
        self._give_back(t)
        t.until = None
        if t.killed:
            raise SimKilled()

    def wake(self, t: SimThread) -> None:
        """Make a parked (or waiting) thread runnable."""
        if not t.done:
            self._wake(t)

    def sleep(self, seconds: float) -> None:
        if seconds > 0.0:
            self.block(None, self.now + seconds)
            return
        self.pass_turn()

    def pass_turn(self) -> None:
        """A yield point: runnable again at once (sleep(0), and the one before each store call)."""
        t = self.current
        assert t is not None, "a yield point outside a simulated thread"
        t.pred = t.until = None
        t.token += 1
        t.pooled = True
        self._pool.append(t)
        self._give_back(t)
        if t.killed:
            raise SimKilled()

    def wait_for(self, pred: Callable[[], bool], timeout: Optional[float]) -> bool:
        """Block until pred() holds (True) or `timeout` virtual seconds pass (False)."""
        if pred():
            self.block()  # still a yield point: others may run first
            return True
        self.block(pred, None if timeout is None else self.now + timeout)
        return pred()

    # ------------------------------------------------------------ for the simulator
    def kill(self, proc: str) -> None:
        for t in self.threads:
            if t.proc == proc and not t.done and not t.killed:
                t.killed = True
                self._live[proc] -= 1
                self._wake(t)

    def _wake(self, t: SimThread) -> None:
        """Move a blocked thread to the pool (killed: it runs once more, to unwind)."""
        if t is self.current or t.pooled:
            return
        if t.pred is not None:
            self._waiting.remove(t)
        t.token += 1  # its heap entry, if any, is stale
        t.pooled = True
        self._pool.append(t)

    def pause(self, proc: str, until: float) -> None:
        """Stop `proc`'s threads until `until` (SIGSTOP, then SIGCONT)."""
        self.paused[proc] = until
        self._pauses_end = max(self._pauses_end, until)

    def alive(self, proc: str) -> bool:
        return self._live.get(proc, 0) > 0

    def _ready(self, now: float) -> List[SimThread]:
        """The threads that may run now. The pool itself (not a copy) when no thread waits on a
        condition and none is paused: the common turn, which then allocates nothing."""
        heap, pool = self._heap, self._pool
        while heap and heap[0][0] <= now:
            _, _, token, t = heapq.heappop(heap)
            if token == t.token:
                t.pooled = True
                pool.append(t)
        if self.paused and now >= self._pauses_end:
            self.paused.clear()  # every pause is over: none filters a turn any more
        if not self._waiting:
            if not self.paused:
                return pool
            paused = self.paused  # a pause alone (the common slow turn): one pass over the pool
            return [t for t in pool if paused.get(t.proc, -1.0) <= now]
        ready = list(pool)
        for t in self._waiting:
            until = t.until
            if (until is not None and now >= until) or t.pred():
                ready.append(t)
        if self.paused:
            paused = self.paused
            ready = [t for t in ready if paused.get(t.proc, -1.0) <= now]
        return ready

    def _pick(self) -> Any:
        """Begin the next turn: its thread, taken from where it waited, with the clock moved by the
        turn's latency; _JUMP when no thread could run and the clock jumped to the next deadline
        instead (a turn without a thread); None when nothing can run any more. Raises Deadlock."""
        now = self.now
        pool = self._pool
        heap = self._heap
        if (heap and heap[0][0] <= now) or self._waiting or self.paused:
            ready = self._ready(now)
        else:
            ready = pool  # the common turn: _ready's answer, without the call
        n = len(ready)
        if not n:
            if heap and not self._waiting and not self.paused:  # the common jump: to the heap's first
                self.now = max(now, heap[0][0])
                return _JUMP
            # Only deadlines still ahead: a paused process's thread may be past its own.
            deadlines = [t.until for t in self._waiting if t.until is not None and t.until > now]
            if heap:
                deadlines.append(heap[0][0])
            deadlines += [p for p in self.paused.values() if p > now]
            if not deadlines:
                if self.threads:
                    raise Deadlock(", ".join(sorted(f"{t.proc}/{t.name}" for t in self.threads)))
                return None
            self.now = max(now, min(deadlines))
            return _JUMP
        rng = self.rng
        i = int(rng.random() * n) if n > 1 else 0
        t = ready[i]
        if ready is pool:  # the common turn: it is the pool's i-th
            del pool[i]
        elif t.pooled:
            pool.remove(t)
        else:
            self._waiting.remove(t)
        t.pooled = False
        t.token += 1
        if self.slow:
            self.now = now + rng.random() * self.latency_s * (1.0 + self.slow.get(t.proc, 0.0))
        else:
            self.now = now + rng.random() * self.latency_s
        self.current = t
        t.fresh = True
        return t

    def _turn_over(self, t: SimThread) -> None:
        """End `t`'s turn (it reached a yield point, or ended)."""
        self.current = None
        self.turns += 1
        if t.done:
            self.threads.remove(t)
            if t.error is not None:
                self.errors.append(t.error)
                t.error = None

    def turn(self) -> bool:
        """Run one thread until its next yield point. False when nothing can run any more."""
        t = self._pick()
        if t is None:
            return False
        if t is not _JUMP:
            t.glet.switch()
            self._turn_over(t)
        return True

    def run(self, go_on: Callable[[], bool], between: Callable[[], None]) -> None:
        """Turns while `go_on()` (asked before the first turn and after each) and something can
        run; `between()` looks at each turn once it is over. Raises Deadlock. The same turns, in the
        same order, as `turn()` in a loop, without the round trip through the hub: a thread at its
        yield point ends its turn and begins the next itself, and switches straight to that turn's
        thread (one greenlet switch where the hub's took two; none when it picks itself). Only a
        thread's end, and the end of the run, come back to the hub."""
        self._go_on, self._between = go_on, between
        self._deadlock: Optional[Deadlock] = None
        self._direct = True
        try:
            t = self._next() if go_on() else None
            while t is not None:
                if t.glet.switch() is _HALT:
                    break  # a thread's turn was the last: go_on() said so, or nothing can run
                self._turn_over(self.current)  # a thread ended: its greenlet returned to the hub
                t = self._next_after()
        finally:
            self._direct = False
        if self._deadlock is not None:
            raise self._deadlock

    def _next_after(self) -> Optional[SimThread]:
        """After a turn: `between()`, then the next turn's thread (None: the run stops here)."""
        self._between()
        return self._next() if self._go_on() else None

    def _next(self) -> Optional[SimThread]:
        """The next turn's thread; a time jump on the way is a turn of its own, looked at as any."""
        while True:
            try:
                t = self._pick()
            except Deadlock as e:
                self._deadlock = e
                return None
            if t is not _JUMP:
                return t
            self._between()
            if not self._go_on():
                return None

    def _give_back(self, t: SimThread) -> None:
        """The end of the running thread `t`'s turn, at its yield point: back to the hub, or, inside
        run(), on to the next turn (`t` returns from here once its own turn comes again)."""
        if not self._direct:
            self.hub.switch()
            return
        self._turn_over(t)
        nxt = self._next_after()
        if nxt is None:
            self.hub.switch(_HALT)
        elif nxt is not t:
            nxt.glet.switch()

    def shutdown(self) -> None:
        """Unwind every thread left (their processes are all killed)."""
        for t in list(self.threads):
            if not t.killed and not t.done:
                t.killed = True
                self._live[t.proc] -= 1
                self._wake(t)
        for _ in range(4 * len(self.threads) + 10):
            if not self.threads:
                break
            try:
                self.turn()
            except Deadlock:
                break
