"""The member's run's store, and its moves: telling a store that went away from a slow one, and
following it to the store the nodes agreed on next, holding this replica's state (the keeper of
the new store heals every replica from the one holding the newest whole step). Must never rewrite
anything but the store's address, never import torch, and never import the supervisor.
"""

from __future__ import annotations

from typing import Any

from ftrun import keys

RELOCATE_S = 120.0  # the nodes agree on a new store in seconds; a node that cannot stops its workers


class StoreFollower:
    """Where the run's store is; owns nothing but the wait for its next address."""

    def __init__(self, driver: Any) -> None:  # the member/driver.py MemberDriver that owns this part
        self.d = driver

    def announced(self) -> bool:
        """This node's ftrun announced a newer run's store than the one this member uses. A worker
        that connected while the run's store was lost may have reached another store at its
        address (a restarted node binds it): no call there ever fails, so a member waiting to join
        on a store without the keeper's words asks this (membership.wait_to_enter)."""
        moved = self.d.fx.announced_store() if self.d.node is not None else None
        return moved is not None and moved[0] > self.d.store_gen

    def relocate(self, error: BaseException) -> None:
        """The run's store went away under a store operation (its node was lost), or this node's
        ftrun announced a newer one (another store may answer at the old address). Wait for the
        announcement, connect to the store it names, and rejoin holding this replica's state.
        Re-raises `error` when the store did not move."""
        d, fx = self.d, self.d.fx
        if d.node is None or not (fx.store_gone() or self.announced()):
            raise error
        fx.log(f"rank {d.rank}: lost the run's store at {fx.store_address()} ({str(error).splitlines()[0][:120]}); "
               f"waiting for the nodes to agree on the next one")
        t0 = fx.now()
        deadline = t0 + RELOCATE_S
        while True:
            moved = fx.announced_store()
            if moved is not None and moved[0] > d.store_gen:
                break
            if fx.now() > deadline:
                fx.restart(f"rank {d.rank}: no new store within {RELOCATE_S:g} s; exiting")
            fx.sleep(fx.poll_s * 4)
        gen, addr = moved
        d.entry.drop_group()
        fx.store_moved(addr)  # group formation, the quorum watcher and checkpoint reports connect there
        store = fx.connect()
        while not store.check([keys.LATEST]):  # the new keeper's first words
            if fx.now() > deadline:
                fx.restart(f"rank {d.rank}: the run's new store at {addr} has no keeper; exiting")
            fx.sleep(fx.poll_s)
        d.moved_store(gen, store, int(store.get(keys.LATEST)))
        fx.log_detail(f"rank {d.rank}: the run's store moved to {addr} after {fx.now() - t0:.2f} s; rejoining "
                      f"at step {d.step}")
