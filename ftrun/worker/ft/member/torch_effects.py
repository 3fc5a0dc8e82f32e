"""The worker's effects for the member's driver (member/effects.py): the run's TCPStore, process
groups over torch.distributed (ft/member/group.py), the state transfer (ft/heal/transport.py) of the replica's
registered state (ft/heal/state.py), real threads and clocks, and the process's exits. Carries out;
decides nothing. Must never import the supervisor.
"""

from __future__ import annotations

import datetime
import os
import signal
import socket
import threading
import time
import weakref
from typing import Any, Callable, List, NoReturn, Optional, Tuple

import torch.distributed as dist

from ftrun import keys
from ftrun.wire import Quorum
from ftrun.worker.ft.member import vote
from ftrun.worker.ft.member.group import abort_group, build_group_watched, group_device, hang_up, settle
from ftrun.worker.ft.member.core import FedCompared
from ftrun.worker.ft.member.effects import HealRefused, MemberEffects, Snapshot
from ftrun.worker.ft.member.member_io import POLL_S, _env_number, _log, _log_detail, leave, restart_replica
from ftrun.worker.ft.heal.agreement import compare
from ftrun.worker.ft.heal.feed import Feeder, Follower, agree_kept, compare_fed, replica_decides
from ftrun.worker.ft.heal.state import ReplicaState
from ftrun.worker.ft.heal.transport import StateMismatch, receive_state, send_state
from ftrun.worker import settings
from ftrun.worker.settings import run_store, store_moved

STORE_PROBES = 5  # connections 0.1 s apart that must all get in for the run's store to count as up
NICER = 5
CONNECT_S = 10.0  # a store client's connect (store_client)
JOIN_FAST_S, SPARE_POLL_S = 1.0, 0.05  # a join's fast polls, then a waiting spare's (join_sleep)
FEED_STORE_S = 30.0  # the longest one store operation of the hot spares' feed may wait


def _yield_to_training() -> None:
    """Lower this thread's scheduling priority a little (Linux: per thread). Woken by each step's
    vote, it would otherwise take a core from the training thread at once on a busy machine (the
    tiny model's step measured 2% faster); its decision is needed a forward pass later, not now."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + NICER)
    except (AttributeError, OSError):  # not Linux, or not allowed: the default priority works too
        pass


def store_client(addr: str, timeout: datetime.timedelta) -> dist.TCPStore:
    """A client of the store at `addr` whose operations wait up to `timeout`. torch's client retries
    its connect for that whole timeout (the vote's: 600 s): a worker that connected as the run's
    store went away took, seconds later, whatever store bound that port next (a node started with
    the run's original line) and never followed the move. A store that refuses now is gone (the
    caller follows the move, member/moves.py), and a live one takes the connect within CONNECT_S."""
    host, _, port = addr.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_S).close()
    except OSError as e:
        raise dist.DistNetworkError(f"the store at {addr} does not answer ({e})") from None
    store = dist.TCPStore(host, int(port), None, False, min(timeout, datetime.timedelta(seconds=CONNECT_S)))
    store.set_timeout(timeout)
    return store


class TorchEffects(MemberEffects):
    store_errors = (dist.DistError, vote.StoreMovedMidVote)
    poll_s = POLL_S

    def __init__(self, state: ReplicaState, rank: int, timeout: datetime.timedelta) -> None:
        self.state = state
        self.rank = rank
        self._timeout = timeout
        self._chunk = int(_env_number("FTRUN_FT_CHUNK_MB", 64, 1, 4096) * (1 << 20))
        self._settle_s = _env_number("FTRUN_FT_TIMEOUT", 10, 0.5, 3600)
        # Fault injection for tests, "RANK:STEP": that rank's first incarnation votes that step down
        # after its collectives succeeded everywhere (the others have stepped: a mixed outcome).
        inject = os.environ.get("FTRUN_FT_INJECT_FAIL", "").split(":")
        self._inject_fail = (int(inject[0]), int(inject[1])) if len(inject) == 2 and all(
            i.strip().isdigit() for i in inject) else None
        self._node_store: Any = None  # this node's store client (vote.Node), connected once
        self.step_listeners: List[Callable[[], None]] = []  # called as this member takes a step
        self.group_listeners: List[Callable[[Any], None]] = []
        self._dropped: Optional[Callable[[], Any]] = None  # a weak reference to the group dropped last
        self._formed: Tuple[Callable[[], Any], str] = (lambda: None, "")  # the group formed last (weakly), its prefix
        from ftrun.worker import progress

        self.progress = progress.start_from_env()
        self._inc = settings.current().restart_count
        # Hot spares that hold the live state (ft/heal/feed.py): this worker feeds the spares while
        # it trains, and follows a feeder while it waits as a spare.
        # Their own store connections, whose one operation never waits past FEED_STORE_S: a read
        # that waits (a key not there) holds a training step, or a spare's look at the quorums.
        def feed_store() -> dist.TCPStore:
            return self.connect(FEED_STORE_S)

        self.feeder = Feeder(state, rank, feed_store, _log_detail, self._chunk, self._settle_s)
        self.follower = Follower(state, rank, lambda: self._inc, feed_store, _log_detail, self._chunk,
                                 self._settle_s)

    # ------------------------------------------------------------ the store
    def client(self, addr: str, timeout_s: Optional[float] = None) -> dist.TCPStore:
        return store_client(addr, self._timeout if timeout_s is None else datetime.timedelta(seconds=timeout_s))

    def connect(self, timeout_s: Optional[float] = None) -> dist.TCPStore:
        return self.client(run_store(), timeout_s)

    def node(self) -> Optional[vote.Node]:
        return vote.Node.from_env(self.client)

    def announced_store(self) -> Optional[Tuple[int, str]]:
        node = self._node_store
        if node is None:
            node = self._node_store = vote.Node.from_env(self.client)
        if node is None or not node.store.check([keys.RUN_STORE]):
            return None
        gen, where = node.store.get(keys.RUN_STORE).decode().split()
        return int(gen), where

    def store_gone(self) -> bool:
        """One answer is not enough: a store whose process is being killed resets its connections
        before the kernel closes its listening socket. A live store answers every probe."""
        host, _, port = run_store().rpartition(":")
        for i in range(STORE_PROBES):
            if i:
                time.sleep(0.1)
            try:
                with socket.create_connection((host, int(port)), timeout=2.0):
                    pass
            except OSError:
                return True
        return False

    def store_address(self) -> str:
        return run_store()

    def store_moved(self, addr: str) -> None:
        store_moved(addr)
        if self.progress is not None:
            self.progress.move_to(addr)

    # ------------------------------------------------------------ clock and threads
    def now(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def join_sleep(self) -> Callable[[float], None]:
        """A join polls every poll_s for its first JOIN_FAST_S (a restarted replica's usual wait),
        then every SPARE_POLL_S: a hot spare (--spares) waits there the whole run, and fast polls
        would take a share of a core from the training replicas, and of the supervisor answering
        them (docs/benchmarks/heal.md); SPARE_POLL_S adds at most itself to its promotion. A spare spends those
        sleeps following its feeder (ft/heal/feed.py)."""
        start = time.monotonic()

        def sleep(seconds: float) -> None:
            if time.monotonic() - start < JOIN_FAST_S:
                time.sleep(seconds)
            else:
                self.follower.wait(max(seconds, SPARE_POLL_S))
        return sleep

    def park(self) -> None:
        # The script's own handlers have nothing left to do: a SIGTERM handler that only sets a
        # flag (Lightning's) would keep the process alive to its SIGKILL, and torch's SIGCHLD
        # handler raises in the park when the DataLoader's workers, in this process group, die of
        # the same signal first: a traceback per rank on a clean stop. SIGINT ends it with
        # KeyboardInterrupt, which the bootstrap reports in one line.
        if threading.current_thread() is not threading.main_thread():
            return  # signal dispositions can only be changed from the main thread
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)

    def spawn(self, fn: Callable[[], None], name: str, low_priority: bool = False) -> None:
        def run() -> None:
            if low_priority:
                _yield_to_training()
            fn()

        threading.Thread(target=run, name=name, daemon=True).start()

    def signal(self) -> threading.Event:  # type: ignore[override]
        return threading.Event()

    # ------------------------------------------------------------ exits and words
    def exit(self, code: int, line: str = "") -> NoReturn:
        leave(code, line)

    def restart(self, line: str, peers_decided: str = "") -> NoReturn:
        restart_replica(line, peers_decided)

    def log(self, msg: str) -> None:
        _log(msg)

    def log_detail(self, msg: str) -> None:
        _log_detail(msg)

    # ------------------------------------------------------------ groups and collectives
    def form_group(self, prefix: str, quorum: Quorum, ranks: list, give_up: Callable[[], Optional[str]]) -> Any:
        pg = build_group_watched(run_store(), prefix, ranks.index(self.rank), len(ranks), give_up, POLL_S)
        self._formed = (weakref.ref(pg), prefix)  # a heal's: its keys name a sharded source's one decision
        return pg

    def drop_group(self, group: Any) -> None:
        if group is not None:
            abort_group(group)
            self._dropped = weakref.ref(group)  # freed once the listeners let it go (group_changed)

    def hang_up(self, group: Any) -> None:
        hang_up(group)

    def collectives_unsettled(self) -> Optional[str]:
        if settle(self._settle_s):
            return None
        return f"the round's collectives did not finish within {self._settle_s:g} s"

    def injected_failure(self, rank: int, step: int, inc: int) -> Optional[str]:
        if self._inject_fail == (rank, step) and inc == 0:
            self._inject_fail = None
            return "a failure injected by FTRUN_FT_INJECT_FAIL"
        return None

    # ------------------------------------------------------------ the state a heal moves
    def fed(self) -> bool:
        return self.follower.touched

    def compare_fed(self, group: Any, sending: bool, step: int) -> Optional[FedCompared]:
        return compare_fed(group, self.state, sending, None if sending else self.follower, step)

    def agree_kept(self, group: Any, kept: bool, sending: bool) -> bool:
        return agree_kept(group, kept, sending, self._replica_decides(group) if sending else None)

    def send_state(self, group: Any, snapshot: Snapshot, kept: bool) -> Any:
        if kept:
            self._inject_send_delay()  # a kept state may send no chunk: hold the heal open before its header
        return send_state(group, self.state.capture(*snapshot, kept=kept), group_device(), chunk=self._chunk,
                          after_first_chunk=self._inject_send_delay, timeout_s=self._settle_s)

    def receive_state(self, group: Any, on_write: Callable[[], None], kept: bool) -> Tuple[Snapshot, Any]:
        try:
            local = self.state.kept_targets() if kept else self.state.targets()
            payload, stats, in_place = receive_state(group, local, group_device(), chunk=self._chunk,
                                                     on_write=on_write, timeout_s=self._settle_s)
            snapshot = self.state.restore(payload, in_place)
            self.follower.healed()
            return snapshot, stats
        except StateMismatch as e:
            raise HealRefused(str(e)) from None

    def compare_states(self, group: Any) -> Tuple[Tuple[Tuple[int, Tuple[int, ...]], ...], Tuple[Tuple[int, str], ...]]:
        return compare(group, self.rank, self.state)

    def _replica_decides(self, group: Any) -> Callable[[bool], bool]:
        """For a sharded source: its K workers' one decision on whether the healers keep their
        state, fixed in the run's store under the heal group's prefix (feed.replica_decides)."""
        ref, prefix = self._formed

        def decide(keep: bool) -> bool:
            if ref() is not group:  # not the group this worker formed last: no prefix to agree under
                return False
            return replica_decides(self.connect(), prefix, self.rank, keep, self._settle_s)
        return decide

    def _inject_send_delay(self) -> None:
        delay = float(os.environ.get("FTRUN_FT_INJECT_SEND_DELAY", "0"))
        if delay:  # fault injection for tests: widen the window in which the source can die mid-transfer
            time.sleep(delay)

    # ------------------------------------------------------------ what the script sees
    def took_step(self, quorum: int, rnd: int, step: int) -> None:
        for fn in self.step_listeners:
            fn()
        if self.progress is not None:
            self.progress.note_step(step)

    def note_step(self, step: int) -> None:
        if self.progress is not None:
            self.progress.note_step(step, took=False)

    def group_changed(self, group: Any) -> None:
        for fn in self.group_listeners:
            fn(group)
        if group is None:
            # Gloo closes a group's connections only when the group is freed (its abort does not),
            # and a peer blocked on this member in the failed collective waits until then. The
            # listeners' references go by reference counting; only a group something still holds
            # in a cycle needs a full collection (it walks every object torch made: slow, and
            # before this vote; docs/benchmarks/heal.md).
            dropped, self._dropped = self._dropped, None
            if dropped is not None and dropped() is not None:
                import gc

                gc.collect()

    def incarnation(self, inc: int) -> None:
        self._inc = inc
        if self.progress is not None:
            self.progress.incarnation = inc
