"""A hot spare's feed: the training replicas' state kept on a waiting spare without a forward or backward.

A training replica (the feeder: the quorum's heal source, Quorum.source, which the keeper
chose) sends each spare that asks, once, its whole state (after a step), then at every step it
takes, as its optimizers are about to step, the gradients they step on (after the script's
clipping and unscaling), their settings (learning rate, ...) and its model's buffers. The spare
(Follower, run in its wait to join) steps its own optimizers on them, beside its feeder's. At a
promotion the heal asks both ends for a fingerprint of their models and optimizers: when they
match, only what is not the model and optimizers moves (registered state, the optimizers'
settings); otherwise (a spare that missed a step, a script that changes its parameters outside
the optimizer) the whole state moves, as for any healer.

A sharded replica (--replica-size K, FSDP2 over ft.device_mesh()) is fed shard by shard: worker j
of the spare follows worker j of the feeder replica (the same mesh: each pair holds the same local
shards of every DTensor), and at its promotion the spare keeps its state only if every shard pair
matches. The source replica's K workers fix that one decision through the store and each sends it
to its shard's healers, so all K workers of a healer take the same branch: one shard whose feed
broke sends the whole state to every shard, never a mix.

Nothing here decides who trains (keeper/spares.py) or whether a round commits (member/): a
spare's state is only trusted after the fingerprints agree. Must never fail a training
replica's round (a feed that breaks or falls behind is dropped, and the spare is healed whole
if promoted), never hold a feeder's step for longer than FEED_WAIT_S (but for the one transfer of
its whole state when a spare begins to follow), and never import the supervisor.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ftrun import keys
from ftrun.wire import Quorum
from ftrun.worker.ft.heal.state import ReplicaState
from ftrun.worker.ft.heal.transport import _local, receive_state, send_state
from ftrun.worker.ft.member import membership
from ftrun.worker.ft.member.core import FedCompared
from ftrun.worker.ft.member.group import abort_group, build_group_watched, group_device
from ftrun.worker.ft.member.member_io import PEER_LOST, _plain
from ftrun.worker import settings
from ftrun.worker.settings import run_store

MAGIC = 0x66656564  # "feed": the first word of every step's header
HEAD = 6  # MAGIC, step, settings bytes, parameters, buffers, tensor bytes
REPORT_EVERY = 20  # steps between the feeder's lines on what feeding costs it
LOOK_S = 0.5  # how often a feeder looks for spares asking to be fed
FEED_WAIT_S = 1.0  # how long a feeder waits for a step's feed to leave before it drops the feed
IN_FLIGHT = 2  # steps a feed may have still leaving
ASK_S = 30.0  # how long a spare waits for its feeder to answer before it asks again
# How long a feeder that answered waits for its spare to form their group, on its training thread
# (at most half of ftrun's timeout: the other replicas' next collective waits for this one).
FORM_S = 3.0
CATCH_UP_S = 5.0  # at a promotion, how long a spare takes in the steps already sent to it
POLL_S = 0.005
DROPPED = "dropped"  # the feeder's word, in the spare's sent key, that it no longer feeds it
FOLLOW_POLL_S = 0.05  # how often a waiting spare looks for a step sent to it (a store read; 5 ms at a promotion)
RECV_POLL_S = 0.0005  # how often a spare receiving a step looks whether it has arrived


class FeedBroken(RuntimeError):
    pass


def _why(e: BaseException) -> str:
    text = str(e).strip()
    if PEER_LOST.search(text):
        return "the other end went away"
    return _plain(text) if text else type(e).__name__


def _spares() -> int:
    return settings.current().spares


def _k() -> int:
    """The workers of a replica (--replica-size): worker j of a spare follows worker j of its feeder."""
    return settings.current().replica_size


def enabled(state: ReplicaState) -> bool:
    """Every replica that steps an optimizer feeds or follows when the run has spares: a sharded
    one (--replica-size K) shard by shard."""
    return _spares() > 0 and bool(state.optimizers) and not state.steps_apart


def _params(state: ReplicaState) -> List[torch.Tensor]:
    return [p for o in state.optimizers for g in o.param_groups for p in g["params"]]


def _buffers(state: ReplicaState) -> List[torch.Tensor]:
    return [b for m in state.models for b in m.buffers()]


def _bits_sum(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bits summed as 32-bit integers, wrapping (vectorised: 8 ms for 25M floats on one
    core, where an int64 accumulator took 230 ms)."""
    flat = t.detach()
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    flat = flat.contiguous().reshape(-1).view(torch.uint8)
    if flat.numel() % 4:
        return flat.sum(dtype=torch.int64).cpu()
    return flat.view(torch.int32).sum(dtype=torch.int32).to(torch.int64).cpu()


def fingerprint(state: ReplicaState) -> torch.Tensor:
    """Three int64 words over every parameter of the models and the optimizers' state, bit for bit
    (each tensor's bits summed as integers, then the sums counted and weighted by position). A
    DTensor counts by its local shard: no collective, and each shard pair compares its own."""
    sums = []
    for m in state.models:
        buffers = {n for n, _ in m.named_buffers()}  # not compared: a kept heal sends them (ReplicaState.capture)
        sums += [_bits_sum(_local(t)) for k, t in m.state_dict().items() if isinstance(t, torch.Tensor)
                 and k not in buffers]
    for o in state.optimizers:
        for _, st in sorted(o.state_dict()["state"].items()):
            sums += [_bits_sum(_local(v)) for _, v in sorted(st.items()) if isinstance(v, torch.Tensor)]
    if not sums:
        return torch.zeros(3, dtype=torch.int64)
    s = torch.stack(sums)
    return torch.stack([torch.tensor(len(sums)), s.sum(), (s * torch.arange(1, len(sums) + 1)).sum()])


def settings_of(state: ReplicaState) -> List[Dict[str, Any]]:
    """The optimizers' param groups' settings, as JSON (a scheduler changes them between steps)."""
    out = []
    for o in state.optimizers:
        for g in o.param_groups:
            d: Dict[str, Any] = {}
            for k, v in g.items():
                if k == "params":
                    continue
                if isinstance(v, torch.Tensor) and v.numel() == 1:
                    d[k] = {"tensor": v.item()}
                elif v is None or isinstance(v, (bool, int, float, str)):
                    d[k] = v
                elif isinstance(v, (tuple, list)) and all(isinstance(x, (bool, int, float)) for x in v):
                    d[k] = list(v)
            out.append(d)
    return out


def apply_settings(state: ReplicaState, settings: List[Dict[str, Any]]) -> None:
    groups = [g for o in state.optimizers for g in o.param_groups]
    if len(groups) != len(settings):
        raise FeedBroken(f"the feeder's optimizers have {len(settings)} param group(s), this replica's {len(groups)}")
    for g, d in zip(groups, settings):
        for k, v in d.items():
            mine = g.get(k)
            if isinstance(v, dict) and isinstance(mine, torch.Tensor):
                mine.fill_(v["tensor"])
            elif isinstance(mine, tuple) and isinstance(v, list):
                g[k] = tuple(v)
            else:
                g[k] = v


def _allreduce(pg: dist.ProcessGroup, t: torch.Tensor, op: Any) -> int:
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    pg.allreduce([t], opts).wait()
    return int(t.item())


def compare_fed(pg: dist.ProcessGroup, state: ReplicaState, source: bool, follower: Optional["Follower"],
                step: int) -> Optional[FedCompared]:
    """At a heal, before the transfer, on the source (`step`: the step its state is at) and on each
    healer of this group (one shard's, with sharded replicas): whether every healer is a spare
    whose feed followed (caught up to `step`), and whether their models and optimizers there are
    bit for bit the source's. One small collective when a healer was not fed. None in a run
    without spares (the same on every worker: nothing to compare). The member core decides what
    moves from the answer (core.keeps_fed_state)."""
    if not _spares():
        return None
    dev = group_device()
    follows = source or (follower is not None and follower.synced)
    if not _allreduce(pg, torch.tensor([int(follows)], dtype=torch.int64, device=dev), dist.ReduceOp.MIN):
        if follower is not None:
            follower.stop()
            follower.synced = False
        return FedCompared(followed=False, same=False)
    word = torch.zeros(4, dtype=torch.int64, device=dev)
    if source:
        word.copy_(torch.cat([fingerprint(state), torch.tensor([step])]))
    pg.broadcast(word, 0).wait()
    bad = 0
    if not source:
        assert follower is not None
        t0, held = time.monotonic(), follower.step
        target = int(word[3].item())
        follower.catch_up(target)
        t1 = time.monotonic()
        same = follower.synced and follower.step == target and torch.equal(fingerprint(state), word[:3].cpu())
        bad = int(not same)
        follower.log_detail(f"rank {follower.rank}: as a fed hot spare it held step {held}, took in "
                            f"{max(0, follower.step - held)} more in {t1 - t0:.2f} s; its model and optimizers "
                            f"{'match' if same else 'do not match'} those of step {target} "
                            f"(fingerprint {time.monotonic() - t1:.2f} s)")
        follower.synced = False  # its following is over: from here on the member's heals decide
    differ = _allreduce(pg, torch.tensor([bad], dtype=torch.int64, device=dev), dist.ReduceOp.MAX)
    return FedCompared(followed=True, same=not differ)


def agree_kept(pg: dist.ProcessGroup, keep: bool, source: bool,
               together: Optional[Callable[[bool], bool]] = None) -> bool:
    """The heal's one answer on whether the healers keep their state, from this shard's (`keep`,
    the member core's): a whole replica's is its own. A sharded replica keeps only if every shard
    does: on the source `together(keep)` gives the replica's one answer (replica_decides), which
    it sends to this shard's healers."""
    if _k() == 1:
        return keep
    word = torch.zeros(1, dtype=torch.int64, device=group_device())
    if source:
        assert together is not None
        try:
            word.fill_(int(together(keep)))
        except Exception:  # noqa: BLE001 - the store moved or broke: the whole state is always right
            word.fill_(0)
    pg.broadcast(word, 0).wait()
    return bool(word.item())


def replica_decides(store: Any, heal_prefix: str, rank: int, keep: bool, timeout_s: float) -> bool:
    """On each of the source replica's K workers, at a heal of a sharded replica: whether the
    healers keep their state, the same answer on all K. Each writes its shard's word; the first
    that has read all K (or that has a "no", or gave up waiting) fixes the replica's decision
    with a compare-and-set, which every other then reads. A shard that never writes (its
    transfer failed before it began: the round fails anyway) makes it "no" after `timeout_s`."""
    k = _k()
    base = heal_prefix.rstrip("/").rsplit("/", 2)[0] + "/keep/"  # pg/Q/R/ of the round, not of the shard
    first = (rank // k) * k
    words = [f"{base}{first + j}" for j in range(k)]
    store.set(f"{base}{rank}", "1" if keep else "0")
    decided = "0"
    deadline = time.monotonic() + timeout_s
    while keep:
        if store.check(words):
            decided = "1" if all(store.get(w) == b"1" for w in words) else "0"
            break
        if store.check([base + "replica"]) or time.monotonic() > deadline:
            break  # decided by another shard already (its word is read below), or given up
        time.sleep(POLL_S)
    return store.compare_set(base + "replica", "", decided) == b"1"


class _Feed:
    """One spare's feed on the feeder: the group, and the steps whose tensors are still leaving
    (at most IN_FLIGHT: a spare slower than the training replicas holds its feeder back there)."""

    def __init__(self, spare: int, pg: dist.ProcessGroup, store: Any, sent_key: str) -> None:
        self.spare, self.pg, self.store, self.sent_key = spare, pg, store, sent_key
        self.inflight: List[Tuple[List[Any], List[torch.Tensor]]] = []  # (works, their tensors) a step

    def send_step(self, state: ReplicaState, step: int) -> None:
        params = _params(state)
        grads = [p.grad for p in params]
        mask = torch.tensor([g is not None for g in grads], dtype=torch.uint8)
        tensors = [_local(g).detach().contiguous() for g in grads if g is not None]  # a DTensor: its shard
        tensors += [_local(b).detach().clone() for b in _buffers(state)]  # the next forward changes them in place
        blob = json.dumps(settings_of(state)).encode()
        hp = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        total = sum(t.numel() * t.element_size() for t in tensors)
        head = torch.tensor([MAGIC, step, len(blob), len(params), len(_buffers(state)), total], dtype=torch.int64)
        dev = group_device()
        out = [head.to(dev), mask.to(dev), hp.to(dev)] + [t for t in tensors if t.numel()]
        self.inflight.append(([self.pg.broadcast(t, 0) for t in out], out))
        # The spare receives only what it is told has been sent: a receive posted ahead and left
        # unmatched would hold its group's teardown for the whole timeout.
        self.store.set(self.sent_key, str(step))

    def free(self) -> None:
        """Let the group go on a thread of its own: gloo frees a group whose send was never
        received (a spare stopped, not dead) only after its whole timeout, which must not stall
        the feeder's training."""
        box = [self.pg, self.inflight]
        self.pg, self.inflight = None, []
        threading.Thread(target=box.clear, name="ftrun-feed-free", daemon=True).start()

    def left(self, timeout_s: float, most: int = 0) -> bool:
        """Whether the steps in flight are down to `most` within `timeout_s` (raises if one failed)."""
        deadline = time.monotonic() + timeout_s
        while len(self.inflight) > most:
            for w in self.inflight[0][0]:
                while not w.is_completed():
                    if time.monotonic() > deadline:
                        return False
                    time.sleep(POLL_S / 5)
                w.wait()
            self.inflight.pop(0)
        return True

    def writes_ahead(self, state: ReplicaState) -> bool:
        """Whether a tensor still leaving is a parameter's live gradient, which the next backward
        writes in place (gradients zeroed, not set to None; DDP's gradient_as_bucket_view)."""
        live = {_local(p.grad).data_ptr() for p in _params(state) if p.grad is not None and p.grad.numel()}
        return any(t.numel() and t.data_ptr() in live for _, tensors in self.inflight for t in tensors)


class Feeder:
    """On a training replica: the spares it feeds. Called after each step it takes and before
    each round's first collective."""

    def __init__(self, state: ReplicaState, rank: int, connect: Callable[[], Any],
                 log_detail: Callable[[str], None], chunk: int, timeout_s: float) -> None:
        self.state, self.rank, self.connect, self.log_detail = state, rank, connect, log_detail
        self.chunk, self.timeout_s = chunk, timeout_s
        self.world = settings.current().world_size or 1
        self.feeds: Dict[int, _Feed] = {}
        self.served: Dict[int, str] = {}  # spare rank -> the ask this feeder answered last
        self.next_look = 0.0
        self.store: Any = None
        self.spent, self.fed = 0.0, 0  # seconds this replica's training thread spent feeding, over `fed` steps

    def _feeds(self, quorum: Any, holds_state: bool) -> bool:
        """Whether this replica feeds the spares now (the quorum's feeder, holding the state); if
        not, every feed it had is dropped."""
        if not enabled(self.state):
            return False
        me = quorum.source(self.rank % _k()) if quorum is not None else None
        if me != self.rank or not holds_state:
            self.drop_all("this replica no longer feeds the spares")
            return False
        self._drop_members(quorum)
        return True

    def before_step(self, quorum: Any, holds_state: bool, step: int) -> None:
        """This replica is about to step its optimizers on step `step`'s gradients: each spare it
        feeds gets them now, with the settings and buffers, so that it steps its own optimizer
        beside this one instead of after it (promoted, a spare is then no optimizer step behind:
        seconds with a 100M model's Adam on a CPU, or an optimizer offloaded to the host)."""
        if not self.feeds or not self._feeds(quorum, holds_state):
            return
        t0 = time.perf_counter()
        for spare, feed in list(self.feeds.items()):
            try:
                if not feed.left(FEED_WAIT_S, most=IN_FLIGHT - 1):
                    self._drop(spare, f"it had not taken step {step - IN_FLIGHT} after {FEED_WAIT_S:g} s")
                    continue
                feed.send_step(self.state, step)
            except Exception as e:  # the spare died or was promoted: its feed ends, training goes on
                self._drop(spare, _why(e))
        if self.feeds:
            self._spent(time.perf_counter() - t0, step)

    def after_step(self, quorum: Any, holds_state: bool, round_: int, step: int, yielded: int) -> None:
        """This replica stepped its optimizers: a spare that asks to be fed starts from the state now."""
        if not self._feeds(quorum, holds_state):
            return
        now = time.monotonic()
        if now >= self.next_look:
            self.next_look = now + LOOK_S
            try:
                self._look(quorum, (round_, step, yielded))
            except Exception as e:  # the run's store moved or went away: the member's own loop deals with that
                self.store = None
                self.log_detail(f"rank {self.rank}: could not look for hot spares to feed: {_why(e)}")

    def settle(self, quorum: Any = None) -> None:
        """Before gradients are written again: the last step's feed has left, or is dropped."""
        if not self.feeds:
            return
        if quorum is not None:
            self._drop_members(quorum)
        t0 = time.perf_counter()
        for spare, feed in list(self.feeds.items()):
            try:
                if feed.writes_ahead(self.state) and not feed.left(FEED_WAIT_S):
                    self._drop(spare, f"its feed had not left after {FEED_WAIT_S:g} s")
            except Exception as e:
                self._drop(spare, _why(e))
        self.spent += time.perf_counter() - t0

    def _spent(self, seconds: float, step: int) -> None:
        """What feeding costs this replica's training thread, said every REPORT_EVERY steps."""
        self.spent += seconds
        self.fed += 1
        if self.fed >= REPORT_EVERY:
            self.log_detail(f"rank {self.rank}: feeding {len(self.feeds)} hot spare(s) took "
                            f"{1000 * self.spent / self.fed:.1f} ms a step of this replica's training thread "
                            f"over steps {step - self.fed + 1}-{step}")
            self.spent, self.fed = 0.0, 0

    def drop_all(self, why: str) -> None:
        for spare in list(self.feeds):
            self._drop(spare, why)

    def _drop_members(self, quorum: Any) -> None:
        for spare in [s for s in self.feeds if s in quorum.ranks]:
            self._drop(spare, "it trains now")

    def _drop(self, spare: int, why: str) -> None:
        feed = self.feeds.pop(spare, None)
        if feed is not None:
            abort_group(feed.pg)
            try:
                feed.store.set(feed.sent_key, DROPPED)  # a spare that was stopped learns it when it goes on
            except Exception:  # noqa: BLE001 - the store moved: the spare's feed breaks on its own
                pass
            feed.free()
            self.log_detail(f"rank {self.rank}: stopped feeding hot spare rank {spare}: {why}")

    def _look(self, quorum: Any, snapshot: Tuple[int, int, int]) -> None:
        if self.store is None:
            self.store = self.connect()
        for r in range(self.world):
            if r in quorum.ranks or r in self.feeds or not self.store.check([keys.feed_ask_key(r)]):
                continue
            ask = membership.read_now(self.store, keys.feed_ask_key(r))  # withdrawn since the check: None
            if ask is None or self.served.get(r) == ask:
                continue
            self.served[r] = ask
            if int(ask.split()[0]) == self.rank:
                self._open(r, ask, snapshot)

    def _open(self, spare: int, ask: str, snapshot: Tuple[int, int, int]) -> None:
        """Answer a spare's `ask` ("<feeder> <incarnation> <serial>"): the spare forms the group only
        once answered, so a feeder slow to answer (a long step, a heal) never meets a spare that
        gave up waiting, nor sends its state to an address no one listens on any more."""
        _, inc, serial = (int(x) for x in ask.split())
        t0 = time.monotonic()
        store = self.store
        ask_key, bound = keys.feed_ask_key(spare), min(FORM_S, self.timeout_s / 2)

        def gone() -> Optional[str]:
            if store.get(keys.inc_key(spare)).decode() != str(inc):
                return f"rank {spare} left"
            if membership.read_now(store, ask_key) != ask:
                return "it no longer asks"
            return "no answer" if time.monotonic() - t0 > bound else None

        pg = None
        try:
            store.set(keys.feed_answer_key(spare, inc, serial), str(self.rank))
            pg = build_group_watched(run_store(), keys.feed_prefix(spare, inc, serial), 0, 2, gone, POLL_S)
            stats = send_state(pg, self.state.capture(*snapshot), group_device(), chunk=self.chunk,
                               timeout_s=self.timeout_s)
        except Exception as e:  # the spare went away: it asks again if it is back
            abort_group(pg)
            self.log_detail(f"rank {self.rank}: could not start feeding hot spare rank {spare}: "
                            f"{_why(e)}")
            return
        self.feeds[spare] = _Feed(spare, pg, self.store, keys.feed_sent_key(spare, inc, serial))
        self.log_detail(f"rank {self.rank}: feeds hot spare rank {spare} from step {snapshot[1]} ("
                        f"{stats.bytes / 1e6:.1f} MB of state in {time.monotonic() - t0:.2f} s, then each step's "
                        f"gradients)")


class Follower:
    """On a waiting spare: asks the quorum's feeder for its state, then takes each step it sends,
    in the time the spare's wait to join would otherwise sleep."""

    def __init__(self, state: ReplicaState, rank: int, incarnation: Callable[[], int], connect: Callable[[], Any],
                 log_detail: Callable[[str], None], chunk: int, timeout_s: float) -> None:
        self.state, self.rank, self.incarnation = state, rank, incarnation
        self.connect, self.log_detail = connect, log_detail
        self.chunk, self.timeout_s = chunk, timeout_s
        self.pg: Any = None
        self._posted: List[Any] = []  # receives given up on a dead feeder, freed with the group
        self._feeder = ("", "")  # the feeder's incarnation key in the store, and the incarnation it fed from
        self.sent_key = ""
        self.synced = False  # the state is the feeder's as of `step`
        self.touched = False  # the feed has written into this replica's state since its last heal
        self.step = -1
        self.serial = 0
        # An ask not answered yet: (feeder, incarnation, quorum id, quorum, when asked).
        self.asked: Optional[Tuple[int, int, int, Any, float]] = None
        self.fails = 0
        self.retry_at = 0.0
        self.store: Any = None
        self.grads: List[torch.Tensor] = []
        self.refused = False  # the feed does not fit this replica (another layout): never asked for again
        self.took_s, self.stepped_s, self.taken = 0.0, 0.0, 0  # receiving, stepping, over `taken` steps

    def wait(self, seconds: float) -> None:
        """The spare's sleep between two looks at the quorums: spent following."""
        deadline = time.monotonic() + seconds
        if enabled(self.state) and not self.refused:
            try:
                if self.pg is None:
                    if self.asked is None and time.monotonic() >= self.retry_at:
                        self._ask()
                    if self.asked is not None:
                        self._start(deadline)
                else:
                    self._follow(deadline)
            except Exception as e:  # the feeder went away, or its state does not fit: ask again later
                self._broken(_why(e))
        rest = deadline - time.monotonic()
        if rest > 0:
            time.sleep(rest)

    def catch_up(self, step: int) -> None:
        """At a promotion: take in the steps up to `step` already sent, then stop following."""
        deadline = time.monotonic() + CATCH_UP_S
        try:
            while self.pg is not None and self.synced and self.step < step and time.monotonic() < deadline:
                self._follow(min(deadline, time.monotonic() + 0.05), until=step, poll_s=POLL_S)
        except Exception as e:
            self._broken(_why(e), quiet=True)
        self.stop()

    def healed(self) -> None:
        """A heal landed (kept or whole): the state is the source's, no longer the feed's."""
        self.touched = False

    def stop(self) -> None:
        if self.asked is not None:
            self.asked = None
            try:  # withdrawn: a feeder that reads it later does not answer it
                self.store.delete_key(keys.feed_ask_key(self.rank))
            except Exception:  # noqa: BLE001 - the store moved: the ask went with it
                pass
        if self.pg is not None:
            abort_group(self.pg)
            # Let it go on a thread of its own: gloo frees a group with a receive still posted (its
            # feeder died mid-step) only after its whole timeout, which must not hold a promotion.
            box = [self.pg, self._posted]
            threading.Thread(target=box.clear, name="ftrun-feed-free", daemon=True).start()
        self.pg, self._posted = None, []

    # ------------------------------------------------------------------ inside
    def _ask(self) -> None:
        """Ask the newest quorum's feeder of this worker's shard to feed this spare."""
        if self.store is None:
            self.store = self.connect()
        store, inc = self.store, self.incarnation()
        # LATEST is 0 from the keeper's start until its first quorum: a get of a key that is not
        # there waits for the store's whole timeout (600 s), deaf to the quorum this wait to join
        # is for (a first quorum waiting for a late worker stalled every other worker so).
        latest = int(membership.read_now(store, keys.LATEST) or 0)
        raw = membership.read_now(store, keys.quorum_key(latest)) if latest > 0 else None
        if raw is None:
            return
        quorum = Quorum.from_json(raw)
        feeder = quorum.source(self.rank % _k())
        if feeder is None or self.rank in quorum.ranks:
            return
        self.serial += 1
        store.set(keys.feed_ask_key(self.rank), f"{feeder} {inc} {self.serial}")
        self.asked = (feeder, inc, latest, quorum, time.monotonic())

    def _start(self, deadline: float) -> None:
        """Until `deadline`: once the feeder answered the ask, form the feed's group and take the
        whole state. The wait for the answer is this spare's (up to ASK_S, over as many calls as
        it takes), never the formation's: a feeder answers between its steps, and a step, or a heal
        it serves, may last longer than ftrun's timeout."""
        assert self.asked is not None
        store, (feeder, inc, latest, quorum, t0) = self.store, self.asked

        def gone() -> Optional[str]:
            if int(store.get(keys.LATEST)) != latest:
                return "a newer quorum is out"
            return membership.gone(store, quorum, [feeder]) or (
                f"rank {feeder} did not answer within {ASK_S:g} s" if time.monotonic() - t0 > ASK_S else None)

        answer = keys.feed_answer_key(self.rank, inc, self.serial)
        while not store.check([answer]):
            why = gone()
            if why:
                raise FeedBroken(why)
            if time.monotonic() >= deadline:
                return
            time.sleep(min(FOLLOW_POLL_S, max(0.0, deadline - time.monotonic())))
        self.asked = None  # answered: the feeder forms the group now
        self.synced = False
        self.touched = True  # from the first byte received, the state is the feed's, not the committed one
        self.sent_key = keys.feed_sent_key(self.rank, inc, self.serial)
        self.pg = build_group_watched(run_store(), keys.feed_prefix(self.rank, inc, self.serial), 1, 2, gone, 0.05)
        self._feeder = (keys.inc_key(feeder), str(quorum.incarnation(feeder)))
        payload, _stats, in_place = receive_state(self.pg, self.state.targets(), group_device(), chunk=self.chunk,
                                                  timeout_s=self.timeout_s)
        _, step, _, _ = self.state.restore(payload, in_place)
        self.step, self.synced, self.fails = step, True, 0
        self.log_detail(f"rank {self.rank}: a hot spare fed by rank {feeder} from step {step} (took its state in "
                        f"{time.monotonic() - t0:.2f} s)")

    def _follow(self, deadline: float, until: Optional[int] = None, poll_s: float = FOLLOW_POLL_S) -> None:
        """Take the steps sent until `deadline` (or step `until`), looking for them every `poll_s`."""
        while True:
            word = membership.read_now(self.store, self.sent_key) or "-1"
            if word == DROPPED:
                raise FeedBroken("its feeder stopped feeding it")
            sent = int(word)
            while self.step < sent:
                self._take()
                if (until is not None and self.step >= until) or time.monotonic() >= deadline:
                    return  # the wait to join looks at the quorums between two steps taken
            if time.monotonic() >= deadline:
                return
            time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))

    def _recv(self, t: torch.Tensor) -> None:
        """Receive `t` from the feeder. A feeder that died (the store says so) breaks the feed at
        once: gloo may fail a receive posted after its peer's connection closed only at the group's
        whole timeout (10 s), which held a promotion that long (a feeder killed as it stepped)."""
        work = self.pg.broadcast(t, 0)
        look = time.monotonic() + FOLLOW_POLL_S
        while not work.is_completed():
            if time.monotonic() >= look:
                look = time.monotonic() + FOLLOW_POLL_S
                if self.store.get(self._feeder[0]).decode() != self._feeder[1]:
                    self._posted.append(work)  # freed with the group, on its own thread (stop)
                    raise FeedBroken("its feeder is gone")
            time.sleep(RECV_POLL_S)
        work.wait()

    def _take(self) -> None:
        t0 = time.perf_counter()
        head = torch.zeros(HEAD, dtype=torch.int64, device=group_device())
        self._recv(head)
        magic, step, blob_len, n_params, n_buffers, total = (int(x) for x in head.tolist())
        params, buffers = _params(self.state), _buffers(self.state)
        if magic != MAGIC or n_params != len(params) or n_buffers != len(buffers):
            self.refused = True
            raise FeedBroken(f"the feed does not fit this replica ({n_params} parameters and {n_buffers} buffers "
                             f"sent, {len(params)} and {len(buffers)} here)")
        dev = group_device()
        mask = torch.zeros(n_params, dtype=torch.uint8, device=dev)
        self._recv(mask)
        blob = torch.zeros(blob_len, dtype=torch.uint8, device=dev)
        self._recv(blob)
        if not self.grads:
            self.grads = [torch.zeros_like(p) for p in params]  # a DTensor parameter's: a DTensor, same placements
        sent = [_local(g) for g, m in zip(self.grads, mask.tolist()) if m]  # each lands in its own shard
        buffers = [_local(b) for b in buffers]
        if sum(t.numel() * t.element_size() for t in sent + buffers) != total:
            self.refused = True
            raise FeedBroken("the feed's gradients do not fit this replica's parameters")
        for t in sent:
            if t.numel():
                self._recv(t)
        for b in buffers:
            if b.numel():
                landing = b if b.is_contiguous() else torch.empty_like(b)
                self._recv(landing.data)
                if landing is not b:
                    with torch.no_grad():
                        b.copy_(landing)
        # Until here only the buffers changed, which a kept heal sends anyway: a feeder that died
        # mid-send leaves this spare synced at its last step. From here until the step is taken,
        # the parameters and optimizers are neither old nor new.
        self.synced = False
        apply_settings(self.state, json.loads(bytes(blob.cpu().numpy()).decode()))
        t1 = time.perf_counter()
        for p, g, m in zip(params, self.grads, mask.tolist()):
            p.grad = g if m else None
        for o in self.state.optimizers:
            o.step()
        for p in params:
            p.grad = None
        self.step, self.synced = step, True
        self.took_s += t1 - t0
        self.stepped_s += time.perf_counter() - t1
        self.taken += 1
        if self.taken >= REPORT_EVERY:
            self.log_detail(f"rank {self.rank}: as a fed hot spare, steps {step - self.taken + 1}-{step} took "
                            f"{1000 * self.took_s / self.taken:.1f} ms a step to receive and "
                            f"{1000 * self.stepped_s / self.taken:.1f} ms to step its optimizers")
            self.took_s, self.stepped_s, self.taken = 0.0, 0.0, 0

    def _broken(self, why: str, quiet: bool = False) -> None:
        self.stop()
        self.store = None  # it may be the store that broke (a move): connect again
        was = self.synced  # kept: a state untouched since its last step taken may still match the source's
        self.fails += 1
        self.retry_at = time.monotonic() + min(30.0, 2.0 ** (self.fails - 1))
        if self.refused:
            self.log_detail(f"rank {self.rank}: its feed as a hot spare does not fit ({why}); it waits unfed and "
                            f"takes the whole state if promoted")
        elif not quiet:
            self.log_detail(f"rank {self.rank}: its feed as a hot spare broke ({why}); "
                            f"{'it held step ' + str(self.step) + ', ' if was else ''}asking again in "
                            f"{self.retry_at - time.monotonic():.0f} s")
