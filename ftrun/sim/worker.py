"""One simulated worker process of --ft: the product's own member driver
(ftrun.worker.ft.member.driver.MemberDriver, or a historic bug's subclass of it) over this
module's effects: the simulator's in-memory store, its process groups, its scheduler's threads
and virtual clock. The model is a digest of the rounds it stepped on (its lineage: the fresh
quorum its state descends from), which a heal moves. The script is the loop of ft.steps(): a
compute, the collective, opt.step(). Nothing here decides: the driver and member/core.py do.
Must never be imported by the product.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Dict, Optional, Set, Tuple

from ftrun import exits, keys, pacing
from ftrun.sim.checkpoint import Marker, SimCheckpointer
from ftrun.sim.sched import SimKilled
from ftrun.sim.store import DistStoreError
from ftrun.wire import MemberReport, Quorum
from ftrun.worker.ft.member import vote
from ftrun.worker.ft.member.driver import MemberDriver
from ftrun.worker.ft.member.effects import FedCompared, MemberEffects, Snapshot

POLL_S = 0.02  # the member's store polls (the product's 5 ms, coarser: fewer simulated turns)
REPORT_S = 0.25  # keys.HEARTBEAT_S: the status report the keeper reads
VOTE_TIMEOUT_S = 600.0  # FTRUN_FT_VOTE_TIMEOUT's default: the member's store client timeout


class SimExit(BaseException):
    """The member exits (os._exit in the product): restart (75) or finished (0)."""

    def __init__(self, code: int, why: str, by_peers: bool = False) -> None:
        super().__init__(why)
        self.code, self.why, self.by_peers = code, why, by_peers


class TransferBroken(Exception):
    """A heal's group broke: an end died or left."""


class SimSignal:
    """threading.Event over the scheduler: wait() is a yield point; set() wakes the waiter."""

    __slots__ = ("sched", "flag", "waiter")

    def __init__(self, sched: Any) -> None:
        self.sched = sched
        self.flag = False
        self.waiter: Any = None

    def set(self) -> None:
        self.flag = True
        if self.waiter is not None:
            self.sched.wake(self.waiter)

    def clear(self) -> None:
        self.flag = False

    def is_set(self) -> bool:
        return self.flag

    def wait(self) -> None:
        sched = self.sched
        if self.flag:
            sched.block()  # still a yield point: others may run first
            return
        self.waiter = sched.current
        try:
            while not self.flag:
                sched.park()
        finally:
            self.waiter = None


class SimWorker(MemberEffects):
    """A worker process: the product's driver, and the effects it runs over."""

    store_errors = (DistStoreError, vote.StoreMovedMidVote)
    poll_s = POLL_S

    def __init__(self, world: Any, rank: int, inc: int) -> None:  # sim/world.World, which imports this module
        self.w, self.rank = world, rank
        self.sched = world.sched
        self.proc = f"r{rank}.{inc}"
        self.digest = "0"
        self.lineage = 0  # the fresh quorum this state descends from (a run with nobody holding its state starts again)
        # Rounds stepped on whose decision is not in yet: how many of their steps it took.
        self.stepped: Dict[Tuple[int, int], int] = {}
        self._after: Dict[Tuple[int, int], Tuple[int, int, str]] = {}  # round -> (lineage, step, digest) after it
        # (lineage, step, state) whose side effects the script ran: its own, or its heal's source's.
        self.effects: Set[Tuple[int, int, str]] = set()
        # A hot spare's feed (ftrun/worker/ft/heal/feed.py, simulated): it follows the training
        # replicas' committed states while the keeper holds this replica back, and its state is
        # then not the committed one until a heal says so (fed()).
        self.following = False
        # Where the run's store is, as this node's ftrun told the process when it started it (the
        # environment's FTRUN_STORE, and the generation of a store that moved before it started).
        gen, self._addr = world.supervisor.node_run.get(world.node_of(rank), (0, world.first_addr))
        every = world.sch.checkpoint_every
        ck = SimCheckpointer(self, world.checkpoints, every) if every else None
        self.driver: MemberDriver = world.bugs.driver(self, rank, inc, world.k, world.nodes, checkpoints=ck,
                                                      check_s=pacing.CHECK_S if world.sch.check_every else 0.0,
                                                      store_gen=gen)

    # ------------------------------------------------------------ what the world reads
    inc = property(lambda self: self.driver.inc)
    step = property(lambda self: self.driver.step)
    phase = property(lambda self: self.driver.phase)
    in_sync = property(lambda self: self.driver.in_sync)
    store = property(lambda self: self.driver.store)

    def info(self) -> MemberReport:
        return self.driver.info()

    # ------------------------------------------------------------ the process
    def main(self) -> None:
        try:
            self.sched.spawn(self._report, "report", self.proc)
            self._script()
            self.w.supervisor.on_member_exit(self, 0, "finished")
        except SimExit as e:
            self.w.supervisor.on_member_exit(self, e.code, e.why, e.by_peers)
        self.sched.kill(self.proc)  # its other threads end with the process
        self.w.groups.died()  # its peers' collectives fail (a reset connection)
        raise SimKilled()

    def _script(self) -> None:
        """The training script: ft.steps(), a compute, the collective (DDP's hook), opt.step();
        with several optimizers (Schedule.sub_steps) that many of them each step, one after another."""
        d, w = self.driver, self.w
        rng = self.sched.rng
        subs = max(1, w.sch.sub_steps)
        if subs > 1:
            d.several_optimizers()
        for _ in d.steps(w.total):
            w.invariants.check_handout(self)
            for _ in range(subs):
                self.sched.sleep(w.step_s * (0.5 + rng.random()) / subs)  # the forward and backward passes
                d.before_collective()
                if d.pg is not None and d.round_ok:  # what it sends is checked (a failed round sends nothing)
                    if d.rejoin_why is None:
                        w.invariants.check_state(self)
                    err = w.groups.allreduce(self, d.pg, "step")
                    if err:
                        d.fail_round(err)
                elif subs > 1 and d.quorum is not None:  # DDP's forward: with no group it sends nothing, and fails
                    d.fail_round()
                d.vote()

    def _report(self) -> None:
        """The status report the keeper reads (ftrun/worker/progress.py's, through the node's store)."""
        beat = 0
        node = self.node()
        store = self.connect() if node is None else node.store
        while True:
            beat += 1
            try:
                # The product's report (ftrun/worker/progress.py: the driver's info with the beat
                # replaced), encoded by the product; the beat is set on the fresh report itself,
                # which nothing else holds, without a copy of every field (dataclasses.replace).
                report = self.driver.info()
                object.__setattr__(report, "beat", beat)
                store.set(keys.info_key(self.rank), report.encode())
            except Exception:  # noqa: BLE001 - the store is down: go on beating
                pass
            if self.w.sch.spares and not self.following:
                sup = self.w.supervisor
                keeper = sup.node_keeper.get(sup.host)
                self.following = keeper is not None and keeper.held.get(self.rank) == self.inc
            self.sched.sleep(REPORT_S)

    # ------------------------------------------------------------ effects: store, clock, threads, exits
    def connect(self, timeout_s: Optional[float] = None) -> Any:
        return self.w.stores[self._addr].client(VOTE_TIMEOUT_S if timeout_s is None else timeout_s)

    def store_gone(self) -> bool:
        return self.w.stores[self._addr].gone

    def announced_store(self) -> Optional[Tuple[int, str]]:
        """What this node's ftrun wrote in its store after the run's store moved (keys.RUN_STORE)."""
        node = self.node()
        if node is None or not node.store.check([keys.RUN_STORE]):
            return None
        gen, where = node.store.get(keys.RUN_STORE).decode().split()
        return int(gen), where

    def store_address(self) -> str:
        return self._addr

    def store_moved(self, addr: str) -> None:
        self._addr = addr

    def node(self) -> Optional[vote.Node]:
        n = self.w.node_of(self.rank)
        if n == 0:
            return None
        per = self.w.per_node
        return vote.Node(n, n * per, per, self.w.node_store[n].client(VOTE_TIMEOUT_S))

    def now(self) -> float:
        return self.sched.now

    def sleep(self, seconds: float) -> None:
        self.sched.sleep(seconds)

    def spawn(self, fn: Callable[[], None], name: str, low_priority: bool = False) -> None:
        self.sched.spawn(fn, name, self.proc)

    def signal(self) -> SimSignal:  # type: ignore[override]
        return SimSignal(self.sched)

    def exit(self, code: int, line: str = "") -> Any:
        raise SimExit(code, line)

    def restart(self, line: str, peers_decided: str = "") -> Any:
        raise SimExit(exits.EXIT_REPLICA_RESTART, line, by_peers=bool(peers_decided))

    def log(self, msg: str) -> None:
        self.w.log.append(f"{self.sched.now:.3f}s {msg} (step {self.driver.step})")

    # ------------------------------------------------------------ effects: groups and the state
    def form_group(self, prefix: str, quorum: Quorum, ranks: list, give_up: Callable[[], Optional[str]]) -> Any:
        g = self.w.groups.form(self, prefix, ranks, give_up)
        if g is None:
            raise TransferBroken(f"gave up forming {prefix}")
        return g

    def drop_group(self, group: Any) -> None:
        self.w.groups.leave(self, group)

    def _heal_kill(self) -> None:
        if self.w.faults.heal_kill.pop(self.rank, None) is not None:
            self.w.supervisor.kill(self.rank)
            self.sched.sleep(0.0)

    def fed(self) -> bool:
        return self.following

    def compare_fed(self, group: Any, sending: bool, step: int) -> Optional[FedCompared]:
        """The heal's ends compare the healers' fed states in one collective: each healer that
        followed catches up to the source's step (the committed state there), unless its feed
        wrote something else (a feed-bad fault); the result, computed once, is every end's."""
        if not self.w.sch.spares:
            return None
        i = group.seq.get(self.rank, 0)
        word = (self.lineage, self.driver.step, self.digest) if sending else (self.following,)
        group.fed.setdefault(i, {})[self.rank] = (sending, word)
        if self.w.groups.allreduce(self, group, "fed"):
            raise TransferBroken("a peer left mid-comparison")
        found = group.fed_found.get(i)
        if found is None:
            words = group.fed[i]
            src = next(w for s, w in words.values() if s)
            committed = self.w.invariants.committed.get((src[0], src[1]))
            healers = [r for r, (s, _) in words.items() if not s]
            followed = all(words[r][1][0] for r in healers)
            held = {r: ("bad" if self.w.faults.feed_bad.get(r) else committed) for r in healers}
            same = followed and all(h == src[2] for h in held.values())
            found = group.fed_found[i] = (FedCompared(followed, same), src[2], held)
        if not sending:
            self.following = False  # its following is over: from here on the member's heals decide
        return found[0]

    def send_state(self, group: Any, snapshot: Snapshot, kept: bool) -> Any:
        """The state moves in two collectives: a receiver's tensors are written between them."""
        self._heal_kill()
        quorum = self.driver.quorum
        if not quorum.fresh and not self.driver.in_sync:
            self.w.invariants.violation(f"rank {self.rank} sends its state in quorum {quorum.id} while not in sync")
        self.w.invariants.check_source(self, quorum)
        lineage = quorum.id if quorum.fresh else self.lineage  # a fresh quorum's source starts a new one
        group.payload = (snapshot, self.digest, lineage, frozenset(self.effects))
        for _ in range(2):
            if self.w.groups.allreduce(self, group, "heal"):
                raise TransferBroken("a peer left mid-transfer")
        self.lineage = lineage
        return None

    def receive_state(self, group: Any, on_write: Callable[[], None], kept: bool) -> Tuple[Snapshot, Any]:
        self._heal_kill()
        if self.w.groups.allreduce(self, group, "heal"):
            raise TransferBroken("a peer left mid-transfer")
        on_write()
        self.sched.sleep(0.001)  # the bulk of the transfer
        if self.w.groups.allreduce(self, group, "heal"):
            raise TransferBroken("a peer left mid-transfer")
        snapshot, self.digest, self.lineage, effects = group.payload
        if kept:  # its fed models and optimizers stay: what it holds is what its feed wrote
            mine = group.fed_found[max(group.fed_found)][2].get(self.rank)
            if mine != self.digest:
                self.w.invariants.violation(f"rank {self.rank} keeps a fed state ({mine}) unlike its heal's source's "
                                            f"({self.digest}) in {group.key}")
                self.digest = mine or self.digest
        self.following = False
        self.effects = set(effects)
        self.stepped = {}
        self._after.clear()
        return snapshot, None

    def compare_states(self, group: Any) -> Tuple[Tuple[Tuple[int, Tuple[int, ...]], ...], Tuple[Tuple[int, str], ...]]:
        """The guard's check: each member's digest, gathered. Members in sync always agree: a
        check that finds them differing is the protocol's fault (a violation)."""
        i = group.seq.get(self.rank, 0)
        group.prints.setdefault(i, {})[self.rank] = int(self.digest, 16)
        if self.w.groups.allreduce(self, group, "check"):
            raise TransferBroken("a peer left mid-check")
        prints = tuple(sorted((r, (d,)) for r, d in group.prints[i].items()))
        if len({fp for _, fp in prints}) > 1:
            self.w.invariants.violation(f"the guard found states that differ in {group.key} at rank {self.rank}'s step "
                             f"{self.driver.step}: {prints}")
        return prints, ()

    def loaded(self, marker: Marker) -> None:
        """A resume read checkpoint `marker` into this worker's objects (sim/checkpoint.py)."""
        self.w.invariants.check_resume(self, marker)
        self.lineage, _, self.digest, _ = marker
        self.stepped = {}
        self._after.clear()

    # ------------------------------------------------------------ effects: what the script sees
    def took_sub_step(self, quorum: int, rnd: int) -> None:
        self.digest = hashlib.blake2b(f"{self.digest}/{quorum}/{rnd}/s".encode(), digest_size=6).hexdigest()
        self.stepped[(quorum, rnd)] = self.stepped.get((quorum, rnd), 0) + 1  # a round keeps sub-steps

    def took_step(self, quorum: int, rnd: int, step: int) -> None:
        if self.w.sch.sub_steps < 2:  # with sub-steps, each changed the state (and counts) as it was taken
            self.digest = hashlib.blake2b(f"{self.digest}/{quorum}/{rnd}".encode(), digest_size=6).hexdigest()
            self.stepped[(quorum, rnd)] = self.stepped.get((quorum, rnd), 0) + 1
        self._after[(quorum, rnd)] = (self.lineage, step, self.digest)

    def decided(self, quorum: int, rnd: int, commit: bool) -> None:
        after = self._after.pop((quorum, rnd), None)
        if not commit or after is None:
            return  # voted down after it stepped: it takes the committed state again
        self.w.invariants.note_commit(self, quorum, rnd, after)
        self.stepped.pop((quorum, rnd), None)
