"""A framework's training loop (Lightning's fit loop, the Hugging Face Trainer's) driven as an
ftrun.ft loop: the framework-neutral part of running it under --ft.

The framework keeps its loop; this class is told where the loop is and does what ft.epochs()
and ft.Optimizer do for a hand-written one:
- `start()` before the loop's first step: the member joins (a restarted replica heals here,
  before the framework builds its data iterator, so it starts from the run's position);
- `step_top()` at the top of each of the loop's steps (a no-op for the first, which start() opened);
- `until_committed(attempt)` around the framework's optimizer step: an attempt whose round is
  discarded (a peer died mid-step) changed nothing, and is made again from its round's top, so
  the framework's counters (its global step, its batch index) count committed steps only;
- `until_complete(attempt)` around a step in which the script steps its optimizers itself
  (Lightning's manual optimization): the same, a step at a time, its committed sub-steps kept;
- `finish()` when the loop is over.
The framework's whole state (its loop's progress, schedulers, callbacks...) travels in heals and
checkpoints as registered state, beside the model and optimizer ft's DDP and ft.Optimizer
registered: `capture()` on the source, `restore()` on a replica that heals before its loop starts.
A heal in place later (a member whose step the others' decision contradicted) cannot put a
framework's loop back a step: that replica restarts instead and heals as a new one.
Must never decide a step's fate (ft.Optimizer's vote does), and never import the supervisor.
"""

from __future__ import annotations

import io
import pickle
import sys
from typing import Any, Callable, Dict, Optional, TypeVar

import torch

from ftrun.worker.ft.manager import Manager, manager

T = TypeVar("T")


def say(line: str) -> None:
    """One line in ftrun's words ("--ft: ..."), from each node's first worker (the others would say
    the same): every node's console has it, and its supervisor then knows that this script's
    framework said why it cannot heal (ftrun.supervisor.workers.logs, FRAMEWORK_LINE)."""
    from ftrun.worker import settings

    if settings.current().local_rank == 0:
        sys.stderr.write(f"ftrun: {line}\n")
        sys.stderr.flush()


class _State:
    """The framework's state as registered state (state_dict / load_state_dict), packed as one
    torch.save blob: a framework's state changes shape as it trains (a callback's dict of best
    checkpoints grows), which a heal's skeleton and a checkpoint's target (DCP loads what the
    resuming replica's own state holds) would not follow; as bytes it travels whole. It is read
    back with weights_only=True, as a heal's skeleton is."""

    def __init__(self, loop: "FrameworkLoop") -> None:
        self.loop = loop

    def state_dict(self) -> Dict[str, Any]:
        buf = io.BytesIO()
        torch.save(self.loop.capture(), buf)
        return {"state": buf.getvalue()}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        try:
            state = torch.load(io.BytesIO(sd["state"]), weights_only=True)
        except pickle.UnpicklingError as e:
            raise RuntimeError(f"the {self.loop.name} state holds an object torch.load(weights_only=True) does "
                               f"not load: {str(e).splitlines()[0]}") from None
        self.loop.received(state)


class FrameworkLoop:
    """One per process: the framework's loop as a member of the run (see the module's docstring)."""

    def __init__(self, name: str, capture: Callable[[], Dict[str, Any]],
                 restore: Callable[[Dict[str, Any]], None]) -> None:
        self.mgr: Manager = manager()
        self.name = name
        self.capture = capture
        self._restore = restore
        self.starting = False  # inside start(): a heal now lands before the framework's loop runs
        self.running = False   # between start() and finish()
        # Where the replicas are in step (across()): inside a training step (step_top() to its
        # commit), and between steps once this process committed one of its own.
        self.in_step = False
        self.stepped = False
        self.mgr.register_state(f"ftrun.framework.{name}", _State(self))

    def received(self, sd: Dict[str, Any]) -> None:
        if self.running and not self.starting:
            # A heal in place mid-loop: the model went back to the committed step, but the
            # framework's loop cannot; a new process takes it all from a peer.
            self.mgr.member.restart(f"the {self.name} loop stepped past a step the others discarded")
        self._restore(sd)

    def start(self) -> None:
        self.running = self.starting = True
        self.in_step = self.stepped = False
        self.mgr.looping = True
        try:
            self.mgr.begin_step()
        finally:
            self.starting = False

    def step_top(self) -> None:
        self.mgr.begin_step()
        self.in_step = True

    def until_committed(self, attempt: Callable[[], T], stepped: Callable[[], bool]) -> T:
        """Run `attempt` (the framework's optimizer step: forward, backward, vote, step) until its
        round commits; each attempt after the first starts from the round's top."""
        while True:
            out = attempt()
            if stepped():
                self.in_step, self.stepped = False, True
                return out
            self.mgr.begin_step()

    def until_complete(self, attempt: Callable[[], T], discarded: Callable[[], bool],
                       again: Callable[[], None] = lambda: None) -> T:
        """Run `attempt` (one of the loop's steps in which the script steps its optimizers itself,
        each step of each a sub-step) until none of its optimizer steps is discarded: an attempt
        that lost one is made again from the next round's top, on the same step, and its
        committed sub-steps return False without stepping (ft.Optimizer), so each optimizer
        steps once per step among committed ones. `again()` puts back what the lost attempt
        changed outside the tensors, before that round's top: a heal there sends this replica's
        state, which must be the step's top, not the lost attempt's."""
        while True:
            out = attempt()
            if not discarded():
                self.in_step, self.stepped = False, True
                return out
            again()
            self.mgr.begin_step()

    def finish(self) -> None:
        if self.running:
            self.running = self.in_step = self.stepped = False
            self.mgr.finish_loop()

    def across(self, send: Callable[[Any], T], local: Callable[[], T]) -> T:
        """A collective the framework makes (a metric's reduce, a barrier, a broadcast...):
        `send(group)` over the replicas alive in the step, where all of them make it at the same
        point of the loop: inside a training step (its round: a failure votes it down and the
        step is redone), or between steps once this process has committed a step. Elsewhere it
        is `local()`, this replica's own: before this process's first step a restarted replica
        runs start-up hooks (barriers, sanity checks) its peers ran long ago, and a collective
        there would pair with a peer's gradient all-reduce. Between steps the last round's
        decision is taken in first: a member it contradicts is about to take the state again
        and sends nothing. A collective that fails (a peer died in it) votes the current round
        down and gives local()."""
        if not self.running or not (self.in_step or self.stepped):
            return local()
        mgr = self.mgr
        mgr.before_collective()
        group = mgr.pg
        if group is None or not (mgr.round_ok and mgr.in_sync):
            return local()
        try:
            return send(group)
        except RuntimeError as e:  # torch's collective errors (DistBackendError is one)
            mgr.fail_round(str(e))
            return local()

    # ------------------------------------------------------------ what the script may ask
    @property
    def num_replicas(self) -> int:
        return self.mgr.num_replicas

    @property
    def replica_index(self) -> int:
        return self.mgr.replica_index

    def misused(self, why: str) -> None:
        self.mgr._misused(why)


_loop: Optional[FrameworkLoop] = None


def framework_loop(name: str, capture: Callable[[], Dict[str, Any]],
                   restore: Callable[[Dict[str, Any]], None]) -> FrameworkLoop:
    """The process's framework loop (one per process: a second fit() reuses it, re-pointed)."""
    global _loop
    if _loop is None:
        _loop = FrameworkLoop(name, capture, restore)
    else:
        _loop.capture, _loop._restore = capture, restore
    return _loop
