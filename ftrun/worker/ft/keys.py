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


def vote_key(round_: int, rank: int) -> str:
    return f"{PREFIX}vote/{round_}/{rank}"   # "ok E" / "fail E" / "dead E": written once (compare_set)


def round_key(rank: int) -> str:
    return f"{PREFIX}round/{rank}"    # the last round this replica voted in


def inc_key(rank: int) -> str:
    return f"{PREFIX}inc/{rank}"      # live incarnation of the replica, or "dead"


def join_key(rank: int) -> str:
    return f"{PREFIX}join/{rank}"     # incarnation that asks to join


def healed_key(rank: int) -> str:
    return f"{PREFIX}healed/{rank}"   # incarnation that holds the committed state


def state_key(epoch: int, attempt: int = 0) -> str:
    return f"{PREFIX}state/{epoch}/{attempt}"   # serialized state sent by the epoch's source


def info_key(rank: int) -> str:
    return f"{PREFIX}info/{rank}"     # JSON counters for `ftrun status`


def pg_prefix(epoch: int, attempt: int) -> str:
    return f"{PREFIX}pg/{epoch}/{attempt}/"


@dataclass(frozen=True)
class Epoch:
    """Who takes part from a round on: (rank, incarnation) pairs, and which of them must heal."""

    id: int
    members: Tuple[Tuple[int, int], ...]
    healers: Tuple[int, ...] = ()
    # No member holds committed state (the first epoch, or every holder died):
    # the lowest rank's state is sent to the others, from `start_round`.
    fresh: bool = False
    start_round: int = 0

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
                   bool(d.get("fresh", False)), int(d.get("start_round", 0)))
