"""The survivors' way through a failure: what a surviving replica pays between a peer's death and
the next quorum's groups. A member whose round failed drops its group so that a peer blocked in
the same collective on it (a ring all-reduce leaves live peers waiting on live peers) fails at
once: gloo closes a group's connections only when the group is freed (its abort does not), so the
group must go the moment it is dropped, without a full garbage collection of the process (about
0.2 s with torch loaded, paid once by each survivor in turn before its vote, measured by
scripts/bench_heal.py --spares both).
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import weakref

import pytest
import torch
import torch.distributed as dist

from ftrun.hookspec import HookSpec
from ftrun.worker.ft.heal.state import ReplicaState
from ftrun.worker.ft.member.group import build_group
from ftrun.worker.ft.member.torch_effects import TorchEffects
from ftrun.worker.hooks import Registration


@contextlib.contextmanager
def no_automatic_gc():
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def full_collections() -> int:
    return gc.get_stats()[2]["collections"]


def group_of_one(prefix: str) -> dist.ProcessGroup:
    return build_group(dist.HashStore(), prefix, 0, 1)


@pytest.mark.parametrize("hook", ["allreduce", "powersgd"])
def test_a_hook_registration_lets_its_group_go_without_a_collection(hook):
    """The hook's registration (what the --ft DDP holds per group) is no reference cycle: dropped,
    its group is freed by reference counting, so its connections close at once."""
    model = torch.nn.Linear(4, 2)
    with no_automatic_gc():
        pg = group_of_one(f"test/{hook}/")
        gone = weakref.ref(pg)
        reg = Registration(HookSpec(name=hook), model, pg)
        del pg, reg
        assert gone() is None, "the registration kept its group alive until a garbage collection"


def test_a_dropped_group_is_collected_only_when_something_still_holds_it():
    """TorchEffects drops a group and tells the listeners; it collects the process's garbage only
    when the group outlived them (held in a cycle), never on the way of every failure."""
    fx = TorchEffects(ReplicaState(), 0, datetime.timedelta(seconds=10))
    held: list = []
    fx.group_listeners.append(lambda g: held.__setitem__(slice(None), [g] if g is not None else []))
    with no_automatic_gc():
        pg = group_of_one("test/drop/")
        fx.group_changed(pg)
        gone = weakref.ref(pg)
        before = full_collections()
        fx.drop_group(pg)
        del pg
        fx.group_changed(None)
        assert gone() is None
        assert full_collections() == before, "a full garbage collection ran although the group was gone"

        # A listener that leaves the group in a cycle: a collection still frees it (the backstop).
        def cyclic(g):
            if g is not None:
                loop: dict = {"pg": g}
                loop["self"] = loop
        fx.group_listeners.append(cyclic)
        pg = group_of_one("test/drop2/")
        fx.group_changed(pg)
        gone = weakref.ref(pg)
        fx.drop_group(pg)
        del pg
        fx.group_changed(None)
        assert gone() is None and full_collections() == before + 1
