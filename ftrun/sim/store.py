"""An in-memory store with the semantics of torch's TCPStore that ftrun uses, each call a
yield point of the simulator's scheduler: set, get (waiting for the key, with the client's
timeout), add, compare_set, check, multi_get, delete_key, list_keys, num_keys, wait, and the
queues. Faults: every call may take longer (latency), and the store may be down for a while
(calls then wait, then fail with the client's timeout, as a TCPStore client does), or be gone
for good with the process that served it (`lose`: every call, and every wait in flight, fails at
once, as a reset connection does).
Must never block outside the scheduler.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Deque, Dict, List, Optional, Sequence, Union

from ftrun.sim.sched import Sched


class DistStoreError(Exception):
    """What a TCPStore client raises on a timeout (torch.distributed.DistStoreError), without
    importing torch: the simulator starts in a fraction of a second."""


class _Dist:
    DistStoreError = DistStoreError


dist = _Dist

Value = Union[str, bytes]


def _b(v: Value) -> bytes:
    return v if isinstance(v, bytes) else str(v).encode()


class SimStore:
    """The data, shared by every client."""

    def __init__(self, sched: Sched) -> None:
        self.sched = sched
        self.data: Dict[str, bytes] = {}
        self.queues: Dict[str, Deque[bytes]] = {}
        self.down_until = -1.0
        self.extra_latency = 0.0
        self.writes: List[tuple] = []  # (time, op, key, value) of decisions, for the invariants
        self.max_keys = 0
        self.on_call: Optional[Callable[[str], None]] = None  # told the calling process before each call
        self.waiters: Dict[str, list] = {}  # key -> threads parked until it is written
        self.gone = False  # the process serving it is gone: every call fails at once (lose)

    def lose(self) -> None:
        """The process serving this store is gone (its node was lost): calls fail at once, and
        so does every wait in flight (a reset connection)."""
        self.gone = True
        self.down_until = float("inf")  # the common call's one test (`_enter`) finds it
        waiting, self.waiters = self.waiters, {}
        for ts in waiting.values():
            for t in ts:
                self.sched.wake(t)

    def written(self, key: str) -> None:
        """`key` was written: wake whoever waits for it."""
        waiting = self.waiters.pop(key, None)
        if waiting:
            for t in waiting:
                self.sched.wake(t)

    def client(self, timeout_s: float = 600.0) -> "SimClient":
        return SimClient(self, timeout_s)


class SimClient:
    """One connection: the TCPStore calls ftrun makes, with the connection's timeout."""

    def __init__(self, store: SimStore, timeout_s: float) -> None:
        self.s, self.timeout_s = store, timeout_s

    # ------------------------------------------------------------ plumbing
    def _enter(self) -> None:
        s = self.s
        sched = s.sched
        me = sched.current
        if s.on_call is not None:  # a fault may kill the caller here, before its call takes effect
            s.on_call(me.proc)
        if s.extra_latency:
            sched.sleep(s.extra_latency * sched.rng.random())
        elif not me.fresh:
            # A yield point before every call, so that any thread may run between two calls. A
            # thread just resumed has done nothing visible since its last yield point: its call
            # takes effect in the turn that resumed it, which orders it among the others alike.
            sched.pass_turn()
        me.fresh = False
        if sched.now < s.down_until:
            self._down()

    def _down(self) -> None:
        """The store is down (or gone): wait for it to come back, up to the client's timeout."""
        s = self.s
        sched = s.sched
        deadline = sched.now + self.timeout_s
        while sched.now < s.down_until:  # a wait on time alone: a deadline, which the scheduler jumps to
            if s.gone:  # (it may go while the call waits for it to come back)
                raise dist.DistStoreError("simulated store: connection reset (the store's process is gone)")
            if s.down_until > deadline:
                sched.sleep(deadline - sched.now)
                raise dist.DistStoreError("simulated store: timed out (the store is down)")
            sched.sleep(s.down_until - sched.now)

    def _wait_keys(self, keys: Sequence[str]) -> None:
        """Wait for every key to be there, up to the client's timeout: parked, woken by a write.
        The callers test first that one is missing (the common call finds them all there)."""
        s = self.s
        data = s.data
        missing = [k for k in keys if k not in data]
        if not missing:
            return
        sched = s.sched
        deadline = sched.now + self.timeout_s
        me = sched.current
        while missing:
            if s.gone:  # it went while this call waited for it to come back (store-down)
                raise dist.DistStoreError("simulated store: connection reset (the store's process is gone)")
            if sched.now >= deadline:
                raise dist.DistStoreError(f"wait timeout after {self.timeout_s * 1000:.0f}ms, keys: {list(keys)}")
            for k in missing:
                s.waiters.setdefault(k, []).append(me)
            try:
                sched.park(deadline)
            finally:
                for k in missing:
                    w = s.waiters.get(k)
                    if w and me in w:
                        w.remove(me)
            missing = [k for k in keys if k not in data]

    # ------------------------------------------------------------ TCPStore's calls
    # Each writes its key's bytes, keeps the store's largest size and wakes the key's waiters
    # inline: these run once or more every simulated turn.
    def set(self, key: str, value: Value) -> None:
        self._enter()
        s = self.s
        data = s.data
        data[key] = value if isinstance(value, bytes) else str(value).encode()
        if len(data) > s.max_keys:
            s.max_keys = len(data)
        if s.waiters:
            s.written(key)

    def get(self, key: str) -> bytes:
        self._enter()
        data = self.s.data
        try:
            return data[key]
        except KeyError:
            self._wait_keys((key,))
            return data[key]

    def add(self, key: str, amount: int) -> int:
        self._enter()
        s = self.s
        data = s.data
        value = int(data.get(key, b"0")) + int(amount)
        data[key] = str(value).encode()
        if len(data) > s.max_keys:
            s.max_keys = len(data)
        if s.waiters:
            s.written(key)
        return value

    def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        self._enter()
        s = self.s
        data = s.data
        if key not in data:
            if _b(expected) == b"":
                data[key] = _b(desired)
                if len(data) > s.max_keys:
                    s.max_keys = len(data)
                s.written(key)
                s.writes.append((s.sched.now, "cas", key, data[key]))
                return data[key]
            return _b(expected)
        if data[key] == _b(expected):
            data[key] = _b(desired)
            s.writes.append((s.sched.now, "cas", key, data[key]))
        return data[key]

    def check(self, keys: Sequence[str]) -> bool:
        self._enter()
        data = self.s.data
        for k in keys:
            if k not in data:
                return False
        return True

    def multi_get(self, keys: Sequence[str]) -> List[bytes]:
        self._enter()
        data = self.s.data
        try:
            return [data[k] for k in keys]
        except KeyError:  # one is missing: wait for them all
            self._wait_keys(keys)
            return [data[k] for k in keys]

    def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        self._enter()
        s = self.s
        for k, v in zip(keys, values):
            s.data[k] = _b(v)
            s.written(k)
        if len(s.data) > s.max_keys:
            s.max_keys = len(s.data)

    def delete_key(self, key: str) -> bool:
        self._enter()
        return self.s.data.pop(key, None) is not None

    def list_keys(self) -> List[str]:
        self._enter()
        return sorted(self.s.data)

    def num_keys(self) -> int:
        self._enter()
        return len(self.s.data)

    def wait(self, keys: Sequence[str], timeout: Optional[object] = None) -> None:
        self._enter()
        data = self.s.data
        for k in keys:
            if k not in data:
                self._wait_keys(keys)
                return

    def queue_push(self, key: str, value: Value) -> None:
        self._enter()
        self.s.queues.setdefault(key, deque()).append(_b(value))

    def queue_len(self, key: str) -> int:
        self._enter()
        return len(self.s.queues.get(key, ()))

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        self._enter()
        q = self.s.queues.setdefault(key, deque())
        if not q:
            if not block:
                raise dist.DistStoreError(f"simulated store: queue {key} is empty")
            if not self.s.sched.wait_for(lambda: bool(q), self.timeout_s):
                raise dist.DistStoreError(f"simulated store: timed out waiting on queue {key}")
        return q.popleft()
