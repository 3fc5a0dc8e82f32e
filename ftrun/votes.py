"""A round's votes and decision under --ft: the counter's fields, the decision's text, the tally.

Each member of a quorum adds one vote to the round's counter (ftrun.keys.count_key); the add that
completes the count writes the decision (ftrun.keys.decision_key). How the votes are packed into
that one counter, how the decision reads, and which add closes a round are here, once, for the
members (worker/ft/member/vote.py), the keeper (supervisor/ft) and the simulator alike. Pure
arithmetic and text on values read from a store by the caller (read_kept takes the store it is
given): must never import torch, nor anything of ftrun's but ftrun.keys.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

from ftrun.keys import kept_key

# A round's votes are one counter per (quorum, round): each member adds OK_VOTE or FAIL_VOTE; the
# supervisor adds ABSTAIN_VOTE for a member it saw die (had it finished the round's collectives, its
# peers' succeeded too) and FAIL_VOTE for a live member that will never vote there. The add that
# takes the count to the quorum's size (or past it: closes) writes the decision (commit: no failed
# vote, one ok at least); the others read it. Each field has 21 bits: 2M votes of a kind per round.
OK_VOTE = 1
ABSTAIN_VOTE = 1 << 21
FAIL_VOTE = 1 << 42


def read_kept(store, quorum: int, rnd: int) -> int:
    """The steps of a failed round that stand: none unless a failed member said otherwise."""
    key = kept_key(quorum, rnd)
    return int(store.get(key)) if store.check([key]) else 0


def decision_text(commit: bool, quorum: int, kept: int = 0) -> str:
    return f"commit {quorum}" if commit else (f"fail {quorum} {kept}" if kept else f"fail {quorum}")


def parse_decision(text: str) -> Tuple[bool, int, Optional[int]]:
    """(commit, newest quorum its author had seen, steps kept: None for all of them)."""
    parts = text.split()
    commit = parts[0] == "commit"
    return commit, int(parts[1]), None if commit else (int(parts[2]) if len(parts) > 2 else 0)


class Tally(NamedTuple):
    votes: int
    fails: int
    oks: int

    @property
    def commit(self) -> bool:
        """The round's decision once closed: every vote that was cast ok or abstained, one ok at least."""
        return self.fails == 0 and self.oks > 0


def tally(total: int) -> Tally:
    """What a round's counter holds."""
    total = int(total)
    fails, rest = divmod(total, FAIL_VOTE)
    abstains, oks = divmod(rest, ABSTAIN_VOTE)
    return Tally(oks + abstains + fails, fails, oks)


def closes(total: int, added: int, size: int) -> bool:
    """Whether the add of `added` that left a counter at `total` took it from below `size` to
    `size` or past it. Exactly one add does. Past: the keeper's vote for a stopped member that
    then voted too, before a node's forward of several votes (== size would never close it)."""
    return tally(int(total) - int(added)).votes < size <= tally(total).votes


# Written into a relayed node's decision key (ftrun.keys.node_decision_key) by the node's ftrun
# after the run's store moved: it ends the wait of members whose forwarder could not reach the old
# store.
NODE_LOST_DECISION = "lost 0"
