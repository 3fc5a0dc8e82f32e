"""The replica's side of --ft: join, vote on every step, switch quorums, heal from a peer.

A round is one attempt at a step. Each member adds its vote (ok, or failed)
to the round's counter in the store, one round trip; the member whose vote
completes the count writes the decision (commit when no vote failed, and
the newest quorum it has seen), and the others read it, so all members
decide alike and the store does O(1) work per member. A member whose
collectives succeeded steps at once and reads the decision during the next
round, before that round's first collective; one whose action the decision
contradicts heals again, in its own process as its next incarnation (a
sharded replica, or one on several nodes, restarts and heals). A member that died never votes: the
supervisor, which sees the death within milliseconds, abstains for it.
Members switch to the quorum a decision names at one boundary: the round
after next for a commit (read late), the next for a failed round (read at
once by everyone who goes on); a thread learns of new quorums as they are
published, so no step asks. A new or restarted replica asks to join, is
put into a quorum as a healer, and receives the model, optimizer and
registered state from a peer over a process group (ft/heal/transport.py), before
the round's forward pass. With --checkpoint-dir the replica at index 0
writes the committed state to disk every N steps (ft/checkpoint/schedule.py), and
the source of a fresh quorum (no member holds trained state) first loads the
newest checkpoint, so the heal spreads it.

With --replica-size K a replica is K workers sharding the model (FSDP2 over
the replica's own group, `device_mesh()`). Every worker is a member and
votes; worker j of each live replica forms the quorum's group of shard index
j, over which its gradient shard is averaged (ft/api/sharded.py) and its shard
of the state is healed, from worker j of one source replica.
Must never raise a collective failure into the user's loop, and never import
the supervisor.
"""

from __future__ import annotations

import datetime
import math
import os
import time
from typing import Any, Callable, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from ftrun import exits, keys, pacing
from ftrun.wire import MemberReport
from ftrun.worker.ft.checkpoint.schedule import Checkpointer
from ftrun.worker.ft.member.driver import MemberDriver
from ftrun.worker.ft.member.moves import RELOCATE_S
from ftrun.worker.ft.member.torch_effects import TorchEffects
from ftrun.worker.ft.member.member_io import _log, _log_detail, leave
from ftrun.worker.ft.heal.state import ReplicaState
from ftrun.worker import settings
from ftrun.worker.settings import store_moved


class Manager:
    """One per worker process; created by ftrun.ft on first use. The script's side of the member:
    what it registers, the replica's own mesh, and the calls of ft.steps(), ft.Optimizer and
    ft.DataLoader, each handed to the member's driver (member/driver.py), which owns the
    protocol's state."""

    def __init__(self) -> None:
        store_addr = os.environ.get("FTRUN_STORE")
        if store_addr and os.environ.get("FTRUN_FT") != "1":
            # Under ftrun without --ft: the same in every worker, on every restart. One line, the run stops.
            leave(exits.EXIT_CANNOT_GO_ON,
                  f"rank {os.environ.get('RANK', '?')}: this script uses ftrun.ft, which needs replica fault "
                  f"tolerance: add --ft to the ftrun command line (or drop ftrun.ft for group restarts)")
        if not store_addr:
            raise RuntimeError("ftrun.ft needs to run under `ftrun --ft` (FTRUN_STORE and FTRUN_FT=1 are not set)")
        rank = int(os.environ["RANK"])
        k = settings.current().replica_size
        self.state = ReplicaState()  # what a heal moves (ft/heal/state.py)
        self.fx = TorchEffects(self.state, rank, datetime.timedelta(
            seconds=float(os.environ.get("FTRUN_FT_VOTE_TIMEOUT", "600"))))
        # On several nodes this member votes through its node's store (vote.Node). On three nodes
        # or more the run's store may move (ftrun/supervisor/nodes/failover.py), and the node's ftrun says
        # where in that same store.
        store_gen = 0
        moved = self.fx.announced_store()
        if moved is not None:  # started just before a move: the address it was given is gone
            store_gen, store_addr = moved
            store_moved(store_addr)
        nodes = 1 if keys.relayed_node(os.environ) is None and os.environ.get("GROUP_WORLD_SIZE", "1") == "1" else 2
        # Durable state (--checkpoint-dir): saved at the top of the round after a due commit,
        # before any switch, so it is exactly the state of the step just committed.
        checkpoints = Checkpointer.from_env(rank, rank % k, k, _log, _log_detail)
        self.member = self._start_member(rank, k, nodes, checkpoints, store_gen)
        self.mesh: Any = None  # the replica's own DeviceMesh (device_mesh())
        self.optimizer_wrapped = False  # ft.Optimizer was made (one per run: ft/api/optim.py)
        self.loaders: List[Any] = []  # every ft.DataLoader (ft/api/data.py), in the order made
        self.epochs_state: Any = None  # ft.epochs()' registered quorum (ft/api/data.py), once asked for
        # Called before this member votes on a step, where a small collective of the step may be
        # made (its failure votes the round down): an ft.DataLoader over a stream exchanges its
        # shards' positions there (ft/api/stream.py).
        self.vote_listeners: List[Callable[[], None]] = []
        self.looked = False  # the script's frames were searched for unregistered state (look_for_state)
        if self.fx.progress is not None:
            self.fx.progress.info_provider = self.member.info

    def _start_member(self, rank: int, k: int, nodes: int, checkpoints: Any, store_gen: int) -> MemberDriver:
        """The member, connected to the run's store. The store may go away as this worker starts,
        before its node's ftrun says where the next one is: the member then connects there, as one
        that loses the store later does (member/moves.py)."""
        deadline = time.monotonic() + RELOCATE_S
        while True:
            try:
                return MemberDriver(self.fx, rank, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), k,
                                    nodes, checkpoints, self.state, store_gen, pacing.check_s_from_env(os.environ)[0])
            except TorchEffects.store_errors:
                if self.fx.node() is None or not self.fx.store_gone():
                    raise
            moved = self.fx.announced_store()
            while (moved is None or moved[0] <= store_gen) and time.monotonic() < deadline:
                time.sleep(0.05)
                moved = self.fx.announced_store()
            if moved is None or moved[0] <= store_gen:
                self.fx.restart(f"rank {rank}: the run's store went away as this worker started, and no new one "
                                f"was announced within {RELOCATE_S:g} s; exiting")
            store_gen = moved[0]
            self.fx.store_moved(moved[1])

    # ------------------------------------------------------------ registration
    def register_model(self, model: torch.nn.Module) -> None:
        self.state.add_model(model)

    def register_optimizer(self, opt: torch.optim.Optimizer) -> None:
        self.state.add_optimizer(opt)

    def register_state(self, name: str, obj: Any, compare: bool = True) -> None:
        self.state.add_extra(name, obj, compare)

    def look_for_state(self, frame: Any) -> None:
        """At the loop's first start in this process: register the state the script keeps in its
        frames that no registration covers (ft/heal/found.py), and say once what was found."""
        if self.looked:
            return
        self.looked = True
        from ftrun.worker.ft.heal import found as finder

        objects, loose = finder.find(self.state, frame)
        names = finder.register(self.state, objects)
        say = _log if self.rank % max(1, self.k) == 0 and self.replica == 0 else _log_detail
        if names:
            what = ", ".join(f"{n} ({type(o).__name__})" for n, o in objects)
            say(f"heals and checks state the script keeps but did not register: {what} (found by name; "
                f"ft.register_state(name, obj) names it yourself)")
        if loose:
            say(f"modules that hold state no heal carries (found in memory, not by a name in the script): "
                f"{', '.join(loose)}: a restarted replica keeps them as its script made them; register each with "
                f"ft.register_state(name, obj)")

    def several_optimizers(self) -> None:
        """A second ft.Optimizer: each step of one is a sub-step of the loop's step
        (member/iteration.py). Hot spares then take the whole state at a promotion instead of being
        fed each step (a feed steps every optimizer at once)."""
        self.member.several_optimizers()
        self.state.steps_apart = True

    def on_group_change(self, fn: Callable[[Optional[dist.ProcessGroup]], None]) -> None:
        self.fx.group_listeners.append(fn)

    @property
    def step_listeners(self) -> List[Callable[[], None]]:
        return self.fx.step_listeners

    # ------------------------------------------------------------ what the script reads
    rank = property(lambda self: self.member.rank)
    inc = property(lambda self: self.member.inc)
    k = property(lambda self: self.member.k)
    replica = property(lambda self: self.member.replica)
    shard = property(lambda self: self.member.shard)
    quorum = property(lambda self: self.member.quorum)
    step = property(lambda self: self.member.step)
    pg = property(lambda self: self.member.pg)
    round_ok = property(lambda self: self.member.round_ok)
    in_sync = property(lambda self: self.member.in_sync)
    finished = property(lambda self: self.member.finished)
    num_replicas = property(lambda self: self.member.num_replicas)
    replica_index = property(lambda self: self.member.replica_index)
    redo = property(lambda self: self.member.redo)
    step_serial = property(lambda self: self.member.step_serial)
    phase = property(lambda self: self.member.phase)
    phase_since = property(lambda self: self.member.phase_since)
    heals = property(lambda self: self.member.heals.count)
    last_heal_s = property(lambda self: self.member.heals.last_heal_s)
    last_transfer = property(lambda self: self.member.heals.last_transfer)
    committed = property(lambda self: self.member.committed)
    discarded = property(lambda self: self.member.discarded)
    checkpoints = property(lambda self: self.member.checkpoints)
    store = property(lambda self: self.member.store)

    @property
    def sub_steps(self) -> int:
        """With several ft.Optimizers: the sub-steps of the current loop step the script asked for."""
        return self.member.iteration.index

    @property
    def step_voted_down(self) -> bool:
        """With several ft.Optimizers: a sub-step of the current loop step was voted down, so the
        step is handed out again at the next begin_step(), its committed sub-steps skipped."""
        return self.member.iteration.failed

    @property
    def looping(self) -> bool:
        return self.member.looping

    @looping.setter
    def looping(self, value: bool) -> None:  # ft.epochs() (ft/api/data.py) drives the loop itself
        self.member.set_looping(value)

    def info(self) -> MemberReport:
        return self.member.info()

    # ------------------------------------------------------------ layout rounds (ft/api/ddp.py)
    layout_round = property(lambda self: self.member.layout.round)
    layout_serial = property(lambda self: self.member.layout.serial)
    layout_planned = property(lambda self: self.member.layout.planned)
    layout_averages = property(lambda self: self.member.layout.averages)

    @property
    def uses_ddp(self) -> bool:
        return self.member.layout.uses_ddp

    @uses_ddp.setter
    def uses_ddp(self, value: bool) -> None:
        self.member.layout.use_ddp(value)

    @property
    def layout_each_group(self) -> bool:
        return self.member.layout.each_group

    @layout_each_group.setter
    def layout_each_group(self, value: bool) -> None:
        self.member.layout.reducer_sends(value)

    def layout_can_average(self) -> bool:
        return self.member.layout.can_average()

    def layout_average(self, averages: List[Optional[Callable[[], None]]]) -> None:
        self.member.layout.average(averages, self.member.pg, self.member.fail_round)

    # ------------------------------------------------------------ the loop
    def steps(self, total: int) -> Iterator[int]:
        """Yield the global step until `total` steps are committed (by any replica)."""
        return self.member.steps(total)

    def begin_step(self) -> None:
        """The top of a step for a loop that ft.steps() does not drive (ft.DataLoader, ft.epochs()):
        the round's top runs once per step, at the first of them that asks."""
        if not self.member.looping:
            self._misused("an ft.DataLoader was iterated outside an ftrun.ft loop: drive the training loop "
                          "with ft.epochs() (`for epoch in ft.epochs(n): for batch in loader: ...`) or ft.steps()")
        if not self.member.step_open:
            self.member.start_round()

    def start_round(self) -> None:
        self.member.start_round()

    def finish_loop(self) -> None:
        self.member.finish_loop()

    def close_round(self) -> None:
        self.member.close_round()

    def before_collective(self) -> None:
        self.fx.feeder.settle(self.member.quorum)  # the last step's feed leaves before gradients change
        self.member.before_collective()

    def feeding(self) -> None:
        """Before this replica steps its optimizers: the hot spares it feeds get the step (ft/heal/feed.py)."""
        m = self.member
        self.fx.feeder.before_step(m.quorum, m.in_sync and m.heals.holds_state(), m.step)

    def fed(self) -> None:
        """After this replica stepped its optimizers: a spare that asks now is fed from here."""
        m = self.member
        self.fx.feeder.after_step(m.quorum, m.in_sync and m.heals.holds_state(), m.round, m.step, m.yielded)

    def vote(self) -> bool:
        for fn in self.vote_listeners:
            fn()
        return self.member.vote()

    def fail_round(self, why: str = "") -> None:
        self.member.fail_round(why)

    def abandoned(self) -> Optional[str]:
        """Why the open step's round can no longer commit (a peer is gone), or None: asked inside a backward."""
        return self.member.abandoned()

    def _misused(self, why: str) -> None:
        self.member.misused(why)

    # ------------------------------------------------------------ the replica's own workers
    def device_mesh(self, mesh_shape: Optional[Tuple[int, ...]] = None,
                    mesh_dim_names: Optional[Tuple[str, ...]] = None) -> Any:
        """The replica's K workers as a DeviceMesh, over a default process group of just them,
        built once per incarnation (a replica restarts whole, so it never needs rebuilding)."""
        if self.mesh is not None:
            return self.mesh
        from torch.distributed.device_mesh import init_device_mesh

        k = self.k
        shape = tuple(mesh_shape) if mesh_shape else (k,)
        if any(not isinstance(n, int) or n < 1 for n in shape) or math.prod(shape) != k:
            raise ValueError(f"ftrun.ft.device_mesh({shape}): the shape must multiply to the replica's "
                             f"{k} workers (--replica-size {k})")
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if dist.is_initialized():
            if dist.get_world_size() != k:
                raise RuntimeError(
                    f"ftrun.ft.device_mesh(): a process group of {dist.get_world_size()} workers is already "
                    f"initialized; under --ft the default group must be this replica's {k} workers. "
                    f"Drop the script's init_process_group() call: ftrun.ft.device_mesh() makes it")
        else:
            from ftrun.worker.ft.api.world import torch_init_process_group

            # torch's own call, not the script's wrapped one (world.py), which a restarted replica skips.
            store = dist.PrefixStore(keys.replica_prefix(self.replica, self.inc), self.member.store)
            torch_init_process_group()("cpu:gloo,cuda:nccl" if cuda else "gloo", store=store, rank=self.shard,
                                       world_size=k)
        self.mesh = init_device_mesh("cuda" if cuda else "cpu", shape, mesh_dim_names=mesh_dim_names)
        return self.mesh


_manager: Optional[Manager] = None


def manager() -> Manager:
    global _manager
    if _manager is None:
        _manager = Manager()
    return _manager
