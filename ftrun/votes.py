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


class Voting(NamedTuple):
    """How the rounds of replicas of `k` workers are voted: the one place where whole replicas (one
    worker each) and sharded ones (K workers, FSDP2 over ft.device_mesh()) differ in the protocol.
    The members, the keeper and the simulator read these, never `k == 1` for a rule of the vote."""

    k: int

    @property
    def steps_first(self) -> bool:
        """A member whose collectives went through steps at once and reads the round's decision
        during the next round (whole replicas). A sharded replica's workers wait for the decision
        and step on it (member/core.py TakeStep): its shards may disagree, and the replica holds
        the state only if every shard does."""
        return self.k == 1

    @property
    def one_step_rounds(self) -> bool:
        """Every step is a round of its own, whatever pace the keeper sets (sharded replicas, which
        wait for each decision: a longer round would only rebuild their groups)."""
        return self.k > 1

    @property
    def dead_vote(self) -> int:
        """The keeper's vote for a member it saw die: an abstention where the live members stepped
        first (had the dead one sent its part, their collectives went through, and their votes say
        so), a failed vote where they wait for the decision (an abstention could commit a round
        whose other shard failed, and that shard's replica would restart whole)."""
        return ABSTAIN_VOTE if self.steps_first else FAIL_VOTE

    @property
    def sub_steps(self) -> bool:
        """Whether a loop step may be voted as several sub-steps (several ft.Optimizers): whole
        replicas only, so far."""
        return self.k == 1

    @property
    def gives_up_lost_rounds(self) -> bool:
        """Whether a member votes a round down at its top (or stops its backward) once its quorum
        lost a member and a newer one is out, instead of computing a step that cannot commit
        (whole replicas: a sharded replica's were not measured)."""
        return self.k == 1


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
