"""A member's heals: the committed state moves from the quorum's source to its healers over a group
of just them (the transfer itself is the effects': ft/heal/transport.py on the worker); a fresh quorum's
source first resumes from the newest checkpoint. This component owns the heal's bookkeeping:
whether the member's state is tainted, the store generation it last healed in, the key it wrote,
and the figures `ftrun status` shows. Must never send a half-received state, never import torch,
and never import the supervisor.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from ftrun import exits, keys
from ftrun.wire import Quorum
from ftrun.worker.ft.member import membership
from ftrun.worker.ft.member import core
from ftrun.worker.ft.member.core import InSync
from ftrun.worker.ft.member.effects import HealRefused
from ftrun.worker.ft.member.member_io import PEER_LOST


class HealTransfers:
    """State transfers between replicas, as one member sees them."""

    def __init__(self, driver: Any) -> None:  # the member/driver.py MemberDriver that owns this part
        self.d = driver
        self.tainted = False  # part of a transfer landed in this replica's tensors and it failed, or it stepped past a round voted down
        self.healed_gen = 0  # the store generation in which healed_key was last written
        self.written: Optional[str] = None  # the heal key this member wrote last (deleted at the next)
        self.resumed = False  # this incarnation resumed a checkpoint (a fresh quorum's source does once)
        self.count = 0
        self.last_heal_s: Optional[float] = None
        self.last_transfer: Optional[Dict[str, Any]] = None

    def taint(self) -> None:
        self.tainted = True

    def rejoined(self) -> None:
        """A rejoin in place: its state is not the committed one until it heals (named the source
        of a fresh quorum meanwhile, it restarts: core.source_refuses)."""
        self.tainted = True
        self.written = None

    def store_moved(self) -> None:
        self.written = None

    def holds_state(self) -> bool:
        d = self.d
        return core.holds_state(d.in_sync, self.healed_gen, d.store_gen)

    def heal(self, quorum: Quorum) -> None:
        """Move the committed state from the quorum's source to its healers, over a group of just
        those replicas; the other members wait (bounded by the liveness of the transfer's ends)
        so their next collective does not time out behind the transfer."""
        d, fx = self.d, self.d.fx
        ends = core.transfer_ends(quorum, d.rank, d.k)
        source = ends[0]
        done_key = keys.heal_key(quorum.id, d.group_round, d.shard_id)
        if d.rank not in ends:
            self._await(quorum, ends, done_key)
            return
        sending = d.rank == source
        if membership.gone(d.store, quorum, ends):
            # An end of the transfer is gone: forming its group would wait for it until the timeout.
            d.fail_round(f"the state transfer of quorum {quorum.id} lost an end before it began")
            if sending:
                self._done(done_key, "fail")
            return
        # A spare's fed state is not the committed one: named a fresh quorum's source, it restarts clean.
        refused = d.source_refuses(sending, self.tainted or fx.fed(), quorum.fresh, self.holds_state(), d.k)
        if refused is not None:
            d.execute([refused])
        if core.resumes_checkpoint(sending, bool(quorum.fresh), d.in_sync, d.checkpoints is not None, self.resumed):
            d.stops.resume()
            self.resumed = True
        d.set_phase("send" if sending else "heal")
        t0 = fx.wall()
        hpg = None
        try:
            hpg = d.entry.form(keys.pg_prefix(quorum.id, d.group_round, d.shard_id) + "heal/", quorum, ends)
            kept = self._kept(hpg, sending)
            if sending:
                stats = fx.send_state(hpg, (d.round, d.step, d.yielded, d.iteration.done), kept)
            else:
                snapshot, stats = fx.receive_state(hpg, self.taint, kept)
                d.took_state(snapshot)
                self.tainted = False
        except HealRefused as e:
            # Not a failure of the transfer: this replica's model, optimizer or registered state
            # differ from its peers'. Retrying would fail the same way.
            fx.exit(exits.EXIT_FAILED, f"rank {d.rank}: cannot take the state of rank {source}: {e}. This replica's "
                                      f"model, optimizer or ft.register_state() objects differ from its peers'; "
                                      f"exiting")
        except Exception as e:  # an end of the transfer died: this round fails, the next quorum heals again
            fx.drop_group(hpg)
            who = "to its healers" if sending else f"from rank {source}"
            if d.round_ok:
                fx.log_detail(f"rank {d.rank}: state transfer {who}: {str(e).strip()}")
                fx.log(f"rank {d.rank}: the state transfer {who} failed"
                       f"{' (a peer left)' if PEER_LOST.search(str(e)) else ''}; healing again in the next quorum")
            d.fail_round()
            if sending:
                self._done(done_key, "fail")
            return
        fx.drop_group(hpg)
        took = fx.wall() - t0
        if stats is not None:
            self.last_transfer = {"bytes": stats.bytes, "s": round(stats.seconds, 4), "gbps": round(stats.gbps, 3),
                                  "in_place": stats.in_place, "allocated": stats.allocated}
        if sending:
            self._done(done_key, "ok")
            if not self.holds_state():
                # A fresh quorum's source (its state is the run's state from now on), or the
                # source of the first quorum on a store that moved, which knows nothing yet.
                self._synced()
            return
        self._synced()
        self.count += 1
        self.last_heal_s = round(took, 4)
        if stats is not None:
            fx.log_detail(f"rank {d.rank}: received {stats.bytes / 1e6:.1f} MB of state from rank {source} in "
                          f"{stats.seconds:.2f} s ({stats.gbps:.2f} GB/s, {stats.in_place} tensors in place)")

    def _kept(self, hpg: Any, sending: bool) -> bool:
        """Whether this heal keeps the healers' fed models and optimizers: the effects compare the
        fed states (in a run with hot spares), the member core decides, and a sharded replica's
        shards agree on one answer."""
        found = self.d.fx.compare_fed(hpg, sending, self.d.step)
        if found is None:
            return False
        (move,) = self.d.core.handle(found)
        return self.d.fx.agree_kept(hpg, move.kept, sending)

    def _synced(self) -> None:
        d = self.d
        d.core.handle(InSync())
        self.healed_gen = d.store_gen
        d.store.set(keys.healed_key(d.rank), str(d.inc))

    def _done(self, key: str, what: str) -> None:
        store = self.d.store
        if self.written:
            try:
                store.delete_key(self.written)
            except Exception:  # noqa: BLE001 - the key goes with the quorum anyway
                pass
        store.set(key, what)
        self.written = key

    def _await(self, quorum: Quorum, ends: List[int], done_key: str) -> None:
        """A member that neither sends nor receives waits for the transfer to end, or for one of
        its ends to die (then the round fails and the next quorum moves on)."""
        d, fx = self.d, self.d.fx
        d.set_phase("heal-wait")
        t0 = fx.now()
        if membership.await_transfer(d.store, quorum, ends, done_key, fx.sleep, fx.poll_s):
            d._slow(t0, f"the state transfer of quorum {quorum.id}")
