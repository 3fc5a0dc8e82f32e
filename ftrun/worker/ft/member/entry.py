"""The member's way into a quorum: joining (ft/member/membership.py's store protocol), switching at the
agreed round, forming the quorum's group and dropping it. Owns the member's group. Must never
import torch, and never import the supervisor.
"""

from __future__ import annotations

from typing import Any, List

from ftrun import keys
from ftrun.wire import Quorum
from ftrun.worker.ft.member import membership
from ftrun.worker.ft.member import core
from ftrun.worker.ft.member.core import AskEntryRound, Entered, Entering, Joined
from ftrun.worker.ft.member.vote import StoreMovedMidVote


class QuorumEntry:
    """Joins and switches; the quorum's group (`pg`) is its own."""

    def __init__(self, driver: Any) -> None:  # the member/driver.py MemberDriver that owns this part
        self.d = driver
        self.pg: Any = None  # the quorum's group of this worker's shard (all of the replica's when k == 1)

    def join(self) -> None:
        """Ask the keeper to take this incarnation in, and wait for a quorum that has it."""
        d = self.d
        d.set_phase("join")
        t0 = d.fx.wall()
        entry = d.wait_to_enter(d.store, (d.rank, d.inc), d.fx.join_sleep(), d.fx.poll_s, moved=d.moves.announced)
        if entry.moved:  # the start's connection reached another store at the run's old address
            raise StoreMovedMidVote("this node's ftrun announced that the run's store moved while this member "
                                    "waited to join on a store at its old address")
        if entry.finished is None:
            d.watch.seen(entry.latest)  # the newest quorum: a round we close names it, so members move on
            d.watch.start()
        d.execute(d.core.handle(Joined(entry.quorum, entry.round, entry.finished)))
        if d.core.finished:
            return
        d.store.set(keys.entered_key(d.rank), str(d.inc))
        if d.quorum is not None and d.in_sync:
            d.fx.log_detail(f"rank {d.rank} (incarnation {d.inc}) joined quorum {entry.quorum} at step "
                        f"{d.step} after {d.fx.wall() - t0:.2f} s")

    def switch(self, quorum_id: int, joining: bool = False) -> None:
        """Enter quorum `quorum_id` (a new quorum, or the same one to rebuild its group): its round,
        its group, its heal."""
        d = self.d
        quorum = membership.read_quorum(d.store, quorum_id)
        commands = d.core.handle(Entering(quorum, (d.rank, d.inc), joining))
        d.execute(commands)
        if quorum.stop:
            d.stops.stop_here(quorum)
        asked = any(isinstance(c, AskEntryRound) for c in commands)
        d.core.handle(Entered(quorum, d.entry_round(d.store, quorum, d.round) if asked else d.round))
        d.set_phase("group")
        self.drop_group(quiet=True)
        gone = membership.gone(d.store, quorum, quorum.ranks)
        if gone:  # connecting would wait for the dead until the timeout; the next quorum drops them
            d.fail_round(gone)
        else:
            t0 = d.fx.now()
            try:
                self.pg = self.form(keys.pg_prefix(quorum.id, d.group_round, d.shard_id), quorum,
                                    d.shard_ranks(quorum))
            except Exception as e:  # a member died while we connected: this round fails, the next quorum fixes it
                d.fail_round(f"could not form the group of quorum {quorum.id}: {str(e).splitlines()[0]}")
            d._slow(t0, f"the group of quorum {quorum.id} (round {d.group_round})")
        if quorum.healers or quorum.fresh:
            d.heals.heal(quorum)  # also after a gone end: the transfer's ends must say how it went
        d.layout.plan(quorum)
        d.fx.group_changed(self.pg)

    def form(self, prefix: str, quorum: Quorum, ranks: List[int]) -> Any:
        """A group of `ranks`, given up as soon as one of them dies or a newer quorum is out."""
        d = self.d
        return d.fx.form_group(prefix, quorum, ranks, lambda: core.gives_up(
            d.latest_seen, quorum.id, lambda: membership.gone(d.store, quorum, ranks)))

    def drop_group(self, quiet: bool = False) -> None:
        """Close this member's connections at once: peers blocked in a failed collective then fail
        within milliseconds instead of waiting for the library's timeout."""
        d = self.d
        old, self.pg = self.pg, None
        d.fx.drop_group(old)
        del old  # the listeners below hold the last references: it is freed as they let it go
        if not quiet:
            d.fx.group_changed(None)
