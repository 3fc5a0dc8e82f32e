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

import random
from typing import Any, Callable, Dict, List, Optional

import greenlet


class SimKilled(BaseException):
    """Raised in a simulated thread whose process was killed (not an Exception: code that
    catches Exception must not survive its own death)."""


class Deadlock(Exception):
    """Every live thread waits for something no other thread can bring, with no deadline."""


class SimThread:
    def __init__(self, sched: "Sched", fn: Callable[[], Any], name: str, proc: str) -> None:
        self.sched, self.fn, self.name, self.proc = sched, fn, name, proc
        self.done = False
        self.killed = False
        self.until: Optional[float] = None          # runnable again at this virtual time
        self.pred: Optional[Callable[[], bool]] = None  # runnable again once this holds
        self.error: Optional[BaseException] = None
        self.glet = greenlet.greenlet(self._body, parent=sched.hub)

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

    def runnable(self, now: float) -> bool:
        if self.done:
            return False
        if self.killed:
            return True  # once more, to unwind
        if self.pred is not None and self.pred():
            return True
        if self.until is not None and now >= self.until:
            return True
        return self.pred is None and self.until is None


class Sched:
    """The scheduler: one turn at a time, chosen by `rng`."""

    def __init__(self, rng: random.Random, latency_s: float = 0.0005) -> None:
        self.rng = rng
        self.now = 0.0
        self.latency_s = latency_s
        self.threads: List[SimThread] = []
        self.current: Optional[SimThread] = None
        self.hub = greenlet.getcurrent()  # the scheduler's own greenlet: every turn comes back to it
        self.turns = 0
        self.errors: List[BaseException] = []
        self.slow: Dict[str, float] = {}  # proc -> its turns cost this much more time (a slow member)
        self.paused: Dict[str, float] = {}  # proc -> paused until (SIGSTOP)

    # ------------------------------------------------------------ for simulated code
    def spawn(self, fn: Callable[[], Any], name: str, proc: str) -> SimThread:
        t = SimThread(self, fn, name, proc)
        self.threads.append(t)
        return t

    def me(self) -> SimThread:
        t = self.current
        assert t is not None and t.glet is greenlet.getcurrent(), "a yield point outside a simulated thread"
        return t

    def block(self, pred: Optional[Callable[[], bool]] = None, until: Optional[float] = None) -> None:
        """Give the turn back; come back when `pred()` holds or at `until` (both None: at once)."""
        t = self.me()
        t.pred, t.until = pred, until
        self.hub.switch()
        t.pred = t.until = None
        if t.killed:
            raise SimKilled()

    def sleep(self, seconds: float) -> None:
        self.block(until=self.now + max(0.0, seconds))

    def wait_for(self, pred: Callable[[], bool], timeout: Optional[float]) -> bool:
        """Block until pred() holds (True) or `timeout` virtual seconds pass (False)."""
        if pred():
            self.block()  # still a yield point: others may run first
            return True
        deadline = None if timeout is None else self.now + timeout
        self.block(pred, deadline)
        return pred()

    # ------------------------------------------------------------ for the simulator
    def kill(self, proc: str) -> None:
        for t in self.threads:
            if t.proc == proc and not t.done:
                t.killed = True

    def alive(self, proc: str) -> bool:
        return any(t.proc == proc and not t.done and not t.killed for t in self.threads)

    def turn(self) -> bool:
        """Run one thread until its next yield point. False when nothing can run any more."""
        self.threads = [t for t in self.threads if not t.done]
        ready = [t for t in self.threads if t.runnable(self.now) and self.paused.get(t.proc, -1.0) <= self.now]
        if not ready:
            # Only deadlines still ahead: a paused process's thread may be past its own.
            deadlines = [t.until for t in self.threads if t.until is not None and not t.killed and t.until > self.now]
            deadlines += [p for p in self.paused.values() if p > self.now]
            if not deadlines:
                if any(not t.done for t in self.threads):
                    raise Deadlock(", ".join(sorted(f"{t.proc}/{t.name}" for t in self.threads)))
                return False
            self.now = max(self.now, min(deadlines))
            return True
        t = self.rng.choice(ready)
        self.now += self.rng.random() * self.latency_s * (1.0 + self.slow.get(t.proc, 0.0))
        self.current = t
        t.glet.switch()
        self.current = None
        self.turns += 1
        if t.error is not None:
            self.errors.append(t.error)
            t.error = None
        return True

    def shutdown(self) -> None:
        """Unwind every thread left (their processes are all killed)."""
        for t in self.threads:
            t.killed = True
        for _ in range(4 * len(self.threads) + 10):
            if not self.threads or not any(not t.done for t in self.threads):
                break
            try:
                self.turn()
            except Deadlock:
                break
