"""The --ft simulator (scripts/simulate.py): the real keeper, vote and membership code run under
seeded fault schedules. The CI budget of schedules passes with no violation; each historic bug,
put back (ftrun/sim/bugs.py), fails a schedule the product's own code passes, and a search from
a seed finds it. The simulator never imports torch, so each run starts in a fraction of a second.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

ROOT = Path(__file__).resolve().parents[1]
SIMULATE = ROOT / "scripts" / "simulate.py"
CI_SCHEDULES = 2000  # scripts/simulate.py's default: about 30 s

# Shrunk schedules printed by `simulate.py --bug NAME --only-bug --seed 1 --stop-at-first`.
START_ROUND = {"seed": 100186, "replicas": 5, "total": 2, "faults": [
    {"at": 1.227, "kind": "kill-call", "rank": 0, "dur": 0.0, "x": 0.0},
    {"at": 0.365, "kind": "kill", "rank": 1, "dur": 0.0, "x": 0.0},
    {"at": 0.128, "kind": "store-down", "rank": -1, "dur": 0.993, "x": 0.0},
    {"at": 0.072, "kind": "pause", "rank": 1, "dur": 1.254, "x": 0.0}]}

COLLECT_JOINER = {"seed": 100952, "replicas": 3, "total": 11, "faults": [
    {"at": 0.782, "kind": "kill-call", "rank": 1, "dur": 0.0, "x": 10.0},
    {"at": 0.0, "kind": "late", "rank": 2, "dur": 0.617, "x": 0.0},
    {"at": 0.097, "kind": "kill-call", "rank": 0, "dur": 0.0, "x": 8.0},
    {"at": 0.869, "kind": "pause", "rank": 2, "dur": 0.926, "x": 0.0},
    {"at": 1.325, "kind": "kill-call", "rank": 0, "dur": 0.0, "x": 7.0},
    {"at": 1.135, "kind": "slow", "rank": 2, "dur": 1.808, "x": 5.0}]}

DELETED_EPOCH = {"seed": 100093, "replicas": 3, "total": 8, "faults": [
    {"at": 0.374, "kind": "kill-call", "rank": 1, "dur": 0.0, "x": 11.0},
    {"at": 0.747, "kind": "kill", "rank": 0, "dur": 0.0, "x": 0.0},
    {"at": 0.335, "kind": "kill", "rank": 2, "dur": 0.0, "x": 0.0},
    {"at": 0.489, "kind": "pause-call", "rank": 2, "dur": 1.152, "x": 11.0}]}

REVOTE = {"seed": 100131, "replicas": 2, "total": 9, "faults": [
    {"at": 0.148, "kind": "kill-call", "rank": 0, "dur": 0.0, "x": 1.0},
    {"at": 0.107, "kind": "kill-call", "rank": 1, "dur": 0.0, "x": 6.0},
    {"at": 1.05, "kind": "kill-call", "rank": 0, "dur": 0.0, "x": 4.0}]}

FINISHED_VOTER = {"seed": 400061, "replicas": 3, "total": 9, "faults": [
    {"at": 0.391, "kind": "kill", "rank": 1, "dur": 0.0, "x": 0.0},
    {"at": 0.721, "kind": "pause", "rank": 1, "dur": 0.852, "x": 0.0},
    {"at": 0.614, "kind": "heal-kill", "rank": 0, "dur": 0.0, "x": 0.0}]}

# Found by the first search of sharded replicas (--replica-size 2, seed 1, schedule 1713).
MIXED_SHARDS = {"seed": 101713, "replicas": 2, "k": 2, "total": 13, "faults": [
    {"at": 0.291, "kind": "pause-call", "rank": 0, "dur": 1.231, "x": 13.0},
    {"at": 0.479, "kind": "heal-kill", "rank": 2, "dur": 0.0, "x": 0.0},
    {"at": 0.083, "kind": "kill", "rank": 0, "dur": 0.0, "x": 0.0}]}

# Found by the first search over two nodes (--nodes 2, seed 1, schedule 71), shrunk from 9 faults.
LOST_FORWARD = {"seed": 100071, "replicas": 4, "nodes": 2, "total": 9, "faults": [
    {"at": 0.716, "kind": "kill-call", "rank": 3, "dur": 0.0, "x": 0.0},
    {"at": 1.097, "kind": "node-lost", "rank": 1, "dur": 0.0, "x": 0.0}]}

# Found by a search of replicas of 2 workers from seed 2 (schedule 1852), shrunk from 6 faults.
EPOCH_REVOTE = {"seed": 201852, "replicas": 3, "k": 2, "total": 2, "faults": [
    {"at": 0.171, "kind": "kill-call", "rank": 5, "dur": 0.0, "x": 11.0},
    {"at": 0.976, "kind": "heal-kill", "rank": 1, "dur": 0.0, "x": 0.0},
    {"at": 1.477, "kind": "kill-call", "rank": 0, "dur": 0.0, "x": 8.0},
    {"at": 0.188, "kind": "pause-call", "rank": 3, "dur": 2.518, "x": 4.0},
    {"at": 0.108, "kind": "kill-call", "rank": 3, "dur": 0.0, "x": 2.0}]}

# Found by a search of three nodes (seed 3, schedule 142), shrunk to 3 faults.
UNSTICK_OVERCOUNT = {"seed": 300142, "replicas": 6, "nodes": 3, "total": 4, "faults": [
    {"at": 1.042, "kind": "pause", "rank": 1, "dur": 2.701, "x": 0.0},
    {"at": 0.784, "kind": "store-down", "rank": -1, "dur": 0.221, "x": 0.0},
    {"at": 0.414, "kind": "kill", "rank": 4, "dur": 0.0, "x": 0.0}]}

# Found by the soak (seed 7, --soak), shrunk from 6 faults.
STORE_GROWTH = {"seed": 700046, "replicas": 4, "total": 10, "faults": [
    {"at": 0.297, "kind": "kill", "rank": 3, "dur": 0.0, "x": 0.0},
    {"at": 1.044, "kind": "kill", "rank": 0, "dur": 0.0, "x": 0.0},
    {"at": 1.051, "kind": "pause-call", "rank": 2, "dur": 2.631, "x": 3.0}]}


def _simulate(*args: str, timeout: float = 300) -> List[str]:
    p = subprocess.run([sys.executable, str(SIMULATE), *args], capture_output=True, text=True, timeout=timeout,
                       cwd=ROOT)
    lines = p.stdout.strip().splitlines()
    assert lines, p.stderr
    assert p.returncode == (0 if lines[-1].endswith(" 0 violations") else 1), p.stdout + p.stderr
    return lines


def _replay(schedule: dict, bug: str = "none") -> List[str]:
    return _simulate("--replay", json.dumps(schedule), "--bug", bug, "--no-shrink")


def test_ci_budget_of_schedules_finds_no_violation():
    lines = _simulate("--seed", "1", timeout=600)
    assert lines[-1] == f"{CI_SCHEDULES} schedules, 0 violations", "\n".join(lines[-20:])


@pytest.mark.quick
def test_start_round_bug_fails_a_schedule_the_product_passes():
    """(a) 0a17702: members entering an epoch each at its own round vote where the others never
    come; the run stops making progress."""
    assert _replay(START_ROUND)[-1] == "1 schedules, 0 violations"
    bad = _replay(START_ROUND, "start-round")
    assert bad[-1] == "1 schedules, 1 violations"
    assert "no progress" in bad[0], bad


def test_collect_joiner_bug_fails_a_schedule_the_product_passes():
    """(c) 3b9d79e: the keeper deleted the epochs older than every reported epoch while a
    replica that had not reported one yet was entering such an epoch: it waits for ever."""
    assert _replay(COLLECT_JOINER)[-1] == "1 schedules, 0 violations"
    bad = _replay(COLLECT_JOINER, "collect-joiner")
    assert bad[-1] == "1 schedules, 1 violations"
    assert "no progress" in bad[0], bad


def test_deleted_epoch_bug_fails_a_schedule_the_keeper_of_its_time_passes():
    """(b) b1dd880: a joiner stopped in the middle of its scan of the epochs (rank 2, SIGSTOPped
    at a store call for 1.2 s) while two kills moved the others three epochs on, so the keeper of
    that time (before 3b9d79e) deleted the epoch it was about to read: its blocking get waited
    for the store's whole timeout, deaf to the epoch the others then waited in for it."""
    assert _replay(DELETED_EPOCH)[-1] == "1 schedules, 0 violations"
    assert _replay(DELETED_EPOCH, "collect-joiner")[-1] == "1 schedules, 0 violations"
    bad = _replay(DELETED_EPOCH, "deleted-epoch")
    assert bad[-1] == "1 schedules, 1 violations"
    assert "no progress" in bad[0] and "rank 2: {'inc': 1, 'epoch': None" in bad[0] and "'phase': 'join'" in bad[0], bad


@pytest.mark.quick
def test_revote_bug_fails_a_schedule_the_product_passes():
    """(e) d5bb6bf, found by this simulator: the keeper abstained for a dead member in a round
    whose keys it had already collected; the vote began a fresh count and the round was decided
    a second time, the other way."""
    assert _replay(REVOTE)[-1] == "1 schedules, 0 violations"
    bad = _replay(REVOTE, "revote")
    assert bad[-1] == "1 schedules, 1 violations"
    assert "decided twice: 'commit" in bad[0], bad


def test_finished_voter_bug_fails_a_schedule_the_product_passes():
    """(f) 9b10420, found by this simulator: a restarted replica whose heal failed at the last
    round boundary voted in a round the others, who had left the loop, never vote in; nobody
    voted in their place and it waited for the vote's whole timeout."""
    assert _replay(FINISHED_VOTER)[-1] == "1 schedules, 0 violations"
    bad = _replay(FINISHED_VOTER, "finished-voter")
    assert bad[-1] == "1 schedules, 1 violations"
    assert "no progress" in bad[0] and "'phase': 'vote'" in bad[0], bad


def test_store_growth_bug_fails_a_schedule_the_product_passes():
    """(g) found by the soak: the keeper abstained for the dead in the newest rounds of every
    epoch that lists them, also old epochs nobody is in while a restarted replica starts; those
    rounds never close, and a store of 4 replicas grew past 250 keys (the bound is 260)."""
    assert _replay(STORE_GROWTH)[-1] == "1 schedules, 0 violations"
    bad = _replay(STORE_GROWTH, "store-growth")
    assert bad[-1] == "1 schedules, 1 violations"
    assert "the store grew to" in bad[0], bad


def test_sharded_replicas_budget_finds_no_violation():
    """Replicas of 2 workers (--replica-size 2): a worker's death restarts its replica whole,
    every worker votes and waits for the decision, each shard heals from its own source."""
    lines = _simulate("--replica-size", "2", "--schedules", "800", "--seed", "1", timeout=600)
    assert lines[-1] == "800 schedules, 0 violations", "\n".join(lines[-20:])


def test_mixed_shards_bug_fails_a_schedule_the_product_passes():
    """(h) found by the simulator on sharded replicas: replica 0 restarts; its worker 1 heals
    its shard while worker 0 is stopped mid-join, and the source replica dies in the transfer.
    The next epoch is fresh (no replica holds the whole state), and replica 0's workers each sent
    what they held: shard 1 of step 6 beside shard 0 of step 0. Now the worker holding trained
    state restarts with its replica, and both begin again from the first step."""
    assert _replay(MIXED_SHARDS)[-1] == "1 schedules, 0 violations"
    bad = _replay(MIXED_SHARDS, "mixed-shards")
    assert bad[-1] == "1 schedules, 1 violations"
    assert "committed with two states" in bad[0], bad


def test_two_nodes_budget_finds_no_violation():
    """Two machines: node 1's workers vote and report through its own store, kept by the real
    node relay and a follower keeper; a quarter of the schedules lose node 1 for good."""
    lines = _simulate("--nodes", "2", "--schedules", "800", "--seed", "1", timeout=600)
    assert lines[-1] == "800 schedules, 0 violations", "\n".join(lines[-20:])


def test_lost_forward_bug_fails_a_schedule_the_product_passes():
    """(i) found by the simulator on two nodes: rank 3, node 1's last voter of a round, died
    before forwarding the node's count; then node 1 was lost, its store with it. The keeper
    took the votes it had cast there for rank 3 as counted, and the round waited for ever. Now
    a lost node's votes are cast again in the run's store."""
    assert _replay(LOST_FORWARD)[-1] == "1 schedules, 0 violations"
    bad = _replay(LOST_FORWARD, "lost-forward")
    assert bad[-1] == "1 schedules, 1 violations"
    assert "no progress" in bad[0], bad


def test_epoch_revote_bug_fails_a_schedule_the_product_passes():
    """(j) found by the simulator on sharded replicas: the keeper deleted every key of an epoch
    nobody was in any more, kept no horizon for it, and later voted for a member of it that
    had died (an epoch's start round is always filled): a fresh count, and a decided round
    decided a second time."""
    assert _replay(EPOCH_REVOTE)[-1] == "1 schedules, 0 violations"
    bad = _replay(EPOCH_REVOTE, "epoch-revote")
    assert bad[-1] == "1 schedules, 1 violations"
    assert "decided twice" in bad[0], bad


def test_unstick_overcount_bug_fails_a_schedule_the_product_passes():
    """(k) found by the simulator on three nodes: the keeper voted fail for rank 1, stopped and
    in no epoch, and rank 1 resumed and voted too; a node's forward took the round's count from
    below its size to past it, and a count that closed only at exactly its size was never
    closed. Now the add that takes a count to its size or past it closes it."""
    assert _replay(UNSTICK_OVERCOUNT)[-1] == "1 schedules, 0 violations"
    bad = _replay(UNSTICK_OVERCOUNT, "unstick-overcount")
    assert bad[-1] == "1 schedules, 1 violations"
    assert "no progress" in bad[0], bad


def test_search_over_two_nodes_finds_the_lost_forward_bug():
    lines = _simulate("--bug", "lost-forward", "--only-bug", "--seed", "1", "--nodes", "2", "--schedules", "200",
                      "--stop-at-first", "--no-shrink")
    assert lines[-1].endswith(" schedules, 1 violations"), "\n".join(lines)


@pytest.mark.quick
def test_a_failing_schedule_replays_exactly():
    def found(lines: List[str]) -> str:  # the violation, without the wall-clock figures
        return lines[0].split("): ", 1)[1]

    assert found(_replay(START_ROUND, "start-round")) == found(_replay(START_ROUND, "start-round"))


@pytest.mark.parametrize("bug,schedules", [("start-round", 200), ("deleted-epoch", 200)])
def test_search_from_a_seed_finds_the_bug(bug, schedules):
    lines = _simulate("--bug", bug, "--only-bug", "--seed", "1", "--schedules", str(schedules),
                      "--stop-at-first", "--no-shrink")
    assert lines[-1].endswith(" schedules, 1 violations"), "\n".join(lines)
