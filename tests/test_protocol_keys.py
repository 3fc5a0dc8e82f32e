"""The protocol's numbered keys parse back to what built them (ftrun.keys.parse_key): the
keeper's collection and the node relays find their keys by this one parser."""

from __future__ import annotations

import pytest

from ftrun import keys, votes


@pytest.mark.quick
def test_every_numbered_key_parses_back_to_its_numbers():
    built = {
        keys.count_key(3, 17): ("n", (3, 17)),
        keys.decision_key(3, 17): ("d", (3, 17)),
        keys.kept_key(3, 17): ("p", (3, 17)),
        keys.heal_key(4, 2): ("heal", (4, 2)),
        keys.heal_key(4, 2, 1): ("heal", (4, 2, 1)),
        keys.pg_prefix(5, 9) + "0": ("pg", (5, 9, 0)),
        keys.pg_prefix(5, 9, 1) + "rank_0": ("pg", (5, 9, 1)),
        keys.quorum_key(12): ("quorum", (12,)),
        keys.start_key(12): ("start", (12,)),
        keys.node_count_key(2, 7, 30): ("ln", (2, 7, 30)),
        keys.node_decision_key(2, 7, 30): ("ld", (2, 7, 30)),
        keys.node_forwarded_key(2, 7, 30): ("lf", (2, 7, 30)),
        keys.replica_prefix(1, 4) + "x": ("replica", (1, 4)),
        keys.LATEST: ("latest", ()),
    }
    for key, want in built.items():
        assert keys.parse_key(key) == want, key
    assert keys.parse_key("torch.distributed/whatever/1/2") is None


@pytest.mark.quick
def test_exactly_one_add_closes_a_count_even_one_that_goes_past_its_size():
    """A count of 4 votes gets the keeper's fail vote for a stopped member, then a node's forward
    of 2, then that member's own vote forwarded with another's: it goes 1, 3, 5 and never sits
    at 4. The add that crossed 4 closes it; no other add does."""
    adds = [votes.FAIL_VOTE, 2 * votes.OK_VOTE, votes.OK_VOTE + votes.FAIL_VOTE, votes.OK_VOTE]
    total, closers = 0, []
    for added in adds:
        total += added
        closers.append(votes.closes(total, added, 4))
    assert closers == [False, False, True, False]
    assert votes.tally(total).votes == 6 and not votes.tally(total).commit
    # A count that lands on its size closes there, as before.
    assert votes.closes(4 * votes.OK_VOTE, votes.OK_VOTE, 4) and not votes.closes(3 * votes.OK_VOTE, votes.OK_VOTE, 4)
