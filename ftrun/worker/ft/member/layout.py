"""A member's layout rounds (ft/api/ddp.py): the first round after a heal (with DDP's own reducer
sending, on every new group) sends nothing during the backward, so every member's DDP records
the order in which gradients become ready and builds the same buckets; each wrapped model's
layout average then reduces the gradients once, over those buckets as the next round sends them
(bitwise what a round on an unchanged group computes), and the round is voted as any other. Where a
model has none (a hook that does not average gradients, sparse gradients) the round is discarded
by all, with no vote. Must never import torch, and never import the supervisor.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional

from ftrun.wire import Quorum


class LayoutLost(Exception):
    """A layout round's reduction could not go through (a collective failed, no group): the round
    is voted down. Anything else a reduction raises is the script's error and reaches it."""


class LayoutRounds:
    """Whether this round is a layout round, and the wrapped models' averages; owned by the driver."""

    def __init__(self) -> None:
        self.uses_ddp = False  # a layout round follows each heal only for DDP's buckets (ft/api/ddp.py)
        self.each_group = False  # DDP's reducer sends (ft/api/ddp.py): a layout round on every new group
        self.round = False  # this round is a layout round
        self.averages: List[Optional[Callable[[], None]]] = []  # one per wrapped model
        self.serial = 0  # counts layout rounds planned and their sub-steps voted: a model's average runs once in each
        self.planned = 0  # counts layout rounds planned: a model averages only in one whose forward it ran

    def use_ddp(self, uses: bool = True) -> None:
        """A model was wrapped in ft.DistributedDataParallel (ft/api/ddp.py)."""
        self.uses_ddp = uses

    def reducer_sends(self, sends: bool = True) -> None:
        """DDP's own reducer sends the gradients (ft/api/ddp.py): a layout round on every new group."""
        self.each_group = sends

    def plan(self, quorum: Quorum) -> None:
        """The first round on the group just formed: a layout round after a heal for DDP's buckets,
        and on every group when DDP's own reducer sends. Every member of a group formed it at the
        same round, so they all agree."""
        self.round = self.uses_ddp and (self.each_group or bool(quorum.healers or quorum.fresh))
        self.serial += 1
        self.planned += 1

    def forget(self) -> None:
        """The member left its quorum (a rejoin, a store move): no layout round is pending."""
        self.round = False

    def can_average(self) -> bool:
        """Whether every wrapped model's gradients can be averaged in a layout round."""
        return bool(self.averages) and None not in self.averages

    def take(self, sub_step: bool = False) -> Optional[bool]:
        """At the vote: None when this is no layout round, else whether it is voted (False: it is
        discarded by all, with no vote). Either way the next round is an ordinary one. A sub-step
        (several ft.Optimizers, member/iteration.py) leaves the round a layout round to the loop
        step's end (`end`): each of its backwards averages, each model once a sub-step."""
        if not self.round:
            return None
        if not sub_step:
            self.round = False
        return self.can_average()

    def sub_step_voted(self) -> None:
        """A sub-step of a layout round was voted: its models' averages ran; the next sub-step's run again."""
        if self.round:
            self.serial += 1

    def end(self) -> None:
        """A loop step of sub-steps ended: the next round is an ordinary one."""
        self.round = False

    @staticmethod
    def average(averages: List[Optional[Callable[[], None]]], group: Any, fail: Callable[[str], None]) -> None:
        """Run the layout round's averages (each once a round: a model's runs as its backward
        returns); a failed one votes the round down. Without a group nothing is sent: the member
        votes the round down anyway."""
        if group is None:
            return
        try:
            for average in averages:
                average()  # type: ignore[misc]
        except LayoutLost as e:  # the group broke: this round is voted down
            fail(str(e))
