"""The replica's side of --ft: join, vote on every step, switch epochs, heal from a peer.

A round is one attempt at a step. Each member adds its vote (ok, or failed)
to the round's counter in the store, one round trip; the member whose vote
completes the count writes the decision (commit when no vote failed, and
the newest epoch it has seen), and the others read it, so all members
decide alike and the store does O(1) work per member. A member whose
collectives succeeded steps at once and reads the decision during the next
round, before that round's first collective; one whose action the decision
contradicts restarts and heals. A member that died never votes: the
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
import gc
import json
import math
import os
import re
import sys
import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from ftrun import protocol as keys
from ftrun.worker.ft import membership, vote
from ftrun.worker.ft.checkpoint import SAVE_ERRORS, Checkpointer, CheckpointMismatch
from ftrun.worker.ft.group import abort_group, build_group_watched, group_device, settle
from ftrun.protocol import DETAIL_PREFIX, Epoch
from ftrun.worker.ft.state import ReplicaState
from ftrun.worker.ft.transport import StateMismatch, receive_state, send_state

POLL_S = 0.005
SLOW_S = 2.0  # a protocol wait longer than this is worth a line in the log
RELOCATE_S = 120.0  # the nodes agree on a new store in seconds; a node that cannot stops its workers
FINAL_SAVE_RETRIES = 2  # a failed checkpoint of the loop's last step is tried again this often,
FINAL_SAVE_RETRY_S = 1.0  # after this many seconds times the attempt's number
PARK_POLL_S = 0.2  # a stopped member looks this often for a newer stop epoch naming it the writer
STORE_PROBES = 5  # connections 0.1 s apart that must all get in for the run's store to count as up


def _log(msg: str) -> None:
    sys.stderr.write(f"ftrun.ft: {msg}\n")
    sys.stderr.flush()


def _log_detail(msg: str) -> None:
    """A line for the rank's log file only (the console filter keeps it off unless --verbose)."""
    sys.stderr.write(f"{DETAIL_PREFIX}{msg}\n")
    sys.stderr.flush()


# What a collective says when a peer of the group went away (gloo: the connection reset or
# closed; ftrun: the member's incarnation is gone, or the group was given up for a newer quorum).
PEER_LOST = re.compile(r"reset by peer|connection closed|closed by peer|broken pipe|connection refused|"
                       r"are gone|is out\b|aborted|end of file|EOF", re.IGNORECASE)


def _plain(text: str, most: int = 160) -> str:
    """A collective's error for a person: without the library's source path, cut at a word."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", text.strip())
    if len(text) <= most:
        return text
    return text[:most].rsplit(" ", 1)[0] + " ..."


def _env_number(name: str, default: float, lo: float, hi: float) -> float:
    """A tuning knob from the environment; a value that is not a number in [lo, hi] is
    replaced by the default, with one line saying so (never a crash in the middle of a run)."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not lo <= value <= hi:  # also false for nan
        _log(f"{name}={raw!r} is not a number between {lo:g} and {hi:g}; using {default:g}")
        return default
    return value


class Manager:
    """One per worker process; created by ftrun.ft on first use."""

    def __init__(self) -> None:
        store_addr = os.environ.get("FTRUN_STORE")
        if store_addr and os.environ.get("FTRUN_FT") != "1":
            # Under ftrun without --ft: the same in every worker, on every restart. One line, the run stops.
            _log(f"rank {os.environ.get('RANK', '?')}: this script uses ftrun.ft, which needs replica fault "
                 f"tolerance: add --ft to the ftrun command line (or drop ftrun.ft for group restarts)")
            sys.stderr.flush()
            os._exit(keys.EXIT_CANNOT_GO_ON)
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
            self._follow_env(store_addr)
        self._connect(store_addr)
        self.rank = int(os.environ["RANK"])
        self.inc = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.k = max(1, int(os.environ.get("FTRUN_REPLICA_SIZE", "1")))
        self.replica, self.shard = divmod(self.rank, self.k)
        self.mesh: Any = None  # the replica's own DeviceMesh (device_mesh())
        self.uses_ddp = False  # a layout round follows each heal only for DDP's buckets (ft/ddp.py)
        self.layout_each_group = False  # DDP's reducer sends (ft/ddp.py): a layout round on every new group
        self.epoch: Optional[Epoch] = None
        self._index_of: Tuple[int, int] = (-1, 0)  # (epoch id, replica index in it)
        self._node_count: Tuple[int, int] = (-1, 0)  # (epoch id, its members voting through this node)
        self.pg: Optional[dist.ProcessGroup] = None
        self.group_round = -1   # the round at which the current group was built
        self.round = 0
        self.step = 0
        # A round is up to epoch.round_steps steps; `round_len` is this round's, fixed at its top
        # from what every member knows alike (the epoch, the step, the total, the checkpoint
        # schedule), and `taken` how many of them this member has stepped.
        self.round_len = 1
        self.taken = 0
        self.in_sync = False
        self.round_ok = True
        self.latest_seen = 0
        self.target_epoch: Optional[int] = None
        self.switch_round: Optional[int] = None  # the round at whose top the member switches to target_epoch
        self.rebuild = False
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
        self.finished = False
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
        self.failed_in_row = 0
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
        self.checkpoints = Checkpointer.from_env(self.rank, self.shard, self.k, _log)
        self.total: Optional[int] = None
        self._save_due = False
        self._loop_ending = False  # ft.epochs() ran out (finish_loop): its save is the loop's last
        self._resumed = False
        from ftrun.worker import progress

        self._progress = progress.start_from_env()
        if self._progress is not None:
            self._progress.info_provider = self.info

    # ------------------------------------------------------------ the run's store, and its moves
    def _connect(self, addr: str) -> None:
        self.store = self._store_client(addr)
        self._ballot = vote.Ballot(lambda: self._store_client(addr),
                                   lambda: vote.Node.from_env(self._store_client))

    def _store_client(self, addr: str) -> dist.TCPStore:
        host, _, port = addr.rpartition(":")
        return dist.TCPStore(host, int(port), None, False, self._timeout)

    def _announced_store(self) -> Optional[Tuple[int, str]]:
        """(generation, host:port) of the run's store as this node's ftrun last announced it, or
        None when it never moved (or cannot move: one node, two, or node 0's own workers)."""
        if self.node is None or not self.node.store.check([keys.RUN_STORE]):
            return None
        gen, where = self.node.store.get(keys.RUN_STORE).decode().split()
        return int(gen), where

    @staticmethod
    def _follow_env(addr: str) -> None:
        """Everything that connects to the run's store by itself (group formation, checkpoint
        reports, the script's own init_process_group) reads the environment."""
        host, _, port = addr.rpartition(":")
        os.environ["FTRUN_STORE"] = addr
        os.environ["MASTER_PORT"] = port
        os.environ["MASTER_ADDR"] = host

    def _store_gone(self) -> bool:
        """Whether the run's store stopped answering (as opposed to a slow wait on a live one).
        One answer is not enough: a store whose process is being killed resets its connections
        before the kernel closes its listening socket. A live store answers every probe."""
        import socket

        host, _, port = os.environ["FTRUN_STORE"].rpartition(":")
        for i in range(STORE_PROBES):
            if i:
                time.sleep(0.1)
            try:
                with socket.create_connection((host, int(port)), timeout=2.0):
                    pass
            except OSError:
                return True
        return False

    def _relocate(self, error: BaseException) -> None:
        """The run's store went away under a store operation (its node was lost). Wait for this
        node's ftrun to announce the next one, connect to it, and rejoin holding this replica's
        state: the keeper of the new store heals every replica from the one holding the newest
        whole step. Re-raises `error` when the store did not move."""
        if self.node is None or not self._store_gone():
            raise error
        _log(f"rank {self.rank}: lost the run's store at {os.environ['FTRUN_STORE']} "
             f"({str(error).splitlines()[0][:120]}); waiting for the nodes to agree on the next one")
        t0 = time.monotonic()
        deadline = t0 + RELOCATE_S
        while True:
            moved = self._announced_store()
            if moved is not None and moved[0] > self.store_gen:
                break
            if time.monotonic() > deadline:
                _log(f"rank {self.rank}: no new store within {RELOCATE_S:g} s; exiting")
                os._exit(keys.EXIT_REPLICA_RESTART)
            time.sleep(POLL_S * 4)
        gen, addr = moved
        self._drop_group()
        self._follow_env(addr)
        self._connect(addr)
        while not self.store.check([keys.LATEST]):  # the new keeper's first words
            if time.monotonic() > deadline:
                _log(f"rank {self.rank}: the run's new store at {addr} has no keeper; exiting")
                os._exit(keys.EXIT_REPLICA_RESTART)
            time.sleep(POLL_S)
        self.latest_seen = int(self.store.get(keys.LATEST))
        self.store_gen = gen  # the epoch watcher reconnects on this
        if self._progress is not None:
            self._progress.move_to(addr)
        self.epoch = None
        self.target_epoch = None
        self.switch_round = None
        self.rebuild = False
        self.layout_round = False
        self._waiting_round = None
        self._save_due = False
        self.taken = 0
        self._heal_written = None
        self.round_ok = True
        self.store.set(keys.survivor_key(self.rank), json.dumps(
            {"inc": self.inc, "step": self.step, "in_sync": self.in_sync and not self._tainted}))
        _log(f"rank {self.rank}: the run's store moved to {addr} after {time.monotonic() - t0:.2f} s; rejoining "
             f"at step {self.step}")

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
            self._end_round(True, self.epoch.id)

    def _start_round(self) -> None:
        self._settle(block=False)
        if self.taken:  # inside a round of several steps: nothing happens between them
            self.round_ok = self.round_ok and self.in_sync
            self._set_phase("compute")
            return
        if self._ballot.round is not None and (self._save_due or self._due_switch() is not None
                                               or (self.total is not None and self.step >= self.total)):
            # A checkpoint, a switch (whose heal sends this state) and the end of the loop all
            # need the last step decided, not merely taken.
            self._settle()
        if self._save_due:
            self._save_due = False
            self._set_phase("checkpoint")
            last = self._loop_ending or (self.total is not None and self.step >= self.total)
            self.checkpoints.save(self.state, self.step, "final" if last else "periodic")
        if self.epoch is None:
            self._join()
        else:
            target = self._due_switch()
            if target is not None:
                self._switch(target)
        self.round_len = self._round_length()
        self.round_ok = self.round_ok and self.in_sync
        self._set_phase("compute")

    def _retry_final_save(self) -> None:
        """The checkpoint of the loop's last step failed (this replica wrote it): try again, a
        few times, a little later each time (every worker of the replica knows the outcome
        alike, so they all retry together). The training itself is done either way."""
        ck = self.checkpoints
        for attempt in range(1, FINAL_SAVE_RETRIES + 1):
            if ck.result != (self.step, False):
                return
            _log(f"rank {self.rank}: trying the checkpoint of the last step {self.step} again in "
                 f"{FINAL_SAVE_RETRY_S * attempt:g} s (attempt {attempt + 1} of {FINAL_SAVE_RETRIES + 1})")
            time.sleep(FINAL_SAVE_RETRY_S * attempt)
            ck.save(self.state, self.step, "final")
            ck.wait()
        if ck.result == (self.step, False) and self.shard == 0:
            _log(f"rank {self.rank}: the checkpoint of the last step {self.step} failed {FINAL_SAVE_RETRIES + 1} "
                 f"times ({ck.last_failure}); the training itself ended normally")

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

    def _due_switch(self) -> Optional[int]:
        """The epoch to switch to (or to rebuild the group of) at the top of this round, if any."""
        if self.target_epoch is not None and (self.rebuild or self.round >= (self.switch_round or 0)):
            return self.target_epoch
        if self.rebuild:
            return self.epoch.id
        return None

    def fail_round(self, why: str = "") -> None:
        """A collective of this round failed: the round will be voted down. A peer's loss is an
        expected event (the supervisor says which replica died): it is said in the log only;
        anything else is said in ftrun's words too. The full text always goes to the log."""
        if self.round_ok and why:
            first = why.splitlines()[0]
            if first != self._last_failure or self.failed_in_row % 100 == 0:
                _log_detail(f"rank {self.rank}: round {self.round}: {why.strip()}")
                if PEER_LOST.search(first):
                    _log_detail(f"rank {self.rank}: round {self.round} is voted down: a peer left mid-collective")
                else:
                    _log(f"rank {self.rank}: round {self.round} failed: {_plain(first)} (the full text is in this "
                         f"rank's log)")
            self._last_failure = first
        self.round_ok = False

    def before_collective(self) -> None:
        """Called before the round's first collective: the previous round's decision must be in
        (it arrived during this round's forward pass, as a rule), so that no member sends a
        gradient over a group whose last round was voted down."""
        try:
            self._settle()
        except (dist.DistError, vote.StoreLost) as e:  # the store moved: this round sends nothing, the next one rejoins
            self._relocate(e)

    def vote(self) -> bool:
        """This step's part of the round; True if this member steps (the caller steps at once).

        A round is several steps (Epoch.round_steps) and one vote. A member whose collectives
        all succeeded steps without waiting; after the round's last step its ok vote goes to
        the store from a thread and the decision is read during the next round (`_settle`). A
        member whose collective failed votes at once, saying how many of the round's steps it
        took; the round keeps the fewest any member took (protocol.kept_key). An
        all-reduce that completed for one member had every member's part, so as a rule it
        completed for all and the decision is commit; where a member's action and the decision
        disagree (a rare mixed outcome as a peer dies mid-collective), that member restarts and
        heals from a peer. A member whose round failed votes and waits, as before.
        """
        self.step_open = False
        if self.epoch is None:
            if not self.looping:
                self._misused("opt.step() was called outside an ftrun.ft loop, so no step could ever be committed "
                              "(every one would be discarded): drive the training loop with ft.epochs() or "
                              "ft.steps(), as in `for epoch in ft.epochs(n):` or `for step in ft.steps(total):`")
            return False  # the run's store moved during this round: nothing to vote on
        try:
            return self._vote()
        except (dist.DistError, vote.StoreLost) as e:  # the store moved: the round is nobody's now; rejoin next round
            self._relocate(e)
            return False

    def _vote(self) -> bool:
        if self.layout_round:
            self.layout_round = False
            if not self.layout_averaging():
                # Agreed by all (it follows the same switch): nothing was sent, nothing is voted.
                self.round += 1
                self.round_ok = True
                self._set_phase("discard")
                return False
            # As a rule each model's average ran as its backward returned (ft/ddp.py), so the
            # script read averaged gradients; one whose backward did not reduce averages here.
            self.layout_average(self.layout_averages)
        self._set_phase("vote")
        if self.checkpoints is not None:
            self.checkpoints.staged()  # a save still copying the state: done before the optimizer steps
        if self.pg is not None and not settle(self._settle_s):
            # NCCL does not fail a collective whose peer died: it would wait forever.
            self.fail_round(f"the round's collectives did not finish within {self._settle_s:g} s")
        if self._inject_fail == (self.rank, self.step) and self.inc == 0:
            self._inject_fail = None
            self.fail_round("a failure injected by FTRUN_FT_INJECT_FAIL")
        self._settle()  # the previous round first: a member it contradicts restarts here
        ok = self.round_ok and self.in_sync and self.pg is not None
        if ok and self.k == 1:
            self._took_step()
            if self.taken >= self.round_len:
                self._ballot.submit(self.epoch.id, self.round, len(self.epoch.members), self.latest_seen,
                                    self._node_size())
                self._end_round(True, self.epoch.id)
            return True
        # A sharded replica (--replica-size > 1) waits for the decision even when its collectives
        # went through: its shards may disagree (one shard group's collective completed, its
        # mate's failed), and a replica holds the state only if every shard does. Had its ok
        # shards stepped, a failed round would restart the whole replica, and when it is the
        # last one, nobody would hold the trained state any more.
        if not ok and self.pg is not None:
            self._drop_group()
        t0 = time.monotonic()
        commit, target, _, kept = vote.cast(self.store, self.epoch.id, self.round, len(self.epoch.members), ok,
                                            self.latest_seen, self.node, self._node_size(), self.taken)
        if time.monotonic() - t0 > SLOW_S:
            _log(f"rank {self.rank}: waited {time.monotonic() - t0:.1f} s for the decision of round {self.round}")
        if commit and not ok:  # possible only when a dead member's own vote and its abstention both counted
            self._restart(f"round {self.round} was committed by its other members while this member's "
                          f"collectives had failed")
        if not commit and kept != self.taken:  # a peer's collective failed earlier in the round than ours
            self._restart(f"round {self.round} keeps its first {kept} steps while this member had taken "
                          f"{self.taken}")
        if commit:  # a sharded replica's one-step round
            self._took_step()
        self._end_round(commit, target)
        if commit:  # every member read this decision before stepping: they all switch at the next round
            self._note_target(target, self.round)
        elif ok:
            self._drop_group()
        return commit

    def layout_can_average(self) -> bool:
        """Whether every wrapped model's gradients can be averaged in a layout round."""
        return bool(self.layout_averages) and None not in self.layout_averages

    def layout_averaging(self) -> bool:
        """Whether this layout round is voted on (else it is discarded by all, with no vote)."""
        return self.layout_can_average() and not self.layout_discard

    def layout_average(self, averages: List[Optional[Callable[[], None]]]) -> None:
        """Run the layout round's averages (each once a round: a model's runs as its backward
        returns); a failed one votes the round down. Without a group nothing is sent: this
        member votes the round down anyway."""
        if self.pg is None:
            return
        try:
            for average in averages:
                average()
        except Exception as e:  # the group broke: this round is voted down
            self.fail_round(str(e))

    def _node_size(self) -> int:
        """How many of the epoch's members vote through this member's node (0: no node)."""
        if self.node is None:
            return 0
        if self._node_count[0] != self.epoch.id:
            self._node_count = (self.epoch.id, self.node.size(self.epoch.members))
        return self._node_count[1]

    def _took_step(self) -> None:
        """This member steps (its collectives of this step went through): counted at once."""
        self.step += 1
        self.taken += 1
        self.committed += 1
        for fn in self.step_listeners:
            fn()
        if self._progress is not None:
            self._progress.note_step(self.step)
        self._set_phase("commit")

    def _end_round(self, commit: bool, target: int) -> None:
        self.round += 1
        self.taken = 0
        if commit:
            self.failed_in_row = 0
            self._last_failure = None
            # The same on every worker of a replica (all of them stepped).
            self._save_due = (self.checkpoints is not None and self.checkpoints.due(self.step, self.total)
                              and self.replica_index == 0)
        else:
            self.discarded += 1
            self.failed_in_row += 1
            self.rebuild = True  # the group may be broken: every member builds a fresh one
            if self.failed_in_row > 3 and target <= self.epoch.id:
                # Rounds keep failing and no new epoch is in sight: wait a little for the
                # supervisor to change membership instead of spinning (bounded back-off).
                time.sleep(min(0.2, 0.005 * 2 ** min(self.failed_in_row - 3, 6)))
            # Every member that goes on from a failed round voted it down and waited for its
            # decision: they all switch at the next round.
            self._note_target(target, self.round)
            if self._progress is not None:
                self._progress.note_step(self.step)
        self.round_ok = True
        self._set_phase("commit" if commit else "discard")

    def _note_target(self, target: int, at_round: int) -> None:
        if target > self.epoch.id:
            self.target_epoch = max(target, self.target_epoch or 0)
            self.switch_round = at_round if self.switch_round is None else min(self.switch_round, at_round)

    def _settle(self, block: bool = True) -> None:
        """Take in the decision of the round this member voted ok on and stepped past. A commit
        naming a newer epoch switches at the top of the round after the current one: members
        read the decision at different moments of the current round, and that is the first
        boundary every one of them reaches knowing it."""
        ballot = self._ballot
        if ballot.round is None or not (block or ballot.ready()):
            return
        epoch_id, rnd = ballot.round
        waiting = not ballot.ready()
        if waiting:
            back = self.phase
            self._waiting_round = rnd
            self._set_phase("vote")
        t0 = time.monotonic()
        try:
            commit, target, _, _ = ballot.result()
        finally:
            if waiting:
                self._waiting_round = None
                self._set_phase(back)
        if time.monotonic() - t0 > SLOW_S:
            _log(f"rank {self.rank}: waited {time.monotonic() - t0:.1f} s for the decision of round {rnd}")
        if not commit:
            self._restart(f"round {rnd} was voted down after this member had stepped past it")
        self._note_target(target, rnd + 2)

    def _misused(self, why: str) -> None:
        """The script uses ftrun.ft in a way that can never train: say so in one line and stop the
        run (every replica would do the same; a restart cannot change it)."""
        _log(f"rank {self.rank}: {why}")
        sys.stderr.flush()
        os._exit(keys.EXIT_CANNOT_GO_ON)

    def _restart(self, why: str) -> None:
        """This member's state is not the committed one and no peer can take it back: exit, so
        that ftrun restarts the replica and it heals from a peer like any newcomer."""
        _log(f"rank {self.rank}: {why}; restarting to take the committed state from a peer")
        sys.stderr.flush()
        os._exit(keys.EXIT_REPLICA_RESTART)

    # ------------------------------------------------------------ membership
    def _watch_epochs(self) -> None:
        """Learn of each new epoch as the supervisor publishes it, off the training thread
        (a blocking read of the next epoch's key): the step itself never asks. Follows the run's
        store when it moves (the training thread reconnects first and sets latest_seen there)."""
        gen = None
        while True:
            if gen != self.store_gen:
                gen = self.store_gen
                host, _, port = os.environ["FTRUN_STORE"].rpartition(":")
                try:
                    # A long timeout: waiting is this thread's whole job (and each timeout logs a warning).
                    store = dist.TCPStore(host, int(port), None, False, datetime.timedelta(days=1))
                except Exception:
                    time.sleep(0.05)
                    gen = None
                    continue
                nxt = self.latest_seen + 1
            try:
                store.get(keys.epoch_key(nxt))
            except Exception:  # no new epoch for a while (a timeout), or the store is gone
                if self.finished:
                    return
                while gen == self.store_gen and not self.finished and self._store_gone():
                    time.sleep(0.05)  # wait for the training thread to find the next store
                continue
            if gen == self.store_gen:
                self.latest_seen = max(self.latest_seen, nxt)
            nxt += 1

    def _join(self) -> None:
        """Ask the supervisor to take this incarnation in, and wait for an epoch that has it."""
        self._set_phase("join")
        t0 = time.time()
        entry = membership.wait_to_enter(self.store, (self.rank, self.inc), time.sleep, POLL_S)
        if entry.finished is not None:
            self.finished = True
            self.step = entry.finished
            if not self.in_sync:
                self._finish_without_peers()
            return
        entering, self.round = entry.epoch, entry.round
        self.latest_seen = entry.latest  # the newest epoch: a round we close names it, so members move on to it
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch_epochs, name="ftrun-epochs", daemon=True)
            self._watcher.start()
        self._switch(entering, joining=True)
        self.store.set(keys.entered_key(self.rank), str(self.inc))
        if self.epoch is not None and self.in_sync:
            _log(f"rank {self.rank} (incarnation {self.inc}) joined quorum {entering} at step {self.step} "
                 f"after {time.time() - t0:.2f} s")

    def _finish_without_peers(self) -> None:
        """The run finished while this replica was restarting, and no peer is left to heal it.
        It takes the final checkpoint when there is one (--checkpoint-dir: the last step is
        always saved); otherwise it exits at once, with status 0, so that the script's code
        after the loop (a final save, an evaluation) never runs on its untrained state."""
        lead = f"rank {self.rank}: the run finished at step {self.step} while this replica was restarting"
        if self.checkpoints is not None and self.k == 1:
            try:
                found = self.checkpoints.resume(self.state, self.total)
            except SAVE_ERRORS as e:  # a foreign or damaged checkpoint: no state to stand on
                _log(f"rank {self.rank}: {str(e).splitlines()[0][:300]}")
                found = None
            if found is not None and found.step == self.step:
                self.in_sync = True
                _log(f"{lead}; no peer is left to heal it: it resumed from checkpoint step {found.step}, the final one")
                return
        _log(f"{lead}; no peer is left to heal it and no checkpoint holds the final step: exiting now (status 0) "
             f"instead of running the script's code after the loop on an untrained model")
        sys.stderr.flush()
        os._exit(keys.EXIT_OK)

    def _switch(self, epoch_id: int, joining: bool = False) -> None:
        epoch = membership.read_epoch(self.store, epoch_id)
        if (self.rank, self.inc) not in epoch.members:
            _log(f"rank {self.rank}: left out of quorum {epoch_id}; exiting so that ftrun restarts and heals it")
            sys.stderr.flush()
            os._exit(keys.EXIT_REPLICA_RESTART)
        if epoch.stop:
            self._stop_here(epoch)
        changed = self.epoch is None or epoch.id != self.epoch.id
        if changed and not joining:  # every member begins the epoch at one round
            self.round = membership.entry_round(self.store, epoch, self.round)
        self.group_round = self.round
        self.epoch = epoch
        self.target_epoch = None
        self.switch_round = None
        self.rebuild = False
        self._set_phase("group")
        old, self.pg = self.pg, None
        abort_group(old)
        gone = self._gone(epoch, epoch.ranks)
        if gone:  # connecting would wait for the dead until the timeout; the next epoch drops them
            self.fail_round(gone)
            if epoch.healers or epoch.fresh:
                self._heal(epoch)  # the transfer may still take place, and its ends must say how it went
            self._plan_layout(epoch)
            for fn in self.group_listeners:
                fn(None)
            return
        t0 = time.monotonic()
        try:
            self.pg = self._form(keys.pg_prefix(epoch.id, self.group_round, self._shard_id), epoch,
                                 self._shard_ranks(epoch))
        except Exception as e:  # a member died while we connected: this round fails, the next epoch fixes it
            self.fail_round(f"could not form the group of quorum {epoch.id}: {str(e).splitlines()[0]}")
        took = time.monotonic() - t0
        if took > SLOW_S:
            _log(f"rank {self.rank}: forming the group of quorum {epoch.id} (round {self.group_round}) took {took:.1f} s")
        if epoch.healers or epoch.fresh:
            self._heal(epoch)
        self._plan_layout(epoch)
        for fn in self.group_listeners:
            fn(self.pg)

    def _stop_here(self, epoch: Epoch) -> None:
        """A stop signal reached the run (ftrun published a stop epoch): every member stops at this
        round boundary, which all reach alike, each holding the state of the last step it
        committed. The writer replica saves that step (unless its newest save is of it already)
        and says how it went (protocol.STOP_SAVE); every member then waits to be stopped, and
        saves after all should a newer stop epoch name its replica the writer (the first one's
        died). The script's code after the loop never runs on a stopped run. Never returns."""
        self._drop_group()
        self._set_phase("stop")
        saved = False
        while True:
            self.epoch = epoch
            if not saved and self.replica == epoch.writer:
                saved = True
                self._save_before_stop()
            time.sleep(PARK_POLL_S)
            if self.latest_seen > epoch.id:
                try:
                    newest = Epoch.from_json(self.store.get(keys.epoch_key(self.latest_seen)))
                except Exception:  # noqa: BLE001 - the store is going away with the run
                    continue
                if newest.stop and (self.rank, self.inc) in newest.members:
                    epoch = newest

    def _save_before_stop(self) -> None:
        ck = self.checkpoints
        word: Dict[str, Any] = {"step": self.step, "ok": False, "rank": self.rank}
        if ck is None or not self.in_sync or self._tainted:
            word["why"] = "the writing replica does not hold the trained state"
        else:
            ck.wait()  # a periodic save of this very step may be in flight
            if ck.result != (self.step, True):
                ck.save(self.state, self.step, "stop")
                ck.wait()
            word["ok"] = ck.result == (self.step, True)
            if word["ok"]:
                word["path"] = str(ck.settings.root / f"step-{self.step}")
            else:
                word["why"] = ck.last_failure
        if self.shard == 0:
            try:
                self.store.set(keys.STOP_SAVE, json.dumps(word))
            except Exception:  # noqa: BLE001 - the supervisor stops the run at its deadline anyway
                pass

    def _plan_layout(self, epoch: Epoch) -> None:
        """Whether the first round on the group just formed is a layout round (ft/ddp.py): after
        a heal for DDP's buckets, and on every group when DDP's own reducer sends. Every member
        of a group formed it at the same round, so they all agree."""
        self.layout_round = self.uses_ddp and (self.layout_each_group or bool(epoch.healers or epoch.fresh))
        self.layout_serial += 1  # each model averages once an attempt at this layout round (ft/ddp.py)
        self.layout_discard = bool(epoch.fresh) and self.checkpoints is not None

    def _gone(self, epoch: Epoch, ranks: List[int]) -> Optional[str]:
        return membership.gone(self.store, epoch, ranks)

    def _form(self, prefix: str, epoch: Epoch, ranks: List[int]) -> dist.ProcessGroup:
        """A group of `ranks` (in that order), given up as soon as one of them dies or a newer
        epoch is out: members already in the newer one never come to this group, and waiting
        for them would cost the formation's whole timeout; the failed round's decision names
        the newer epoch, where everyone meets."""
        def why() -> Optional[str]:
            if self.latest_seen > epoch.id:
                return f"quorum {self.latest_seen} is out"
            return self._gone(epoch, ranks)

        return build_group_watched(os.environ["FTRUN_STORE"], prefix, ranks.index(self.rank), len(ranks),
                                   why, POLL_S)

    def _drop_group(self) -> None:
        """Close this member's connections at once. Peers still blocked in the failed
        collective waiting for data from us then fail within milliseconds instead of
        waiting for gloo's timeout (a ring allreduce leaves live peers waiting on live
        peers). The group is rebuilt after every failed round anyway."""
        old, self.pg = self.pg, None
        abort_group(old)
        for fn in self.group_listeners:
            fn(None)
        gc.collect()  # hook state holds the group in reference cycles

    # ------------------------------------------------------------ healing
    def _source(self, epoch: Epoch) -> int:
        """This worker's source: its own shard index in the lowest replica holding the state
        (one source replica for every shard, so all shards come from the same step)."""
        holders = [r for r in epoch.ranks if r not in epoch.healers]
        return (min(holders or epoch.ranks) // self.k) * self.k + self.shard

    def _heal(self, epoch: Epoch) -> None:
        """Move the committed state from the epoch's source to its healers, over a group of
        just those replicas; the other members wait (bounded by the liveness of the
        transfer's ends) so their next collective does not time out behind the transfer."""
        source = self._source(epoch)
        ends = [source] + [r for r in sorted(epoch.healers) if r != source and r % self.k == self.shard]
        done_key = keys.heal_key(epoch.id, self.group_round, self._shard_id)
        if self.rank not in ends:
            self._await_heal(epoch, ends, done_key)
            return
        sending = self.rank == source
        if self._gone(epoch, ends):
            # An end of the transfer is gone: forming its group would wait for it until the timeout.
            self.fail_round(f"the state transfer of quorum {epoch.id} lost an end before it began")
            if sending:
                self._set_heal_done(done_key, "fail")
            return
        if sending and self._tainted:
            _log(f"rank {self.rank}: named the source of a fresh quorum while holding a half-received state; "
                 f"exiting so that ftrun restarts it clean")
            os._exit(keys.EXIT_REPLICA_RESTART)
        if sending and epoch.fresh and not self.in_sync and self.checkpoints is not None and not self._resumed:
            self._resume()
        self._set_phase("send" if sending else "heal")
        t0 = time.time()
        hpg = None
        try:
            hpg = self._form(keys.pg_prefix(epoch.id, self.group_round, self._shard_id) + "heal/", epoch, ends)
            if sending:
                stats = send_state(hpg, self.state.capture(self.round, self.step, self.yielded), group_device(),
                                   chunk=self._chunk,
                                   after_first_chunk=self._inject_send_delay, timeout_s=self._settle_s)
            else:
                payload, stats, in_place = receive_state(hpg, self.state.targets(), group_device(), chunk=self._chunk,
                                                         on_write=self._taint, timeout_s=self._settle_s)
                self.round, self.step, self.yielded = self.state.restore(payload, in_place)
                self._tainted = False
        except StateMismatch as e:
            # Not a failure of the transfer: this replica's model, optimizer or registered state
            # differ from its peers'. Retrying would fail the same way; the supervisor's budget
            # decides what happens to a replica that exits.
            _log(f"rank {self.rank}: cannot take the state of rank {source}: {e}. This replica's model, optimizer "
                 f"or ft.register_state() objects differ from its peers'; exiting")
            sys.stderr.flush()
            os._exit(keys.EXIT_FAILED)
        except Exception as e:  # an end of the transfer died: this round fails, the next epoch heals again
            abort_group(hpg)
            who = "to its healers" if sending else f"from rank {source}"
            if self.round_ok:
                # In ftrun's words on the console (a heal that must be done again is worth a line);
                # the library's own text in the rank's log.
                _log_detail(f"rank {self.rank}: state transfer {who}: {str(e).strip()}")
                _log(f"rank {self.rank}: the state transfer {who} failed"
                     f"{' (a peer left)' if PEER_LOST.search(str(e)) else ''}; healing again in the next quorum")
            self.fail_round()
            if sending:
                self._set_heal_done(done_key, "fail")
            return
        abort_group(hpg)
        took = time.time() - t0
        self.last_transfer = {"bytes": stats.bytes, "s": round(stats.seconds, 4), "gbps": round(stats.gbps, 3),
                              "in_place": stats.in_place, "allocated": stats.allocated}
        if sending:
            self._set_heal_done(done_key, "ok")
            if not self.in_sync or self._healed_gen != self.store_gen:
                # A fresh epoch's source (its state is the run's state from now on), or the
                # source of the first epoch on a store that moved, which knows nothing yet.
                self.in_sync = True
                self._healed_gen = self.store_gen
                self.store.set(keys.healed_key(self.rank), str(self.inc))
            return
        self.in_sync = True
        self._healed_gen = self.store_gen
        self.heals += 1
        self.last_heal_s = round(took, 4)
        _log(f"rank {self.rank}: received {stats.bytes / 1e6:.1f} MB of state from rank {source} in "
             f"{stats.seconds:.2f} s ({stats.gbps:.2f} GB/s, {stats.in_place} tensors in place)")
        self.store.set(keys.healed_key(self.rank), str(self.inc))

    def _resume(self) -> None:
        """The source of a fresh epoch: take the newest complete checkpoint, if any, into this
        worker's own tensors and its global step; the heal then sends that state to the others."""
        self._set_phase("resume")
        try:
            found = self.checkpoints.resume(self.state, self.total)
        except CheckpointMismatch as e:  # every worker says it: the supervisor quotes whichever exits first
            _log(f"rank {self.rank}: {e}")
            os._exit(keys.EXIT_CANNOT_GO_ON)
        except SAVE_ERRORS as e:  # a failed read left part of a checkpoint in the tensors: restart clean
            _log(f"rank {self.rank}: {str(e).splitlines()[0][:300]}; exiting so that ftrun restarts it clean")
            os._exit(keys.EXIT_REPLICA_RESTART)
        self._resumed = True
        if found is not None:
            self.step = found.step
            self.yielded = max(self.yielded, found.step - 1)
            if self._progress is not None:
                self._progress.note_step(self.step)

    def _set_heal_done(self, key: str, what: str) -> None:
        if self._heal_written:
            try:
                self.store.delete_key(self._heal_written)
            except Exception:
                pass
        self.store.set(key, what)
        self._heal_written = key

    def _await_heal(self, epoch: Epoch, ends: List[int], done_key: str) -> None:
        """A member that neither sends nor receives waits for the transfer to end, or for
        one of its ends to die (then the round fails and the next epoch moves on)."""
        self._set_phase("heal-wait")
        t0 = time.monotonic()
        if not membership.await_transfer(self.store, epoch, ends, done_key, time.sleep, POLL_S):
            return
        if time.monotonic() - t0 > SLOW_S:
            _log(f"rank {self.rank}: waited {time.monotonic() - t0:.1f} s for the state transfer of quorum {epoch.id}")

    def _inject_send_delay(self) -> None:
        delay = float(os.environ.get("FTRUN_FT_INJECT_SEND_DELAY", "0"))
        if delay:  # fault injection for tests: widen the window in which the source can die mid-transfer
            time.sleep(delay)

    def _taint(self) -> None:
        self._tainted = True


_manager: Optional[Manager] = None


def manager() -> Manager:
    global _manager
    if _manager is None:
        _manager = Manager()
    return _manager
