"""The replica's side of --ft: join, vote on every step, switch epochs, heal from a peer.

A round is one attempt at a step. Each member adds its vote (ok, or failed)
to the round's counter in the store, one round trip; the member whose vote
completes the count writes the decision (commit when no vote failed, and
the newest epoch it has seen), and the others read it, so all members
decide alike and the store does O(1) work per member. A member whose
collectives succeeded steps at once and reads the decision during the next
round, before that round's first collective; one whose action the decision
contradicts heals again, in its own process as its next incarnation (a
sharded replica, or one on several nodes, restarts and heals). A member that died never votes: the
supervisor, which sees the death within milliseconds, abstains for it.
Members switch to the epoch a decision names at one boundary: the round
after next for a commit (read late), the next for a failed round (read at
once by everyone who goes on); a thread learns of new epochs as they are
published, so no step asks. A new or restarted replica asks to join, is
put into an epoch as a healer, and receives the model, optimizer and
registered state from a peer over a process group (ft/transport.py), before
the round's forward pass. With --checkpoint-dir the replica at index 0
writes the committed state to disk every N steps (ft/checkpoint.py), and
the source of a fresh epoch (no member holds trained state) first loads the
newest checkpoint, so the heal spreads it.

With --replica-size K a replica is K workers sharding the model (FSDP2 over
the replica's own group, `device_mesh()`). Every worker is a member and
votes; worker j of each live replica forms the epoch's group of shard index
j, over which its gradient shard is averaged (ft/sharded.py) and its shard
of the state is healed, from worker j of one source replica.
Must never raise a collective failure into the user's loop, and never import
the supervisor.
"""

from __future__ import annotations

import datetime
import math
import os
import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from ftrun import protocol as keys
from ftrun.protocol import Epoch
from ftrun.worker.ft import vote
from ftrun.worker.ft.checkpoint import Checkpointer
from ftrun.worker.ft.epochs import Epochs
from ftrun.worker.ft.healing import Healing
from ftrun.worker.ft.member.core import ClosedOk, Computing, Join, MemberCore, RoundTop, core_field, rejoins_in_place
from ftrun.worker.ft.member_io import _env_number, _log, _log_detail, leave
from ftrun.worker.ft.relocation import StoreMoves
from ftrun.worker.ft.rounds import Rounds
from ftrun.worker.ft.state import ReplicaState
from ftrun.worker.ft.stopping import Stopping
from ftrun.worker.settings import store_moved

class Manager(StoreMoves, Epochs, Healing, Rounds, Stopping):
    """One per worker process; created by ftrun.ft on first use."""

    epoch = core_field("epoch")
    round = core_field("round")
    group_round = core_field("group_round")
    round_ok = core_field("round_ok")
    in_sync = core_field("in_sync")
    finished = core_field("finished")
    target_epoch = core_field("target_epoch")
    switch_round = core_field("switch_round")
    rebuild = core_field("rebuild")
    failed_in_row = core_field("failed_in_row")

    def __init__(self) -> None:
        store_addr = os.environ.get("FTRUN_STORE")
        if store_addr and os.environ.get("FTRUN_FT") != "1":
            # Under ftrun without --ft: the same in every worker, on every restart. One line, the run stops.
            leave(keys.EXIT_CANNOT_GO_ON,
                  f"rank {os.environ.get('RANK', '?')}: this script uses ftrun.ft, which needs replica fault "
                  f"tolerance: add --ft to the ftrun command line (or drop ftrun.ft for group restarts)")
        if not store_addr:
            raise RuntimeError("ftrun.ft needs to run under `ftrun --ft` (FTRUN_STORE and FTRUN_FT=1 are not set)")
        self._timeout = datetime.timedelta(seconds=float(os.environ.get("FTRUN_FT_VOTE_TIMEOUT", "600")))
        # On several nodes this member votes through its node's store (vote.Node), which lives as
        # long as this process: connected once. On three nodes or more the run's store may move
        # (ftrun/supervisor/failover.py), and the node's ftrun says where in that same store.
        self.node = vote.Node.from_env(self._store_client)
        self.store_gen = 0
        moved = self._announced_store()
        if moved is not None:  # started just before a move: the address it was given is gone
            self.store_gen, store_addr = moved
            store_moved(store_addr)
        self._connect(store_addr)
        self.rank = int(os.environ["RANK"])
        self.inc = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.k = max(1, int(os.environ.get("FTRUN_REPLICA_SIZE", "1")))
        self.replica, self.shard = divmod(self.rank, self.k)
        self.mesh: Any = None  # the replica's own DeviceMesh (device_mesh())
        self.uses_ddp = False  # a layout round follows each heal only for DDP's buckets (ft/ddp.py)
        self.layout_each_group = False  # DDP's reducer sends (ft/ddp.py): a layout round on every new group
        # The member's decision state (epoch, round, switch, sync; ft/member/core.py): this
        # manager and its mixins are its driver, as the simulator's member is.
        nodes = 1 if self.node is None and os.environ.get("GROUP_WORLD_SIZE", "1") == "1" else 2
        self.core = MemberCore(can_rejoin=rejoins_in_place(self.k, nodes))
        # Why this member takes the committed state again in place at the next round's top
        # (member_core.Rejoin; relocation.StoreMoves._rejoin), or None.
        self._rejoin_why: Optional[str] = None
        self._index_of: Tuple[int, int] = (-1, 0)  # (epoch id, replica index in it)
        self._node_count: Tuple[int, int] = (-1, 0)  # (epoch id, its members voting through this node)
        self.pg: Optional[dist.ProcessGroup] = None
        self.step = 0
        # A round is up to epoch.round_steps steps; `round_len` is this round's, fixed at its top
        # from what every member knows alike (the epoch, the step, the total, the checkpoint
        # schedule), and `taken` how many of them this member has stepped.
        self.round_len = 1
        self.taken = 0
        self.latest_seen = 0
        self._waiting_round: Optional[int] = None  # the round whose decision the member waits for
        # The first round after a heal (with DDP's own reducer sending, on every new group):
        # nothing is sent during the backward, so every member's DDP records the order in which
        # gradients become ready and builds the same buckets (see ft/ddp.py); layout_averages
        # (one per wrapped model) then average the gradients once, and the round is voted as any
        # other. Where a model has none (a hook that does not average gradients, sparse
        # gradients) the round is discarded by all, with no vote.
        self.layout_round = False
        self.layout_averages: List[Optional[Callable[[], None]]] = []
        self.layout_serial = 0  # counts layout rounds planned: a model's average runs once in each
        self.optimizer_wrapped = False  # ft.Optimizer was made (one per run: ft/optim.py)
        # A fresh epoch may resume from a checkpoint (--checkpoint-dir): its layout round is
        # discarded, so the resumed step runs on the rebuilt buckets as it did in the run
        # that wrote the checkpoint, and the resumed run stays bitwise that run.
        self.layout_discard = False
        self.looping = False  # inside ft.steps() or ft.epochs() (opt.step() outside one is a misuse)
        self.step_open = False  # a step's top ran (start_round) and opt.step() has not voted on it yet
        self.step_serial = 0  # counts step tops: an ft.DataLoader rewinds to its committed position at each
        self.step_listeners: List[Callable[[], None]] = []  # called as this member takes a step
        self.loaders: List[Any] = []  # every ft.DataLoader (ft/data.py), in the order made
        self.epochs_state: Any = None  # ft.epochs()' registered epoch (ft/data.py), once asked for
        # ft.redo(): the step just handed to the script was handed out before on this state (a
        # discarded round); `yielded` travels in heals, so all replicas agree. A checkpoint holds the
        # state from before its step's side effects: a resumed run hands that step out as new.
        self.yielded = -1
        self.redo = False
        self.committed = 0
        self.discarded = 0
        self._last_failure: Optional[str] = None
        self.heals = 0
        self.last_heal_s: Optional[float] = None
        self.phase = "init"
        self.phase_since = time.time()
        self.state = ReplicaState()  # what a heal moves (ft/state.py)
        self.group_listeners: List[Callable[[Optional[dist.ProcessGroup]], None]] = []
        self._heal_written: Optional[str] = None
        self._watcher: Optional[threading.Thread] = None
        self._tainted = False  # part of a transfer landed in this replica's tensors, and it failed
        self._healed_gen = 0  # the store generation in which healed_key was last written
        self._chunk = int(_env_number("FTRUN_FT_CHUNK_MB", 64, 1, 4096) * (1 << 20))
        self.last_transfer: Optional[Dict[str, Any]] = None
        self._settle_s = _env_number("FTRUN_FT_TIMEOUT", 10, 0.5, 3600)
        # Fault injection for tests, "RANK:STEP": that rank's first incarnation votes that step down
        # after its collectives succeeded everywhere (the others have stepped: a mixed outcome).
        inject = os.environ.get("FTRUN_FT_INJECT_FAIL", "").split(":")
        self._inject_fail = (int(inject[0]), int(inject[1])) if len(inject) == 2 and all(
            i.strip().isdigit() for i in inject) else None
        # Durable state (--checkpoint-dir): saved at the top of the round after a due commit,
        # before any switch, so it is exactly the state of the step just committed.
        self.checkpoints = Checkpointer.from_env(self.rank, self.shard, self.k, _log, _log_detail)
        self.total: Optional[int] = None
        self._save_due = False
        self._loop_ending = False  # ft.epochs() ran out (finish_loop): its save is the loop's last
        self._resumed = False
        from ftrun.worker import progress

        self._progress = progress.start_from_env()
        if self._progress is not None:
            self._progress.info_provider = self.info

    # ------------------------------------------------------------ registration
    def register_model(self, model: torch.nn.Module) -> None:
        self.state.add_model(model)

    def register_optimizer(self, opt: torch.optim.Optimizer) -> None:
        self.state.add_optimizer(opt)

    def register_state(self, name: str, obj: Any) -> None:
        self.state.add_extra(name, obj)

    def on_group_change(self, fn: Callable[[Optional[dist.ProcessGroup]], None]) -> None:
        self.group_listeners.append(fn)

    # ------------------------------------------------------------ info
    @property
    def num_replicas(self) -> int:
        return len(self.epoch.members) // self.k if self.epoch else 1

    @property
    def replica_index(self) -> int:
        if self.epoch is None:
            return 0
        if self._index_of[0] != self.epoch.id:  # asked every step by most scripts: once per epoch
            self._index_of = (self.epoch.id, sorted({r // self.k for r in self.epoch.ranks}).index(self.replica))
        return self._index_of[1]

    def _shard_ranks(self, epoch: Epoch) -> List[int]:
        """Worker `shard` of every replica of the epoch: the ranks of this worker's group."""
        return [r for r in epoch.ranks if r % self.k == self.shard]

    @property
    def _shard_id(self) -> Optional[int]:
        """The shard index that names this worker's groups and keys (none for whole replicas)."""
        return self.shard if self.k > 1 else None

    # ------------------------------------------------------------ the replica's own workers
    def device_mesh(self, mesh_shape: Optional[Tuple[int, ...]] = None,
                    mesh_dim_names: Optional[Tuple[str, ...]] = None) -> Any:
        """The replica's K workers as a DeviceMesh, over a default process group of just them,
        built once per incarnation (a replica restarts whole, so it never needs rebuilding)."""
        if self.mesh is not None:
            return self.mesh
        from torch.distributed.device_mesh import init_device_mesh

        shape = tuple(mesh_shape) if mesh_shape else (self.k,)
        if any(not isinstance(n, int) or n < 1 for n in shape) or math.prod(shape) != self.k:
            raise ValueError(f"ftrun.ft.device_mesh({shape}): the shape must multiply to the replica's "
                             f"{self.k} workers (--replica-size {self.k})")
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if dist.is_initialized():
            if dist.get_world_size() != self.k:
                raise RuntimeError(
                    f"ftrun.ft.device_mesh(): a process group of {dist.get_world_size()} workers is already "
                    f"initialized; under --ft the default group must be this replica's {self.k} workers. "
                    f"Drop the script's init_process_group() call: ftrun.ft.device_mesh() makes it")
        else:
            from ftrun.worker.ft.world import torch_init_process_group

            # torch's own call, not the script's wrapped one (world.py), which a restarted replica skips.
            store = dist.PrefixStore(keys.replica_prefix(self.replica, self.inc), self.store)
            torch_init_process_group()("cpu:gloo,cuda:nccl" if cuda else "gloo", store=store, rank=self.shard,
                                       world_size=self.k)
        self.mesh = init_device_mesh("cuda" if cuda else "cpu", shape, mesh_dim_names=mesh_dim_names)
        return self.mesh

    def info(self) -> Dict[str, Any]:
        return {
            "inc": self.inc, "epoch": self.epoch.id if self.epoch else None,
            "quorum": self.num_replicas if self.epoch else 0, "in_quorum": self.epoch is not None and self.in_sync,
            "healing": self.phase == "heal", "step": self.step,
            "round": self._waiting_round if self._waiting_round is not None else self.round,
            "committed": self.committed, "discarded": self.discarded, "last_heal_s": self.last_heal_s,
            "phase": self.phase, "phase_since": self.phase_since, "heals": self.heals,
            "last_transfer": self.last_transfer,
        }

    def _set_phase(self, phase: str) -> None:
        self.phase = phase
        self.phase_since = time.time()

    # ------------------------------------------------------------ the loop
    def steps(self, total: int) -> Iterator[int]:
        """Yield the global step until `total` steps are committed (by any replica)."""
        self.total = total
        self.looping = True
        while True:
            self.start_round()
            if self.finished or self.step >= total:
                try:
                    self._settle()
                    if self._rejoin_why is not None:  # it stepped past the end the others decided otherwise
                        continue
                    if self.checkpoints is not None:
                        self.checkpoints.wait()  # the last checkpoint is published before the script goes on
                        self._retry_final_save()
                    if not self.finished:
                        self.store.compare_set(keys.FINISHED, "", str(self.step))
                    break
                except dist.DistError as e:  # the store moved as the run ended: rejoin, and end there
                    self._relocate(e)
                    continue
            yield self.step
        self.looping = False
        self.step_open = False
        self._set_phase("done")
        if self._progress is not None:
            self._progress.note_step(self.step)

    def begin_step(self) -> None:
        """The top of a step for a loop that ft.steps() does not drive (ft.DataLoader, ft.epochs()):
        the round's top runs once per step, at the first of them that asks."""
        if not self.looping:
            self._misused("an ft.DataLoader was iterated outside an ftrun.ft loop: drive the training loop "
                          "with ft.epochs() (`for epoch in ft.epochs(n): for batch in loader: ...`) or ft.steps()")
        if not self.step_open:
            self.start_round()

    def start_round(self) -> None:
        """The top of a step: join, switch quorum, heal, checkpoint, as due. A step is then open
        until opt.step() votes on it."""
        while True:
            try:
                self._start_round()
                break
            except dist.DistError as e:  # the run's store went away: rejoin on the next one
                self._relocate(e)
        self.step_open = True
        self.step_serial += 1
        self.redo = self.step <= self.yielded
        self.yielded = max(self.yielded, self.step)

    def finish_loop(self) -> None:
        """ft.epochs() ran out: the end of the loop, as ft.steps() ends at its total. A round of
        several steps the last epoch cut short is voted as it stands (every member took the same
        steps: the same batches), the last step is saved when checkpoints are on, the decision is
        awaited, and the run is marked finished."""
        self.close_round()
        if (self.checkpoints is not None and self.step > 0 and self.epoch is not None and self.in_sync
                and self.replica_index == 0 and self.checkpoints.due(self.step, self.step)):
            self._save_due = True
        self._loop_ending = True  # the save due now is the loop's last
        while True:
            self.start_round()
            try:
                self._settle()
                if self._rejoin_why is not None:  # the script's loop is over: its epochs cannot be given again
                    self._restart(self._rejoin_why)
                if self.checkpoints is not None:
                    self.checkpoints.wait()  # the last checkpoint is published before the script goes on
                    self._retry_final_save()
                if not self.finished:
                    self.store.compare_set(keys.FINISHED, "", str(self.step))
                break
            except dist.DistError as e:  # the store moved as the run ended: rejoin, and end there
                self._relocate(e)
        self.step_open = False
        self.looping = False
        self._set_phase("done")
        if self._progress is not None:
            self._progress.note_step(self.step)

    def close_round(self) -> None:
        """Vote the steps this member took in the current round, as its last step would."""
        if self.taken and self.epoch is not None and self.k == 1:
            self._ballot.submit(self.epoch.id, self.round, len(self.epoch.members), self.latest_seen,
                                self._node_size())
            self._end_round(True, self.core.handle(ClosedOk()))

    def _start_round(self) -> None:
        self._settle(block=False)
        if self.taken and self._rejoin_why is None:  # inside a round of several steps: nothing happens between them
            self.core.handle(Computing())
            self._set_phase("compute")
            return
        if self._ballot.round is not None and (self._save_due or self.core.due_switch() is not None
                                               or (self.total is not None and self.step >= self.total)):
            # A checkpoint, a switch (whose heal sends this state) and the end of the loop all
            # need the last step decided, not merely taken.
            self._settle()
        if self._rejoin_why is not None:
            self._rejoin()  # a fresh member: it joins below and heals from a peer
        if self._save_due:
            self._save_due = False
            self._set_phase("checkpoint")
            last = self._loop_ending or (self.total is not None and self.step >= self.total)
            self.checkpoints.save(self.state, self.step, "final" if last else "periodic")
        for c in self.core.handle(RoundTop()):
            if isinstance(c, Join):
                self._join()
            else:
                self._switch(c.epoch)
        self.round_len = self._round_length()
        self.core.handle(Computing())
        self._set_phase("compute")

    def _round_length(self) -> int:
        """Steps in the round starting now: the epoch's round_steps, ending early where a
        checkpoint or the end of the loop needs the step decided. The same on every member."""
        if self.epoch is None or self.k > 1 or self.layout_round:
            return 1
        n = max(1, self.epoch.round_steps)
        if self.total is not None:
            n = max(1, min(n, self.total - self.step))
        if self.checkpoints is not None:
            for s in range(self.step + 1, self.step + n):
                if self.checkpoints.due(s, self.total):
                    return s - self.step
        return n


_manager: Optional[Manager] = None


def manager() -> Manager:
    global _manager
    if _manager is None:
        _manager = Manager()
    return _manager
