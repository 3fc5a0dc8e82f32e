"""Names of the store keys of the --ft protocol, shared by workers and the supervisor.

One place for the protocol's vocabulary, so both sides cannot drift apart.
Must never import torch (the supervisor imports it on its torch-free path).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import List, Tuple

PREFIX = "ftrun/ft/"
LATEST = PREFIX + "latest"            # id of the newest published epoch
FINISHED = PREFIX + "finished"        # set by members that left the loop: the final global step


def epoch_key(epoch: int) -> str:
    return f"{PREFIX}epoch/{epoch}"   # JSON Epoch, immutable once written


def start_key(epoch: int) -> str:
    return f"{PREFIX}start/{epoch}"   # round at which members switched to the epoch


# A round's votes are one counter per (epoch, round): each member adds 1 (ok) or
# FAIL_VOTE (failed); the supervisor adds FAIL_VOTE for a member it saw die. The add
# that brings the count of votes to the epoch's size closes the round: its author
# writes the decision, every other member reads it. O(1) store work per member.
FAIL_VOTE = 1 << 32
TOP = PREFIX + "top"                  # the newest round whose decision was written (a hint for the keeper)


def count_key(epoch: int, round_: int) -> str:
    return f"{PREFIX}n/{epoch}/{round_}"


def decision_key(epoch: int, round_: int) -> str:
    return f"{PREFIX}d/{epoch}/{round_}"  # "commit E" / "fail E": E = the epoch to be in from the next round


def tally(total: int) -> Tuple[int, int]:
    """(votes cast, failed votes) of a round's counter."""
    fails, oks = divmod(int(total), FAIL_VOTE)
    return oks + fails, fails


def inc_key(rank: int) -> str:
    return f"{PREFIX}inc/{rank}"      # live incarnation of the replica, or "dead"


def join_key(rank: int) -> str:
    return f"{PREFIX}join/{rank}"     # incarnation that asks to join


def entered_key(rank: int) -> str:
    return f"{PREFIX}entered/{rank}"  # incarnation that has entered an epoch (votes from now on)


def healed_key(rank: int) -> str:
    return f"{PREFIX}healed/{rank}"   # incarnation that holds the committed state


def heal_key(epoch: int, round_: int) -> str:
    # "ok"/"fail": the source's word that its transfer of the epoch ended (the state
    # itself goes over the process group, never through the store)
    return f"{PREFIX}heal/{epoch}/{round_}"


def info_key(rank: int) -> str:
    return f"{PREFIX}info/{rank}"     # JSON counters for `ftrun status`


def pg_prefix(epoch: int, round_: int) -> str:
    # Named by the round at which members (re)build it: every member rebuilds at the
    # same rounds (after a switch or a failed round), so the name needs no counter.
    return f"{PREFIX}pg/{epoch}/{round_}/"


@dataclass(frozen=True)
class Epoch:
    """Who takes part from a round on: (rank, incarnation) pairs, and which of them must heal."""

    id: int
    members: Tuple[Tuple[int, int], ...]
    healers: Tuple[int, ...] = ()
    # No member holds committed state (the first epoch, or every holder died):
    # the lowest rank's state is sent to the others.
    fresh: bool = False
    # Every member is new (no member of the previous epoch is alive): they start at
    # this round. Otherwise (-1) the continuing members switch by their votes and
    # write the round into start_key, which is where joiners begin.
    start_round: int = -1

    @property
    def ranks(self) -> List[int]:
        return sorted(r for r, _ in self.members)

    def incarnation(self, rank: int) -> int:
        return dict(self.members)[rank]

    def to_json(self) -> str:
        return json.dumps({"id": self.id, "members": [list(m) for m in self.members], "healers": list(self.healers),
                           "fresh": self.fresh, "start_round": self.start_round})

    @classmethod
    def from_json(cls, text) -> "Epoch":
        d = json.loads(text)
        return cls(d["id"], tuple(sorted((int(r), int(k)) for r, k in d["members"])), tuple(d.get("healers", ())),
                   bool(d.get("fresh", False)), int(d.get("start_round", -1)))
