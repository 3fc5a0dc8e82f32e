"""A member's heals (mixed into manager.Manager): the committed state moves from the epoch's source
to its healers over a group of just them; a fresh epoch's source first resumes from the newest
checkpoint. Must never send a half-received state, and never import the supervisor.
"""

from __future__ import annotations

import os
import time
from typing import List


from ftrun import protocol as keys
from ftrun.protocol import Epoch
from ftrun.worker.ft import membership
from ftrun.worker.ft.checkpoint import SAVE_ERRORS, CheckpointMismatch
from ftrun.worker.ft.group import abort_group, group_device
from ftrun.worker.ft.member.core import InSync, source_refuses, transfer_ends
from ftrun.worker.ft.member_io import PEER_LOST, POLL_S, SLOW_S, _log, _log_detail, leave, restart_replica
from ftrun.worker.ft.transport import StateMismatch, receive_state, send_state


class Healing:
    """State transfers between replicas; the state is Manager's."""

    # ------------------------------------------------------------ healing
    def _heal(self, epoch: Epoch) -> None:
        """Move the committed state from the epoch's source to its healers, over a group of
        just those replicas; the other members wait (bounded by the liveness of the
        transfer's ends) so their next collective does not time out behind the transfer."""
        ends = transfer_ends(epoch, self.rank, self.k)
        source = ends[0]
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
        refused = source_refuses(sending, self._tainted, epoch.fresh,
                                 self.in_sync and self._healed_gen == self.store_gen, self.k)
        if refused is not None:
            restart_replica(f"rank {self.rank}: {refused.why}; exiting so that ftrun restarts it clean")
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
            leave(keys.EXIT_FAILED, f"rank {self.rank}: cannot take the state of rank {source}: {e}. This replica's "
                                    f"model, optimizer or ft.register_state() objects differ from its peers'; exiting")
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
                self.core.handle(InSync())
                self._healed_gen = self.store_gen
                self.store.set(keys.healed_key(self.rank), str(self.inc))
            return
        self.core.handle(InSync())
        self._healed_gen = self.store_gen
        self.heals += 1
        self.last_heal_s = round(took, 4)
        _log_detail(f"rank {self.rank}: received {stats.bytes / 1e6:.1f} MB of state from rank {source} in "
             f"{stats.seconds:.2f} s ({stats.gbps:.2f} GB/s, {stats.in_place} tensors in place)")
        self.store.set(keys.healed_key(self.rank), str(self.inc))

    def _resume(self) -> None:
        """The source of a fresh epoch: take the newest complete checkpoint, if any, into this
        worker's own tensors and its global step; the heal then sends that state to the others."""
        self._set_phase("resume")
        try:
            found = self.checkpoints.resume(self.state, self.total)
        except CheckpointMismatch as e:  # every worker says it: the supervisor quotes whichever exits first
            leave(keys.EXIT_CANNOT_GO_ON, f"rank {self.rank}: {e}")
        except SAVE_ERRORS as e:  # a failed read left part of a checkpoint in the tensors: restart clean
            restart_replica(f"rank {self.rank}: {str(e).splitlines()[0][:300]}; exiting so that ftrun restarts it "
                            f"clean")
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
            _log_detail(f"rank {self.rank}: waited {time.monotonic() - t0:.1f} s for the state transfer of quorum {epoch.id}")

    def _inject_send_delay(self) -> None:
        delay = float(os.environ.get("FTRUN_FT_INJECT_SEND_DELAY", "0"))
        if delay:  # fault injection for tests: widen the window in which the source can die mid-transfer
            time.sleep(delay)

    def _taint(self) -> None:
        self._tainted = True
