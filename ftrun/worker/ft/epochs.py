"""A member's epochs (mixed into manager.Manager): learning of new epochs off the training thread,
joining, switching at the agreed round (ft/membership.py holds the store protocol the simulator
shares), forming the epoch's groups and dropping them. Must never import the supervisor.
"""

from __future__ import annotations

import datetime
import gc
import threading
import time
from typing import List, Optional

import torch.distributed as dist

from ftrun import protocol as keys
from ftrun.protocol import Epoch
from ftrun.worker.ft import membership
from ftrun.worker.ft.group import abort_group, build_group_watched
from ftrun.worker.ft.member.core import AskEntryRound, Entered, Entering, Finish, Joined, Restart
from ftrun.worker.ft.member_io import POLL_S, SLOW_S, _log_detail, restart_replica
from ftrun.worker.settings import run_store


class Epochs:
    """Joining and switching epochs; the state is Manager's."""

    # ------------------------------------------------------------ membership
    def _watch_epochs(self) -> None:
        """Learn of each new epoch as the supervisor publishes it, off the training thread
        (a blocking read of the next epoch's key): the step itself never asks. Follows the run's
        store when it moves (the training thread reconnects first and sets latest_seen there)."""
        gen = None
        while True:
            if gen != self.store_gen:
                gen = self.store_gen
                host, _, port = run_store().rpartition(":")
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
        if entry.finished is None:
            self.latest_seen = entry.latest  # the newest epoch: a round we close names it, so members move on to it
            if self._watcher is None:
                self._watcher = threading.Thread(target=self._watch_epochs, name="ftrun-epochs", daemon=True)
                self._watcher.start()
        for c in self.core.handle(Joined(entry.epoch, entry.round, entry.finished)):
            if isinstance(c, Finish):
                self.step = c.step
                if c.alone:
                    self._finish_without_peers()
                return
            self._switch(c.epoch, joining=True)
        self.store.set(keys.entered_key(self.rank), str(self.inc))
        if self.epoch is not None and self.in_sync:
            _log_detail(f"rank {self.rank} (incarnation {self.inc}) joined quorum {entry.epoch} at step {self.step} "
                 f"after {time.time() - t0:.2f} s")

    def _switch(self, epoch_id: int, joining: bool = False) -> None:
        epoch = membership.read_epoch(self.store, epoch_id)
        commands = self.core.handle(Entering(epoch, (self.rank, self.inc), joining))
        for c in commands:
            if isinstance(c, Restart):
                restart_replica(f"rank {self.rank}: {c.why}; exiting so that ftrun restarts and heals it")
        if epoch.stop:
            self._stop_here(epoch)
        asked = any(isinstance(c, AskEntryRound) for c in commands)
        self.core.handle(Entered(epoch, membership.entry_round(self.store, epoch, self.round) if asked else self.round))
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
            _log_detail(f"rank {self.rank}: forming the group of quorum {epoch.id} (round {self.group_round}) took {took:.1f} s")
        if epoch.healers or epoch.fresh:
            self._heal(epoch)
        self._plan_layout(epoch)
        for fn in self.group_listeners:
            fn(self.pg)

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

        return build_group_watched(run_store(), prefix, ranks.index(self.rank), len(ranks),
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
