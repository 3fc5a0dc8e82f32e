"""The protocol's numbered keys parse back to what built them (ftrun.protocol.parse_key): the
keeper's collection and the node relays find their keys by this one parser."""

from __future__ import annotations

import pytest

from ftrun import protocol as keys


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
        keys.epoch_key(12): ("epoch", (12,)),
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
