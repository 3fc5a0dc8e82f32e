"""The --ft simulator (scripts/simulate.py): the real keeper, vote and membership code run under
seeded fault schedules. The CI budget of schedules passes with no violation; each historic bug,
put back (ftrun/sim/bugs.py), fails a schedule the product's own code passes, and a search from
a seed finds it. The simulator never imports torch, so each run starts in a fraction of a second.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

ROOT = Path(__file__).resolve().parents[1]
SIMULATE = ROOT / "scripts" / "simulate.py"
CI_SCHEDULES = 800  # scripts/simulate.py's default: about 8 s

# Shrunk schedules printed by `simulate.py --bug NAME --only-bug --seed 1 --stop-at-first` (the shape
# and seed in each comment). They are exact interleavings of the member driver and the keeper: a
# change to the order of either's store calls moves them, and they are found again so. When the
# member's round top changed (a member out of sync sits the round out; ft.redo() reads the pending
# decision), eight of them were found again with the same faults and another scheduler seed
# (DELETED_QUORUM, FINISHED_VOTER, QUORUM_REVOTE, UNSTICK_OVERCOUNT, STORE_GROWTH,
# STOP_WRITER_FINISHED, MOVED_SOURCE_DIED, MOVED_FOLLOWER_STALL).
START_ROUND = {"seed": 100196, "replicas": 4, "total": 2, "faults": [
    {"at": 0.451, "kind": "pause-call", "rank": 1, "dur": 1.054, "x": 15.0},
    {"at": 0.542, "kind": "kill-call", "rank": 2, "dur": 0.0, "x": 4.0},
    {"at": 0.874, "kind": "kill-call", "rank": 0, "dur": 0.0, "x": 9.0},
    {"at": 0.476, "kind": "kill-call", "rank": 3, "dur": 0.0, "x": 0.0},
    {"at": 0.0, "kind": "late", "rank": 3, "dur": 1.302, "x": 0.0},
    {"at": 0.711, "kind": "kill-call", "rank": 1, "dur": 0.0, "x": 6.0}]}

COLLECT_JOINER = {"seed": 100455, "replicas": 3, "total": 11, "faults": [
    {"at": 0.839, "kind": "pause", "rank": 1, "dur": 0.108, "x": 0.0},
    {"at": 0.717, "kind": "kill-call", "rank": 1, "dur": 0.0, "x": 8.0},
    {"at": 0.788, "kind": "pause-call", "rank": 0, "dur": 1.239, "x": 14.0},
    {"at": 0.757, "kind": "pause", "rank": 1, "dur": 2.365, "x": 0.0},
    {"at": 1.152, "kind": "kill-call", "rank": 2, "dur": 0.0, "x": 0.0},
    {"at": 0.782, "kind": "pause-call", "rank": 1, "dur": 0.75, "x": 4.0},
    {"at": 0.739, "kind": "kill", "rank": 0, "dur": 0.0, "x": 0.0}]}

DELETED_QUORUM = {"seed": 300440, "replicas": 5, "total": 13, "faults": [
    {"at": 0.811, "kind": "heal-kill", "rank": 1, "dur": 0.0, "x": 0.0},
    {"at": 0.944, "kind": "kill", "rank": 1, "dur": 0.0, "x": 0.0},
    {"at": 0.795, "kind": "heal-kill", "rank": 1, "dur": 0.0, "x": 0.0},
    {"at": 1.022, "kind": "pause-call", "rank": 0, "dur": 2.74, "x": 5.0},
    {"at": 1.108, "kind": "kill", "rank": 3, "dur": 0.0, "x": 0.0},
    {"at": 1.353, "kind": "kill", "rank": 2, "dur": 0.0, "x": 0.0}]}

REVOTE = {"seed": 100179, "replicas": 2, "total": 12, "faults": [
    {"at": 0.774, "kind": "pause", "rank": 1, "dur": 2.208, "x": 0.0},
    {"at": 0.884, "kind": "kill", "rank": 0, "dur": 0.0, "x": 0.0},
    {"at": 1.426, "kind": "kill", "rank": 1, "dur": 0.0, "x": 0.0}]}

# Found again from seed 1 (--bug finished-voter --only-bug) once a member voted down at its top a
# quorum whose group it gave up for a newer one.
FINISHED_VOTER = {"seed": 100657, "replicas": 4, "total": 19, "faults": [
    {"at": 0.907, "kind": "kill-call", "rank": 3, "dur": 0.0, "x": 0.0},
    {"at": 1.342, "kind": "slow", "rank": 1, "dur": 1.509, "x": 20.0},
    {"at": 0.778, "kind": "kill-call", "rank": 0, "dur": 0.0, "x": 0.0}]}

# Found by a search of sharded replicas (--replica-size 2, seed 1).
MIXED_SHARDS = {"seed": 100066, "replicas": 2, "k": 2, "total": 3, "faults": [
    {"at": 0.378, "kind": "heal-kill", "rank": 0, "dur": 0.0, "x": 0.0},
    {"at": 1.386, "kind": "pause", "rank": 0, "dur": 1.153, "x": 0.0},
    {"at": 0.109, "kind": "pause-call", "rank": 0, "dur": 1.783, "x": 12.0},
    {"at": 0.229, "kind": "kill-call", "rank": 2, "dur": 0.0, "x": 1.0}]}

# Found by a search over two nodes (--nodes 2, seed 1).
LOST_FORWARD = {"seed": 100195, "replicas": 2, "nodes": 2, "total": 7, "faults": [
    {"at": 0.0, "kind": "late", "rank": 0, "dur": 0.419, "x": 0.0},
    {"at": 0.31, "kind": "kill-call", "rank": 1, "dur": 0.0, "x": 11.0},
    {"at": 0.0, "kind": "late", "rank": 0, "dur": 0.088, "x": 0.0},
    {"at": 1.413, "kind": "node-lost", "rank": 1, "dur": 0.0, "x": 0.0}]}

# Found by a search of replicas of 2 workers (--replica-size 2, seed 10) over the product's member driver.
QUORUM_REVOTE = {"seed": 998467, "replicas": 2, "k": 2, "total": 11, "faults": [
    {"at": 0.09, "kind": "kill", "rank": 3, "dur": 0.0, "x": 0.0},
    {"at": 0.994, "kind": "slow", "rank": 2, "dur": 1.54, "x": 20.0},
    {"at": 0.886, "kind": "heal-kill", "rank": 0, "dur": 0.0, "x": 0.0},
    {"at": 0.03, "kind": "heal-kill", "rank": 3, "dur": 0.0, "x": 0.0},
    {"at": 0.701, "kind": "slow", "rank": 3, "dur": 0.303, "x": 100.0}]}

# Found by a search of three nodes (--nodes 3, seed 4) over the product's member driver.
UNSTICK_OVERCOUNT = {"seed": 401710, "replicas": 6, "nodes": 3, "total": 7, "faults": [
    {"at": 0.653, "kind": "kill-call", "rank": 0, "dur": 0.0, "x": 8.0},
    {"at": 0.399, "kind": "kill", "rank": 0, "dur": 0.0, "x": 0.0},
    {"at": 0.53, "kind": "kill-call", "rank": 5, "dur": 0.0, "x": 1.0},
    {"at": 0.567, "kind": "pause-call", "rank": 1, "dur": 2.761, "x": 10.0}]}

# Found by a search from seed 7 (the soak's).
STORE_GROWTH = {"seed": 700468, "replicas": 2, "total": 6, "faults": [
    {"at": 1.243, "kind": "pause", "rank": 1, "dur": 2.853, "x": 0.0},
    {"at": 0.244, "kind": "kill-call", "rank": 1, "dur": 0.0, "x": 5.0},
    {"at": 1.132, "kind": "kill", "rank": 0, "dur": 0.0, "x": 0.0},
    {"at": 0.444, "kind": "kill", "rank": 0, "dur": 0.0, "x": 0.0}]}


# Planted in the supervisor's own failure policy (supervisor/policy/failure_policy.py), found by a
# search of restart budgets (--max-restarts 1, seed 1).
BUDGET_OVERRUN = {"seed": 100001, "replicas": 4, "max_restarts": 1, "min_replicas": 3, "total": 8, "faults": [
    {"at": 0.694, "kind": "pause", "rank": 2, "dur": 1.967, "x": 0.0},
    {"at": 0.578, "kind": "kill", "rank": 0, "dur": 0.0, "x": 0.0},
    {"at": 1.776, "kind": "kill", "rank": 0, "dur": 0.0, "x": 0.0}]}

DROP_BELOW_MIN = {"seed": 100012, "replicas": 2, "max_restarts": 1, "min_replicas": 2, "total": 2, "faults": [
    {"at": 0.106, "kind": "kill-call", "rank": 0, "dur": 0.0, "x": 7.0},
    {"at": 0.068, "kind": "pause", "rank": 1, "dur": 2.553, "x": 0.0},
    {"at": 1.241, "kind": "kill", "rank": 0, "dur": 0.0, "x": 0.0}]}

# Planted in the keeper's add_ranks, found by a search of late joiners (--joiners, seed 1).
KEYLESS_ADD = {"seed": 100002, "replicas": 5, "joiners": 1, "join_at": 0.158, "total": 12, "faults": [
    {"at": 0.977, "kind": "kill", "rank": 5, "dur": 0.0, "x": 0.0}]}

# Planted in the keeper's stop, found by a search of stop signals (--stops, seed 1).
FORGETFUL_STOP = {"seed": 100001, "replicas": 4, "stop_at": 0.786, "total": 10, "faults": [
    {"at": 0.694, "kind": "pause", "rank": 2, "dur": 1.967, "x": 0.0},
    {"at": 0.915, "kind": "kill", "rank": 0, "dur": 0.0, "x": 0.0}]}

# Found by the soak from seed 7 (seed 708652, shrunk): rank 0 is killed mid-round, rank 1 had
# stepped past the round voted down and rejoins in place; while its join waited, the keeper
# published quorum 5 (rank 0 back), which rank 1's quorum watcher saw, and the join's own older
# read of the newest quorum (4) then overwrote it: rank 1 wrote every later decision naming quorum
# 4 and the run stalled (ranks 2-4 knew 5 was out and gave up each group of 4 at once).
REJOIN_STALE_LATEST = {"seed": 708652, "replicas": 5, "total": 4, "faults": [
    {"at": 0.306, "kind": "slow", "rank": 4, "dur": 1.569, "x": 100.0},
    {"at": 0.342, "kind": "kill", "rank": 0, "dur": 0.0, "x": 0.0}]}


# Found by a search of stops with checkpoints (--checkpoints --stops, seed 3, shrunk; found again
# from seed 1 once survivors voted a round down at its top when a peer was known gone, which moved
# the interleavings): a stop quorum names as its writer a replica that had just left the loop (its
# exit 0 not yet seen). Before the fix its finish published nothing: no writer was left to say how a
# save went, and the replicas parked at the stop waited with the supervisor for the grace period.
STOP_WRITER_FINISHED = {"seed": 100014, "replicas": 3, "stop_at": 2.476, "checkpoint_every": 5, "total": 19,
                        "faults": [{"at": 1.425, "kind": "kill", "rank": 2, "dur": 0.0, "x": 0.0},
                                   {"at": 1.134, "kind": "kill-call", "rank": 1, "dur": 0.0, "x": 6.0},
                                   {"at": 1.353, "kind": "pause-call", "rank": 0, "dur": 1.464, "x": 4.0},
                                   {"at": 2.62, "kind": "kill", "rank": 0, "dur": 0.0, "x": 0.0}]}


# The store's moves (--moves: three nodes, the node hosting the run's store lost), found by the
# first searches of that mode (seed 1, and seed 2 for the undecided step; the source's death found
# again from seed 1 once survivors voted a round down at its top when a peer was known gone).
# The first quorum on the moved store heals from the survivor holding step 2; its source dies in the
# transfer. Before the fix the next quorum was fresh, and its lowest replica (restarted since the
# move) sent its initial state over the step two live members held.
MOVED_SOURCE_DIED = {"seed": 100035, "replicas": 6, "nodes": 3, "total": 2, "faults": [
    {"at": 0.313, "kind": "kill", "rank": 2, "dur": 0.0, "x": 0.0},
    {"at": 0.517, "kind": "store-down", "rank": -1, "dur": 0.444, "x": 0.0},
    {"at": 0.394, "kind": "kill", "rank": 1, "dur": 0.0, "x": 0.0},
    {"at": 0.249, "kind": "heal-kill", "rank": 2, "dur": 0.0, "x": 0.0},
    {"at": 0.135, "kind": "kill", "rank": 4, "dur": 0.0, "x": 0.0},
    {"at": 1.185, "kind": "host-lost", "rank": -1, "dur": 0.0, "x": 0.0},
    {"at": 2.147, "kind": "heal-kill", "rank": 3, "dur": 0.0, "x": 0.0}]}

# Node 2's keeper on the moved store counted below the new leader's LATEST, which names no quorum
# yet: before the fix its blocking read of that quorum stopped node 2's supervision, its relay
# with it, and rank 5, waiting on node 2's store for a decision the lost store held, waited for ever.
MOVED_FOLLOWER_STALL = {"seed": 99806, "replicas": 6, "nodes": 3, "total": 5, "faults": [
    {"at": 0.561, "kind": "kill", "rank": 4, "dur": 0.0, "x": 0.0},
    {"at": 0.423, "kind": "pause", "rank": 0, "dur": 1.947, "x": 0.0},
    {"at": 0.281, "kind": "slow", "rank": 5, "dur": 1.421, "x": 20.0},
    {"at": 1.306, "kind": "host-lost", "rank": -1, "dur": 0.0, "x": 0.0}]}

# Rank 5 dies in round 12 after its part of rank 4's allreduce: rank 4 steps, the others' collectives
# fail and the lost store decides the round down, which rank 4 (on node 2) never reads. Before the
# fix rank 4 said it held the newest whole step (12) and healed the others with a step voted down.
MOVED_UNDECIDED_STEP = {"seed": 200944, "replicas": 6, "nodes": 3, "total": 13, "faults": [
    {"at": 0.241, "kind": "heal-kill", "rank": 2, "dur": 0.0, "x": 0.0},
    {"at": 0.0, "kind": "late", "rank": 1, "dur": 0.153, "x": 0.0},
    {"at": 0.0, "kind": "late", "rank": 5, "dur": 0.085, "x": 0.0},
    {"at": 1.536, "kind": "host-lost", "rank": -1, "dur": 0.0, "x": 0.0},
    {"at": 1.237, "kind": "kill", "rank": 5, "dur": 0.0, "x": 0.0}]}

# The store's host is lost while round 14 of quorum 4 is decided: rank 2 had stepped to 14 (the
# decision went with the store), ranks 3 and 4 were at 13. The moved store's quorum heals from
# rank 3, and rank 5, a healer, dies in the transfer. Before the fix rank 2, in sync by its own
# books, was handed step 14 on its undecided state and evaluated it; the next quorum healed it
# to 13 (found by a search with --moves from seed 4, schedule 174).
MOVED_FAILED_HEALER = {"seed": 400174, "replicas": 6, "nodes": 3, "total": 15, "faults": [
    {"at": 0.776, "kind": "kill-call", "rank": 5, "dur": 0.0, "x": 10.0},
    {"at": 0.072, "kind": "kill-call", "rank": 3, "dur": 0.0, "x": 8.0},
    {"at": 1.795, "kind": "host-lost", "rank": -1, "dur": 0.0, "x": 0.0},
    {"at": 2.848, "kind": "heal-kill", "rank": 5, "dur": 0.0, "x": 0.0}]}

# Node 1's keeper had last read quorum 2 of the lost store, which published quorums 3 and 4 just
# before it went; ranks of nodes 1 and 2 had seen quorum 4. Before the fix the moved store's keeper
# counted from its own read and published another quorum 4 (found by a search from seed 3).
MOVED_QUORUM_SEEN = {"seed": 300363, "replicas": 6, "nodes": 3, "total": 8, "faults": [
    {"at": 0.997, "kind": "kill", "rank": 1, "dur": 0.0, "x": 0.0},
    {"at": 0.899, "kind": "store-down", "rank": -1, "dur": 0.459, "x": 0.0},
    {"at": 0.717, "kind": "kill", "rank": 4, "dur": 0.0, "x": 0.0},
    {"at": 0.573, "kind": "slow", "rank": 5, "dur": 0.155, "x": 100.0},
    {"at": 1.954, "kind": "host-lost", "rank": -1, "dur": 0.0, "x": 0.0}]}

# Planted in the moved store's keeper (--moves, seed 1, its first schedule) and in the save's wait
# (--checkpoints, seed 1, schedule 80).
MOVE_RECOUNT = {"seed": 100000, "replicas": 6, "nodes": 3, "total": 19, "faults": [
    {"at": 1.496, "kind": "host-lost", "rank": -1, "dur": 0.0, "x": 0.0}]}

EARLY_SAVE = {"seed": 100080, "replicas": 3, "checkpoint_every": 1, "total": 8, "faults": [
    {"at": 0.057, "kind": "store-down", "rank": -1, "dur": 0.439, "x": 0.0},
    {"at": 0.95, "kind": "store-down", "rank": -1, "dur": 0.896, "x": 0.0},
    {"at": 1.404, "kind": "kill-all", "rank": -1, "dur": 0.0, "x": 0.0}]}

# Found by the simulator (issue 41's flaky nanoGPT port; the old code from seed 1, schedule 66; found
# again from seed 3 once survivors voted a round down at its top when a peer was known gone, and from
# seed 1 once a member voted down at its top a quorum whose group it gave up for a newer one). A
# restarted replica's heal does not land: before the fix it was handed a step while out of sync and
# its script ran on a state that is not the committed one.
UNSYNCED_STEP = {"seed": 100010, "replicas": 5, "total": 7, "faults": [
    {"at": 1.707, "kind": "heal-kill", "rank": 1, "dur": 0.0, "x": 0.0},
    {"at": 1.689, "kind": "kill-call", "rank": 2, "dur": 0.0, "x": 9.0},
    {"at": 1.715, "kind": "pause-call", "rank": 0, "dur": 1.593, "x": 7.0},
    {"at": 0.0, "kind": "late", "rank": 3, "dur": 1.342, "x": 0.0},
    {"at": 1.337, "kind": "kill-call", "rank": 1, "dur": 0.0, "x": 6.0}]}

# Rank 1 dies after its part of round 5's allreduce: rank 0 steps and is handed step 6 (an
# evaluation step) before round 5's decision, which votes it down. Before the fix ft.redo() was
# False there: rank 0 evaluated a state the run discarded, healed, and evaluated step 6 again.
UNDECIDED_REDO = {"seed": 100062, "replicas": 3, "total": 7, "faults": [
    {"at": 0.489, "kind": "kill", "rank": 1, "dur": 0.0, "x": 0.0}]}

# Planted in the keeper's view of --spares (--spares, seed 1, its first schedule): one replica too
# many trains, with no fault at all.
SPARE_SHORT = {"seed": 100000, "replicas": 2, "spares": 1, "total": 2, "faults": []}
LONE_CHECK = {"seed": 100000, "replicas": 2, "check_every": 2, "total": 2, "faults": []}
# Found from seed 1 with --spares --bug kept-unlike (schedule 32), shrunk: a training replica dies and
# the spare whose feed wrote a state unlike its feeder's takes its place.
KEPT_UNLIKE = {"seed": 100032, "replicas": 3, "spares": 1, "total": 6, "faults": [
    {"at": 0.451, "kind": "kill", "rank": 0, "dur": 0.0, "x": 0.0},
    {"at": 0.0, "kind": "feed-bad", "rank": 2, "dur": 0.0, "x": 0.0}]}


def _simulate(*args: str, timeout: float = 300) -> List[str]:
    p = subprocess.run([sys.executable, str(SIMULATE), *args], capture_output=True, text=True, timeout=timeout,
                       cwd=ROOT)
    lines = p.stdout.strip().splitlines()
    assert lines, p.stderr
    assert p.returncode == (0 if lines[-1].endswith(" 0 violations") else 1), p.stdout + p.stderr
    return lines


def _replay(schedule: dict, bug: str = "none") -> List[str]:
    return _simulate("--replay", json.dumps(schedule), "--bug", bug, "--no-shrink")


def test_a_rejoin_in_place_keeps_the_newest_quorum_its_watcher_saw():
    assert _replay(REJOIN_STALE_LATEST)[-1] == "1 schedules, 0 violations"


def test_ci_budget_of_schedules_finds_no_violation():
    lines = _simulate("--seed", "1", timeout=600)
    assert lines[-1] == f"{CI_SCHEDULES} schedules, 0 violations", "\n".join(lines[-20:])


@pytest.mark.quick
def test_start_round_bug_fails_a_schedule_the_product_passes():
    """(a) 0a17702: members entering a quorum each at its own round vote where the others never
    come; the run stops making progress."""
    assert _replay(START_ROUND)[-1] == "1 schedules, 0 violations"
    bad = _replay(START_ROUND, "start-round")
    assert bad[-1] == "1 schedules, 1 violations"
    assert "no progress" in bad[0], bad


def test_collect_joiner_bug_fails_a_schedule_the_product_passes():
    """(c) 3b9d79e: the keeper deleted the quorums older than every reported quorum while a
    replica that had not reported one yet was entering such a quorum: it waits for ever."""
    assert _replay(COLLECT_JOINER)[-1] == "1 schedules, 0 violations"
    bad = _replay(COLLECT_JOINER, "collect-joiner")
    assert bad[-1] == "1 schedules, 1 violations"
    assert "no progress" in bad[0], bad


def test_deleted_quorum_bug_fails_a_schedule_the_keeper_of_its_time_passes():
    """(b) b1dd880: a joiner stopped in the middle of its scan of the quorums while kills moved the
    others quorums on, so the keeper of that time (before 3b9d79e) deleted the quorum it was about
    to read: its blocking get waited for the store's whole timeout, deaf to the quorum the others
    then waited in for it (it stays in the join)."""
    assert _replay(DELETED_QUORUM)[-1] == "1 schedules, 0 violations"
    assert _replay(DELETED_QUORUM, "collect-joiner")[-1] == "1 schedules, 0 violations"
    bad = _replay(DELETED_QUORUM, "deleted-quorum")
    assert bad[-1] == "1 schedules, 1 violations"
    assert "no progress" in bad[0] and re.search(r"rank \d+: MemberReport\(inc=\d+, quorum_id=None", bad[0]), bad
    assert "phase='join'" in bad[0], bad


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
    assert "no progress" in bad[0] and "phase='vote'" in bad[0], bad


def test_store_growth_bug_fails_a_schedule_the_product_passes():
    """(g) found by the soak: the keeper abstained for the dead in the newest rounds of every
    quorum that lists them, also old quorums nobody is in while a restarted replica starts; those
    rounds never close, and the store grows past its bound (100 keys and 40 a rank)."""
    assert _replay(STORE_GROWTH)[-1] == "1 schedules, 0 violations"
    bad = _replay(STORE_GROWTH, "store-growth")
    assert bad[-1] == "1 schedules, 1 violations"
    assert "the store grew to" in bad[0], bad


def test_sharded_replicas_budget_finds_no_violation():
    """Replicas of 2 workers (--replica-size 2): a worker's death restarts its replica whole,
    every worker votes and waits for the decision, each shard heals from its own source."""
    lines = _simulate("--replica-size", "2", "--schedules", "300", "--seed", "1", timeout=600)
    assert lines[-1] == "300 schedules, 0 violations", "\n".join(lines[-20:])


def test_mixed_shards_bug_fails_a_schedule_the_product_passes():
    """(h) found by the simulator on sharded replicas: replica 0 restarts; its worker 1 heals
    its shard while worker 0 is stopped mid-join, and the source replica dies in the transfer.
    The next quorum is fresh (no replica holds the whole state), and replica 0's workers each sent
    what they held: shard 1 of step 6 beside shard 0 of step 0. Now the worker holding trained
    state restarts with its replica, and both begin again from the first step."""
    assert _replay(MIXED_SHARDS)[-1] == "1 schedules, 0 violations"
    bad = _replay(MIXED_SHARDS, "mixed-shards")
    assert bad[-1] == "1 schedules, 1 violations"
    assert "committed with two states" in bad[0], bad


def test_rounds_of_several_steps_budget_finds_no_violation():
    """Rounds of 4 steps and one vote (FTRUN_FT_ROUND_STEPS=4): a member steps on at once and votes
    after the round's last step; a round voted down keeps the fewest steps any member took, and a
    member that took more takes the committed state again."""
    lines = _simulate("--round-steps", "4", "--schedules", "300", "--seed", "1", timeout=600)
    assert lines[-1] == "300 schedules, 0 violations", "\n".join(lines[-20:])


def test_two_nodes_budget_finds_no_violation():
    """Two machines: node 1's workers vote and report through its own store, kept by the real
    node relay and a follower keeper; a quarter of the schedules lose node 1 for good."""
    lines = _simulate("--nodes", "2", "--schedules", "300", "--seed", "1", timeout=600)
    assert lines[-1] == "300 schedules, 0 violations", "\n".join(lines[-20:])


def test_lost_forward_bug_fails_a_schedule_the_product_passes():
    """(i) found by the simulator on two nodes: rank 3, node 1's last voter of a round, died
    before forwarding the node's count; then node 1 was lost, its store with it. The keeper
    took the votes it had cast there for rank 3 as counted, and the round waited for ever. Now
    a lost node's votes are cast again in the run's store."""
    assert _replay(LOST_FORWARD)[-1] == "1 schedules, 0 violations"
    bad = _replay(LOST_FORWARD, "lost-forward")
    assert bad[-1] == "1 schedules, 1 violations"
    assert "no progress" in bad[0], bad


def test_quorum_revote_bug_fails_a_schedule_the_product_passes():
    """(j) found by the simulator on sharded replicas: the keeper deleted every key of a quorum
    nobody was in any more, kept no horizon for it, and later voted for a member of it that
    had died (a quorum's start round is always filled): a fresh count, and a decided round
    decided a second time."""
    assert _replay(QUORUM_REVOTE)[-1] == "1 schedules, 0 violations"
    bad = _replay(QUORUM_REVOTE, "quorum-revote")
    assert bad[-1] == "1 schedules, 1 violations"
    assert "decided twice" in bad[0], bad


def test_unstick_overcount_bug_fails_a_schedule_the_product_passes():
    """(k) found by the simulator on three nodes: the keeper voted fail for rank 1, stopped and
    in no quorum, and rank 1 resumed and voted too; a node's forward took the round's count from
    below its size to past it, and a count that closed only at exactly its size was never
    closed. Now the add that takes a count to its size or past it closes it."""
    assert _replay(UNSTICK_OVERCOUNT)[-1] == "1 schedules, 0 violations"
    bad = _replay(UNSTICK_OVERCOUNT, "unstick-overcount")
    assert bad[-1] == "1 schedules, 1 violations"
    assert "no progress" in bad[0], bad


def test_search_over_two_nodes_finds_the_lost_forward_bug():
    lines = _simulate("--bug", "lost-forward", "--only-bug", "--seed", "1", "--nodes", "2", "--schedules", "250",
                      "--stop-at-first", "--no-shrink")
    assert lines[-1].endswith(" schedules, 1 violations"), "\n".join(lines)


def test_restart_budgets_budget_finds_no_violation():
    """The supervisor's own failure policy decides each failure (restart the replica, drop it, or
    give the run up) under a budget of one restart a replica and a --min-replicas drawn per
    schedule: no replica restarts past its budget, none is dropped below --min-replicas, the
    keeper lists a dropped replica in no quorum once told of its exit, and the replicas left
    finish (or the run gives up)."""
    lines = _simulate("--max-restarts", "1", "--schedules", "300", "--seed", "1", timeout=600)
    assert lines[-1] == "300 schedules, 0 violations", "\n".join(lines[-20:])


@pytest.mark.quick
def test_budget_overrun_bug_fails_a_schedule_the_product_passes():
    """(l) planted: a replica past its budget restarted once more. Replica 0 is killed twice
    with a budget of one: the product drops it (three others live), the bug restarts it."""
    assert _replay(BUDGET_OVERRUN)[-1] == "1 schedules, 0 violations"
    bad = _replay(BUDGET_OVERRUN, "budget-overrun")
    assert bad[-1] == "1 schedules, 1 violations"
    assert "past its budget of 1" in bad[0], bad


def test_drop_below_min_bug_fails_a_schedule_the_product_passes():
    """(m) planted: a replica past its budget dropped without the --min-replicas test. With
    --min-replicas 2 and one replica left beside it, the product gives the run up."""
    assert _replay(DROP_BELOW_MIN)[-1] == "1 schedules, 0 violations"
    bad = _replay(DROP_BELOW_MIN, "drop-below-min")
    assert bad[-1] == "1 schedules, 1 violations"
    assert "fewer than --min-replicas 2" in bad[0], bad


def test_search_over_restart_budgets_finds_the_drop_below_min_bug():
    lines = _simulate("--bug", "drop-below-min", "--only-bug", "--seed", "1", "--max-restarts", "1",
                      "--schedules", "100", "--stop-at-first", "--no-shrink")
    assert lines[-1].endswith(" schedules, 1 violations"), "\n".join(lines)

def test_late_joiners_budget_finds_no_violation():
    """Elastic late ranks: 1-2 replicas of a node that joins the running run, which node 0 admits
    through the keeper's add_ranks; they join a quorum and heal from a peer like a restarted
    replica (or find the run finished), and half the schedules kill one of them."""
    lines = _simulate("--joiners", "--schedules", "300", "--seed", "1", timeout=600)
    assert lines[-1] == "300 schedules, 0 violations", "\n".join(lines[-20:])


def test_keyless_add_bug_fails_a_schedule_the_product_passes():
    """(n) planted: the keeper took a late node's ranks without creating their keys first; its
    poll, which reads every rank's keys at once, waits on keys only a healed newcomer writes."""
    assert _replay(KEYLESS_ADD)[-1] == "1 schedules, 0 violations"
    bad = _replay(KEYLESS_ADD, "keyless-add")
    assert bad[-1] == "1 schedules, 1 violations"
    assert "no progress" in bad[0], bad

def test_stop_quorums_budget_finds_no_violation():
    """A stop signal mid-run (SIGTERM with --checkpoint-dir): the keeper publishes a stop quorum,
    its members stop at its switch, its writer says how its save went, and a worker that dies
    meanwhile is not restarted. Every quorum after the signal is a stop quorum, and the step the
    writer names is the state committed there."""
    lines = _simulate("--stops", "--schedules", "300", "--seed", "1", timeout=600)
    assert lines[-1] == "300 schedules, 0 violations", "\n".join(lines[-20:])


def test_forgetful_stop_bug_fails_a_schedule_the_product_passes():
    """(o) planted: the keeper forgot the stop after its first stop quorum; the writer's death
    then published an ordinary quorum, in which the others would train on."""
    assert _replay(FORGETFUL_STOP)[-1] == "1 schedules, 0 violations"
    bad = _replay(FORGETFUL_STOP, "forgetful-stop")
    assert bad[-1] == "1 schedules, 1 violations"
    assert "is not a stop quorum" in bad[0], bad

def test_a_stop_writer_that_finished_is_replaced():
    """(t) found by the simulator: the stop quorum named a replica that had already left the loop as
    its writer; its finish now publishes a stop quorum naming another holder, or nobody, and then
    the keeper says so in the writer's place."""
    assert _replay(STOP_WRITER_FINISHED)[-1] == "1 schedules, 0 violations"
    bad = _replay(STOP_WRITER_FINISHED, "finished-writer")
    assert bad[-1] == "1 schedules, 1 violations"
    assert "did not say how its save went" in bad[0], bad


def test_store_moves_budget_finds_no_violation():
    """Three nodes; the node hosting the run's store is lost mid-run: the others move the store to
    the lowest node left, each node's keeper starts there after its old one (store_moved), and the
    replicas follow it (member/moves.py) and rejoin holding their state. No committed decision is
    lost or decided again otherwise, and a quorum's source after the move holds the newest step
    committed before it while a member does."""
    lines = _simulate("--moves", "--schedules", "300", "--seed", "1", timeout=600)
    assert lines[-1] == "300 schedules, 0 violations", "\n".join(lines[-20:])


def test_a_moved_store_heals_from_the_survivors_until_a_heal_lands():
    """(r) found by the simulator: the first source on the moved store died in its transfer, and
    the next quorum forgot the survivors' words: a replica restarted since the move sent its
    initial state over the newest committed step."""
    assert _replay(MOVED_SOURCE_DIED)[-1] == "1 schedules, 0 violations"
    bad = _replay(MOVED_SOURCE_DIED, "first-source-only")
    assert bad[-1] == "1 schedules, 1 violations"
    assert "the moved store lost committed step" in bad[0], bad


def test_a_follower_on_a_moved_store_does_not_wait_for_a_quorum_not_published():
    """(s) found by the simulator: a follower's blocking read of the quorum a moved store's LATEST
    names before its first quorum stopped its node's relay; a member waited for ever."""
    assert _replay(MOVED_FOLLOWER_STALL)[-1] == "1 schedules, 0 violations"
    bad = _replay(MOVED_FOLLOWER_STALL, "blocking-follower")
    assert bad[-1] == "1 schedules, 1 violations"
    assert "no progress" in bad[0], bad


def test_a_moved_store_does_not_heal_from_a_step_voted_down():
    """Found by the simulator: a survivor that stepped past a round the lost store voted down (its
    collective completed as a peer's failed) held the newest step; it now says its last round is
    undecided, and the keeper heals from a replica whose state is decided."""
    assert _replay(MOVED_UNDECIDED_STEP)[-1] == "1 schedules, 0 violations"


def test_a_healer_whose_heal_failed_is_handed_no_step_on_its_own_state():
    """(y) found by the simulator: a survivor of a store's move that had stepped past a round
    whose decision went with the lost store was named a healer and its transfer failed; it now
    sits out every round until a heal lands, instead of running the script on its own state."""
    assert _replay(MOVED_FAILED_HEALER)[-1] == "1 schedules, 0 violations"
    bad = _replay(MOVED_FAILED_HEALER, "failed-healer")
    assert bad[-1] == "1 schedules, 1 violations"
    assert "ran step 14's side effects" in bad[0], bad


def test_a_moved_store_counts_above_every_quorum_a_survivor_saw():
    """Found by the simulator: the moved store's keeper counted from its node's last read of the lost
    store, below a quorum survivors had seen; each survivor now says the newest quorum it saw."""
    assert _replay(MOVED_QUORUM_SEEN)[-1] == "1 schedules, 0 violations"


def test_move_recount_bug_fails_a_schedule_the_product_passes():
    """(p) planted: the moved store's keeper counts quorums from the first again; quorum 1 is then
    a second quorum, and its rounds are decided again."""
    assert _replay(MOVE_RECOUNT)[-1] == "1 schedules, 0 violations"
    bad = _replay(MOVE_RECOUNT, "move-recount")
    assert bad[-1] == "1 schedules, 1 violations"
    assert "quorum 1 published twice" in bad[0], bad


def test_checkpoints_budget_finds_no_violation():
    """The writer replica saves every 1-5 steps through the simulator's checkpointer (partial, then
    published whole); half the schedules kill every worker at once, and the next quorum's source
    resumes the newest complete checkpoint. A resumed checkpoint holds a committed state, never
    past the last committed step; the stop's writer saves for real."""
    lines = _simulate("--checkpoints", "--schedules", "200", "--seed", "1", timeout=600)
    assert lines[-1] == "200 schedules, 0 violations", "\n".join(lines[-20:])
    lines = _simulate("--checkpoints", "--stops", "--schedules", "100", "--seed", "2", timeout=600)
    assert lines[-1] == "100 schedules, 0 violations", "\n".join(lines[-20:])


def test_early_save_bug_fails_a_schedule_the_product_passes():
    """(q) planted: the writer saves at the top of the round after a due commit without waiting
    for its vote's decision; every worker dies, and the run resumes a step never decided."""
    assert _replay(EARLY_SAVE)[-1] == "1 schedules, 0 violations"
    bad = _replay(EARLY_SAVE, "early-save")
    assert bad[-1] == "1 schedules, 1 violations"
    assert "resumes checkpoint step" in bad[0], bad


@pytest.mark.parametrize("bug,mode,schedules", [("move-recount", "--moves", 20),
                                                ("early-save", "--checkpoints", 150),
                                                ("finished-writer", "--checkpoints --stops --seed 3", 300)])
def test_search_finds_the_planted_move_and_checkpoint_bugs(bug, mode, schedules):
    lines = _simulate("--bug", bug, "--only-bug", "--seed", "1", *mode.split(), "--schedules", str(schedules),
                      "--stop-at-first", "--no-shrink")
    assert lines[-1].endswith(" schedules, 1 violations"), "\n".join(lines)


@pytest.mark.quick
def test_a_failing_schedule_replays_exactly():
    def found(lines: List[str]) -> str:  # the violation, without the wall-clock figures
        return lines[0].split("): ", 1)[1]

    assert found(_replay(START_ROUND, "start-round")) == found(_replay(START_ROUND, "start-round"))


@pytest.mark.parametrize("bug,seed,schedules", [("start-round", 1, 250), ("deleted-quorum", 1, 150)])
def test_search_from_a_seed_finds_the_bug(bug, seed, schedules):
    lines = _simulate("--bug", bug, "--only-bug", "--seed", str(seed), "--schedules", str(schedules),
                      "--stop-at-first", "--no-shrink")
    assert lines[-1].endswith(" schedules, 1 violations"), "\n".join(lines)

# ------------------------------------------------------------------ the product's member, not a copy (issue 41)
SIM = ROOT / "ftrun" / "sim"
# What a member decides, by the names the simulator's own member once gave it (ftrun/sim/member.py
# re-wrote the driver): a function or method of ftrun/sim by one of these names is a copy of a
# decision the product's driver (member/driver.py) or core (member/core.py) owns.
DECISION_NAMES = {"vote", "_vote", "settle", "_settle", "start_round", "_start_round", "end_round", "_end_round",
                  "carry_out", "_carry_out", "join", "switch", "heal", "rejoin", "_rejoin", "fail_round",
                  "take_step", "_took_step", "why_give_up", "before_collective", "steps", "finish_loop",
                  "capture", "restore", "set_heal_done", "_watch", "_watch_epochs", "_loop"}
# ... and the expressions of its rules: the vote rule, the switch due, the heal's bookkeeping.
DECISION_TEXT = ["round_ok and", "and self.in_sync", "due_switch(", "MemberCore(", ".handle(", "source_refuses(",
                 "transfer_ends(", "epoch.round_steps", "failed_in_row", "_healed_gen", "rejoins_in_place("]


def _sources(folder: Path):
    import ast

    for path in sorted(folder.glob("*.py")):
        text = path.read_text()
        yield path, text, ast.parse(text)


def test_the_simulator_runs_the_products_member_driver():
    """Every simulated worker is (holds) an instance of the product's MemberDriver; a historic bug
    is a subclass of a product class, never a copy."""
    import random

    from ftrun.sim.bugs import BUGS
    from ftrun.sim.sched import Sched
    from ftrun.sim.schedule import Fault, Schedule
    from ftrun.sim.world import World
    from ftrun.supervisor.ft.quorum import QuorumKeeper
    from ftrun.worker.ft.member.driver import MemberDriver

    schedule = Schedule(7, 3, 4, [Fault(0.2, "kill", 1)])
    world = World(Sched(random.Random(7)), schedule, BUGS["none"])
    assert world.run() is None
    members = world.supervisor.members
    assert members and all(type(m.driver) is MemberDriver for m in members.values())
    for name, wiring in BUGS.items():
        assert issubclass(wiring.driver, MemberDriver) and issubclass(wiring.keeper, QuorumKeeper), name


def test_the_simulator_defines_no_member_decision():
    """ftrun/sim keeps the world (store, scheduler, faults, invariants, effects): no function of it
    bears a decision's name, and no source line of it writes a rule, outside the historic bugs
    (ftrun/sim/bugs.py: subclasses of product classes, checked above)."""
    import ast

    found = []
    for path, text, tree in _sources(SIM):
        if path.name == "bugs.py":
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in DECISION_NAMES:
                found.append(f"{path.name}:{node.lineno} defines {node.name}()")
        for i, line in enumerate(text.splitlines(), 1):
            code = line.split("#", 1)[0]
            found += [f"{path.name}:{i} has `{t}`" for t in DECISION_TEXT if t in code]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "ftrun.worker.ft.member.core":
                found.append(f"{path.name}:{node.lineno} imports the member's rules")
    assert not found, found


def test_nothing_patches_a_product_module():
    """Bugs and effects go in through the driver's effects or subclasses: no assignment (or
    setattr) to an attribute of a module of ftrun, anywhere in ftrun/sim or scripts/simulate.py."""
    import ast
    import importlib

    found = []
    files = [(p, t, tr) for p, t, tr in _sources(SIM)]
    sim_script = ROOT / "scripts" / "simulate.py"
    files.append((sim_script, sim_script.read_text(), ast.parse(sim_script.read_text())))
    for path, _, tree in files:
        modules = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.startswith("ftrun")}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ftrun"):
                for a in node.names:
                    try:
                        importlib.import_module(f"{node.module}.{a.name}")
                        modules.add(a.asname or a.name)
                    except ImportError:
                        pass
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                targets = [t for tt in targets for t in (tt.elts if isinstance(tt, ast.Tuple) else [tt])]
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" and node.args:
                targets = [ast.Attribute(value=node.args[0], attr="?")]
            for t in targets:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id in modules:
                    found.append(f"{path.name}:{node.lineno} sets {t.value.id}.{t.attr}")
    assert not found, found



# ------------------------------------------------------------------ the quorum watcher's wait (member/watch.py)
def _watch_after(seconds: float, quorums: List[int], latest: int) -> int:
    """The newest quorum the product's quorum watcher has seen after `seconds` of virtual time, on a
    simulated store holding `quorums` and LATEST = `latest`, the thread started with nothing seen."""
    import random

    from ftrun import keys
    from ftrun.sim.sched import Sched
    from ftrun.sim.store import SimStore
    from ftrun.worker.ft.member.watch import QuorumWatch

    sched = Sched(random.Random(1))
    store = SimStore(sched)
    for q in quorums:
        store.data[keys.quorum_key(q)] = b"{}"
    store.data[keys.LATEST] = str(latest).encode()

    class Effects:
        def connect(self, timeout_s=None):
            return store.client(600.0 if timeout_s is None else timeout_s)

        def spawn(self, fn, name, low_priority=False):
            sched.spawn(fn, name, "r0.0")

        def sleep(self, seconds):
            sched.sleep(seconds)

        def store_gone(self):
            return False

    class Driver:
        fx, store_gen, finished = Effects(), 0, False

    watch = QuorumWatch(Driver())
    watch.start()
    try:
        while sched.now < seconds and sched.turn():
            pass
    finally:
        sched.shutdown()
    return watch.latest


def test_the_quorum_watcher_is_not_deaf_to_quorums_after_one_collected_unseen():
    """The watcher waits for the quorum after the newest it saw. Quorum 1 came and was collected
    while its member was stopped (nobody was in it any more); 2 and 3 are out. Before the fix the
    watcher's read of quorum 1 waited a day, deaf to 2 and 3; now the read is bounded and the
    watcher reads the newest quorum again."""
    assert _watch_after(0.5, [1, 2, 3], 3) == 3  # the usual case: each quorum in turn, at once
    assert _watch_after(120.0, [2, 3], 3) == 3


@pytest.mark.quick
def test_a_member_out_of_sync_is_handed_no_step():
    """(u) found by the simulator: a member whose group or heal failed was handed the step it held
    (a restarted replica's step 0, on its initial state); it now votes the round down without the
    script and heals at the next round's top. The old code fails the product's replay too."""
    assert _replay(UNSYNCED_STEP)[-1] == "1 schedules, 0 violations"
    bad = _replay(UNSYNCED_STEP, "unsynced-step")
    assert bad[-1] == "1 schedules, 1 violations"
    assert re.search(r"rank \d \(incarnation 1\) is handed step \d+ while out of sync", bad[0]), bad


@pytest.mark.quick
def test_a_step_handed_out_before_its_rounds_decision_is_a_redo_when_voted_down():
    """(v) found by the simulator: ft.redo() on a step handed out before the decision of the round
    under it; it now reads that decision first, and a round voted down makes the step a redo."""
    assert _replay(UNDECIDED_REDO)[-1] == "1 schedules, 0 violations"
    bad = _replay(UNDECIDED_REDO, "undecided-redo")
    assert bad[-1] == "1 schedules, 1 violations"
    assert "side effects on" in bad[0] and "a state the run discarded" in bad[0], bad


def test_hot_spares_budget_finds_no_violation():
    """--spares (issue 43): the keeper holds the highest replicas back as hot spares and lists one in
    the place of a training replica that dies. Faults aimed at them (a spare killed while held or as
    it receives the state, two failures at one instant, more failures than spares) leave no held
    spare in a quorum, no quorum training more than the replicas less the spares, and every other
    invariant holding."""
    lines = _simulate("--spares", "--schedules", "200", "--seed", "1", timeout=600)
    assert lines[-1] == "200 schedules, 0 violations", "\n".join(lines[-20:])


@pytest.mark.quick
def test_spare_short_bug_fails_a_schedule_the_product_passes():
    """(w) planted: the keeper decides from one spare fewer than --spares says."""
    assert _replay(SPARE_SHORT)[-1] == "1 schedules, 0 violations"
    bad = _replay(SPARE_SHORT, "spare-short")
    assert bad[-1] == "1 schedules, 1 violations"
    assert "quorum 1 trains 2 replicas" in bad[0], bad


@pytest.mark.quick
def test_kept_unlike_bug_fails_a_schedule_the_product_passes():
    """(y) planted: a promoted fed spare keeps its models and optimizers whenever its feed followed,
    without the fingerprints' word (member core keeps_fed_state). The product sends that spare the
    whole state; the bug's spare goes on with a state unlike its source's."""
    assert _replay(KEPT_UNLIKE)[-1] == "1 schedules, 0 violations"
    bad = _replay(KEPT_UNLIKE, "kept-unlike")
    assert bad[-1] == "1 schedules, 1 violations"
    assert "keeps a fed state (bad) unlike its heal's source's" in bad[0], bad


def test_fed_spares_are_kept_only_with_equal_fingerprints():
    """Fed spares in the simulator: a held spare follows the committed states; promoted, its heal
    compares fingerprints and the member core decides. Over the spares budget some promotions keep
    the fed state and some (a feed that wrote another state) send it whole, and none keeps one unlike
    its source's (the invariant in sim/worker.py receive_state)."""
    lines = _simulate("--spares", "--schedules", "150", "--seed", "2", timeout=600)
    assert lines[-1] == "150 schedules, 0 violations", "\n".join(lines[-20:])


def test_guard_budget_finds_no_violation():
    """The guard (issue 54): members compare their states every few steps and at the round after
    each heal, in one collective at a round's top. Under kills, pauses, lost stores and heals cut
    short, every member of a group reaches each collective as the same kind (a check, a step, a
    heal), and no check ever finds members in sync holding different states."""
    lines = _simulate("--guard", "--schedules", "200", "--seed", "1", timeout=600)
    assert lines[-1] == "200 schedules, 0 violations", "\n".join(lines[-20:])


def test_lone_check_bug_fails_a_schedule_the_product_passes():
    """(x) planted: the guard's check due on some members only; their peers' next collective is a
    step's, and the two would mix."""
    assert _replay(LONE_CHECK)[-1] == "1 schedules, 0 violations"
    bad = _replay(LONE_CHECK, "lone-check")
    assert bad[-1] == "1 schedules, 1 violations"
    assert "is a step where rank 0's is a check" in bad[0], bad


def test_sub_steps_budget_finds_no_violation():
    """Several ft.Optimizers (issue 55): each step of the loop is 2 or 3 optimizer steps, each with its
    own collective; a round voted down inside a step keeps its first sub-steps, and the step is handed
    out again with them skipped. Under every fault, committed states agree sub-step by sub-step, no
    member goes on from more sub-steps than its round kept, and the runs finish; with the store
    moving between nodes too, whose survivors rejoin holding part of a step."""
    for mode in (["--sub-steps"], ["--sub-steps", "--moves", "--schedules", "100"]):
        lines = _simulate(*mode, *(["--schedules", "200"] if "--schedules" not in mode else []), "--seed", "1",
                          timeout=600)
        assert lines[-1].endswith(" 0 violations"), "\n".join(lines[-20:])
