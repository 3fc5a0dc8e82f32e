"""Where a member is inside one step of the loop whose optimizers step one after another.

A script with several ft.Optimizers (a GAN: the discriminator's step, then the generator's
backward and step) takes several optimizer steps in one step of its loop (one `ft.steps()` yield
or one batch of an ft.DataLoader). Each optimizer step is a sub-step; a step is committed when
all of its sub-steps are. A round is up to Quorum.round_steps loop steps, voted once, at the top
of the step after its last (the script's sub-steps are known only once it comes back to the
top); a failed round keeps its first P sub-steps (keys.kept_key), which may end inside a loop
step. That step is then handed out again (ft.redo() True) and its first sub-steps, committed
already, return False without stepping: every sub-step changes the state once.

This component owns that position; the driver (member/driver.py) asks it and tells it what
happened. Must never import torch, and never import the supervisor.
"""

from __future__ import annotations

SKIP, DISCARD, VOTE = "skip", "discard", "vote"


class Iteration:
    """One loop step's sub-steps, and the round's loop steps, for a member with several ft.Optimizers."""

    def __init__(self) -> None:
        self.several = False  # the script has several ft.Optimizers (fixed before its loop starts)
        self.index = 0  # sub-steps of the current loop step the script has asked for
        self.done = 0  # sub-steps of the current loop step committed before it was handed out (a redo)
        self.failed = False  # a sub-step of the current loop step voted its round down
        self.taken = 0  # sub-steps of the current loop step this member took
        self.steps = 0  # loop steps completed in the current round

    def next(self) -> str:
        """The script asks for its next sub-step: SKIP (committed before this step was handed out
        again), DISCARD (its round was voted down earlier in this step: no vote, no step) or VOTE."""
        self.index += 1
        if self.index <= self.done:
            return SKIP
        return DISCARD if self.failed else VOTE

    def took(self) -> None:
        self.taken += 1

    def voted_down(self) -> None:
        """A sub-step's round was voted down (or discarded by all) while this member goes on: it
        holds the sub-steps of this loop step it took, and the step is handed out again."""
        self.failed = True

    def top(self) -> bool:
        """The script is back at the top: True when the loop step it just left is complete (every
        sub-step it asked for was taken, or committed before); else it is handed out again, the
        sub-steps committed so far to be skipped."""
        complete = self.index > 0 and not self.failed
        if complete:
            self.done = 0
        elif self.failed:
            self.done += self.taken
        self.index, self.failed, self.taken = 0, False, 0
        return complete

    def store_moved(self) -> None:
        """The run's store moved inside a loop step: the sub-steps taken so far stand (whose state
        goes on is the keeper's choice, by step and sub-step), the rest of this step is discarded,
        and the step is handed out again."""
        self.failed = self.failed or self.index > 0
        self.steps = 0

    def held(self) -> int:
        """Sub-steps of the current loop step this member's state holds."""
        return self.done + self.taken

    def forget(self) -> None:
        """The member takes the committed state again: the heal says where in a step it is."""
        self.index, self.done, self.failed, self.taken, self.steps = 0, 0, False, 0, 0
