"""The member's run's store, and its moves (mixed into manager.Manager): connecting, telling a
store that went away from a slow one, and rejoining on the store the nodes agreed on next,
holding this replica's state; and rejoining as a new incarnation of this process, to take the
committed state from a peer in place (`_rejoin`). Must never rewrite anything but the store's address, and never
import the supervisor.
"""

from __future__ import annotations

import json
import time
from typing import Optional, Tuple

import torch.distributed as dist

from ftrun import protocol as keys
from ftrun.worker.ft import vote
from ftrun.worker.ft.member.core import MemberCore, StoreLost
from ftrun.worker.ft.member_io import POLL_S, _log, _log_detail, restart_replica
from ftrun.worker.settings import run_store, store_moved

RELOCATE_S = 120.0  # the nodes agree on a new store in seconds; a node that cannot stops its workers
STORE_PROBES = 5  # connections 0.1 s apart that must all get in for the run's store to count as up


class StoreMoves:
    """Where the run's store is; the state is Manager's."""

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

    def _store_gone(self) -> bool:
        """Whether the run's store stopped answering (as opposed to a slow wait on a live one).
        One answer is not enough: a store whose process is being killed resets its connections
        before the kernel closes its listening socket. A live store answers every probe."""
        import socket

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

    def _relocate(self, error: BaseException) -> None:
        """The run's store went away under a store operation (its node was lost). Wait for this
        node's ftrun to announce the next one, connect to it, and rejoin holding this replica's
        state: the keeper of the new store heals every replica from the one holding the newest
        whole step. Re-raises `error` when the store did not move."""
        if self.node is None or not self._store_gone():
            raise error
        _log(f"rank {self.rank}: lost the run's store at {run_store()} "
             f"({str(error).splitlines()[0][:120]}); waiting for the nodes to agree on the next one")
        t0 = time.monotonic()
        deadline = t0 + RELOCATE_S
        while True:
            moved = self._announced_store()
            if moved is not None and moved[0] > self.store_gen:
                break
            if time.monotonic() > deadline:
                restart_replica(f"rank {self.rank}: no new store within {RELOCATE_S:g} s; exiting")
            time.sleep(POLL_S * 4)
        gen, addr = moved
        self._drop_group()
        store_moved(addr)  # group formation, the epoch watcher and checkpoint reports connect there
        self._connect(addr)
        while not self.store.check([keys.LATEST]):  # the new keeper's first words
            if time.monotonic() > deadline:
                restart_replica(f"rank {self.rank}: the run's new store at {addr} has no keeper; exiting")
            time.sleep(POLL_S)
        self.latest_seen = int(self.store.get(keys.LATEST))
        self.store_gen = gen  # the epoch watcher reconnects on this
        if self._progress is not None:
            self._progress.move_to(addr)
        self.core.handle(StoreLost())
        self.layout_round = False
        self._waiting_round = None
        self._save_due = False
        self.taken = 0
        self._heal_written = None
        self.store.set(keys.survivor_key(self.rank), json.dumps(
            {"inc": self.inc, "step": self.step, "in_sync": self.in_sync and not self._tainted}))
        _log_detail(f"rank {self.rank}: the run's store moved to {addr} after {time.monotonic() - t0:.2f} s; rejoining "
             f"at step {self.step}")

    # ------------------------------------------------------------ a new incarnation, in place
    def _rejoin(self) -> None:
        """The peers decided a round this member stepped past otherwise (member_core.Rejoin): its
        state is not the committed one, its process is sound. It leaves its epoch as this
        incarnation and joins as the next, as a restarted process would: the supervisor books the
        change (keys.EVENTS, "rejoin"), takes the old incarnation out of the quorum and votes for
        it where it was due (it never votes again), and the keeper makes the new one a healer;
        the heal puts the committed state into this process's own model, optimizer, loaders and
        registered state, and the loop goes on from the healed step. Called at a round's top,
        with no vote in flight."""
        why, self._rejoin_why = self._rejoin_why, None
        if self.store_gen:  # a moved store's keeper is another node's ftrun, which cannot book it
            self._restart(why)
        old, new = self.inc, self.inc + 1  # the incarnation a restart would have been given
        self._drop_group()
        try:
            self.store.queue_push(keys.EVENTS, f"{self.rank} {old} rejoin {new}")
        except Exception:  # the store is gone or moving: the process restarts, as it did before
            self._restart(why)
        self.inc = new
        if self._progress is not None:
            self._progress.incarnation = new
        self.core = MemberCore(can_rejoin=True, round=self.round)
        self.layout_round = False
        self._waiting_round = None
        self._save_due = False
        self.taken = 0
        # Its state is not the committed one until it heals: named the source of a fresh quorum (every
        # holder died meanwhile), it restarts (member_core.source_refuses), as the run goes back to
        # its checkpoint or its first step.
        self._tainted = True
        self._heal_written = None
        self._index_of, self._node_count = (-1, 0), (-1, 0)
        _log(f"rank {self.rank}: {why}; taking the committed state from a peer in place (incarnation {new})")
