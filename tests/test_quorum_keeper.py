"""The quorum keeper's decisions, driven step by step against a real TCPStore in this process.

The workers' side is played by writing what a worker writes (join requests, status reports,
votes) into the store; the keeper is the supervisor's own class. Each test is one interleaving
that once deadlocked or could: fast enough for the quick tier.
"""

from __future__ import annotations

import datetime
import json
import threading
import time

import pytest
import torch.distributed as dist

from ftrun import keys, pacing, votes
from ftrun.supervisor.ft.keeper import core, dead
from ftrun.supervisor.ft.quorum import QuorumKeeper
from ftrun.supervisor.relay import NodeRelay, Routes
from ftrun.wire import WIRE_VERSION, MemberReport
from ftrun.worker.ft.member import vote

pytestmark = pytest.mark.quick


class _RunStore:
    def __init__(self) -> None:
        self.store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=10))


@pytest.fixture
def keeper(monkeypatch):
    monkeypatch.setattr(dead, "STUCK_S", 0.0)  # decide on the second poll, not after 2 s
    q = QuorumKeeper(_RunStore(), [0, 1, 2])
    q.on_store_ready()
    return q


def _join(q: QuorumKeeper, rank: int, inc: int) -> None:
    q.alive[rank] = inc
    q._s.set(keys.join_key(rank), str(inc))


def _report(q: QuorumKeeper, rank: int, inc: int, quorum, rnd: int, phase: str) -> None:
    q._s.set(keys.info_key(rank), MemberReport(inc=inc, quorum_id=quorum, round=rnd, phase=phase,
                                               beat=q._s.add(f"beat{rank}", 1)).encode())


def _in_round(q: QuorumKeeper, ranks, quorum: int = 1, rnd: int = 5, now: float = 0.1) -> None:
    """The live members' status reports, as each member writes them every 0.25 s (through its
    node's relay when it has one): they are in `quorum`, voting in round `rnd`. The keeper
    abstains for a dead member only in the newest rounds of a quorum someone is in."""
    info = {r: json.loads(MemberReport(inc=0, quorum_id=quorum, round=rnd, phase="vote", beat=1).encode())
            for r in ranks}
    if q.routes is None:
        for r in ranks:
            q._s.set(keys.info_key(r), json.dumps(info[r]))
    else:
        for k in q.routes.nodes:
            mine = {str(r): info[r] for r in q.routes.ranks(k) if r in info}
            if mine:
                q._s.set(keys.node_info_key(k), json.dumps(mine))
    q.poll(now)


def _members(q: QuorumKeeper, quorum: int) -> dict:
    return dict(tuple(m) for m in json.loads(q._s.get(keys.quorum_key(quorum)))["members"])


def test_first_quorum_waits_for_every_started_replica(keeper):
    _join(keeper, 0, 0)
    keeper.poll(0.0)
    assert keeper.quorum_id == 0  # ranks 1 and 2 are starting: the first quorum waits for them
    _join(keeper, 1, 0)
    _join(keeper, 2, 0)
    keeper.poll(0.1)
    assert keeper.quorum_id == 1 and _members(keeper, 1) == {0: 0, 1: 0, 2: 0}


def test_after_every_replica_died_the_next_quorum_waits_for_all(keeper):
    """Every holder lost: the fresh quorum waits for every replica being started (a resumed run
    must not train alone on one replica's gradients), as the first does."""
    for r in range(3):
        _join(keeper, r, 0)
    keeper.poll(0.0)
    for r in range(3):
        keeper.on_exit(r, 0)
    assert keeper.members == {} and keeper.quorum_id == 3  # quorums 2 and 3 as the first two left
    for r in range(3):
        keeper.alive[r] = 1
    _join(keeper, 2, 1)
    keeper.poll(1.0)
    assert keeper.quorum_id == 3
    _join(keeper, 0, 1)
    _join(keeper, 1, 1)
    keeper.poll(1.1)
    assert keeper.quorum_id == 4 and _members(keeper, 4) == {0: 1, 1: 1, 2: 1}


def test_a_rejoining_replica_does_not_wait_for_others(keeper):
    """With live members, a replica that rejoins is admitted alone at once."""
    for r in range(3):
        _join(keeper, r, 0)
    keeper.poll(0.0)
    keeper.on_exit(0, 0)
    assert keeper.quorum_id == 2 and _members(keeper, 2) == {1: 0, 2: 0}
    _join(keeper, 0, 1)
    keeper.poll(0.1)
    assert keeper.quorum_id == 3 and _members(keeper, 3) == {0: 1, 1: 0, 2: 0}


def test_joiner_that_will_enter_a_newer_quorum_is_voted_for_in_the_older(keeper):
    """Rank 1 votes in quorum 3, which lists rank 0's new incarnation; quorum 4 is out before rank
    0 entered any quorum, so rank 0 will enter 4 and never vote in 3. The keeper votes fail in
    its place, the round closes, and rank 1 moves on (it waited for ever before)."""
    for r in range(3):
        _join(keeper, r, 0)
    keeper.poll(0.0)
    keeper.on_exit(0, 0)                      # quorum 2: ranks 1, 2
    _join(keeper, 0, 1)
    keeper.poll(0.1)                          # quorum 3: rank 0 (incarnation 1) joins
    keeper.on_exit(2, 0)                      # quorum 4: ranks 0, 1
    assert keeper.quorum_id == 4 and _members(keeper, 3) == {0: 1, 1: 0, 2: 0}
    rnd = 7
    keeper._s.add(keys.count_key(3, rnd), 1)  # rank 1's ok vote
    for poll in range(3):
        _report(keeper, 1, 0, 3, rnd, "vote")
        _report(keeper, 0, 1, None, 0, "join")
        keeper.poll(1.0 + poll)
    assert keeper._s.check([keys.decision_key(3, rnd)]), keeper.history
    assert keeper._s.get(keys.decision_key(3, rnd)).decode().startswith("fail")
    assert any("rank 0 is still joining while quorum 3 waits for its vote" in h for h in keeper.history)


def test_joiner_of_the_newest_quorum_is_left_to_enter_it(keeper):
    """The same wait in the newest quorum is not stuck: the joiner will enter that quorum and
    vote, so the keeper must not vote in its place."""
    for r in range(3):
        _join(keeper, r, 0)
    keeper.poll(0.0)
    keeper.on_exit(0, 0)
    _join(keeper, 0, 1)
    keeper.poll(0.1)                          # quorum 3, the newest
    rnd = 7
    keeper._s.add(keys.count_key(3, rnd), 2)  # ranks 1 and 2 voted ok
    for poll in range(3):
        _report(keeper, 1, 0, 3, rnd, "vote")
        _report(keeper, 2, 0, 3, rnd, "vote")
        _report(keeper, 0, 1, None, 0, "join")
        keeper.poll(1.0 + poll)
    assert not keeper._s.check([keys.decision_key(3, rnd)]), keeper.history


def _quorum(q: QuorumKeeper, quorum: int) -> dict:
    return json.loads(q._s.get(keys.quorum_key(quorum)))


@pytest.mark.parametrize("step_s,expected", [(0.3, 1), (0.05, 4), (0.007, pacing.ROUND_STEPS), (None, 1)])
def test_rounds_follow_the_runs_pace(keeper, step_s, expected):
    """Quorums published once the keeper has seen the global step rise have rounds of about
    ROUND_TARGET_S: a slow model's restarted replica must not wait 8 of its steps to join. Before,
    rounds are one step: the pace may be that slow."""
    for r in range(3):
        _join(keeper, r, 0)
    keeper.poll(0.0)
    assert _quorum(keeper, 1)["round_steps"] == 1  # no pace known yet
    if step_s is not None:
        for i in range(150):  # over 0.5 s from the first step reported (step 0 is no pace)
            for r in range(3):
                keeper._s.set(keys.info_key(r), MemberReport(inc=0, quorum_id=1, round=i, phase="compute",
                                                             step=i, beat=i).encode())
            keeper.poll((i + 1) * step_s)
    assert (keeper.pace.step_s() is None) == (step_s is None)  # a fast run's 8 comes from its pace, too
    keeper.on_exit(0, 0)
    assert _quorum(keeper, 2)["round_steps"] == expected, keeper.history
    _join(keeper, 0, 1)
    keeper.poll(151 * step_s if step_s else 100.0)  # the run goes on at its pace
    assert _quorum(keeper, 3)["round_steps"] == expected


def test_pace_forgets_a_run_that_started_again_from_step_0():
    """Every holder lost: the run starts again at step 0 (or a checkpoint's step), and the old
    pace says nothing about the new one."""
    pace = core.Pace()
    for i in range(10):
        pace.note(i * 0.5, 100 + i)
    assert pace.step_s() == pytest.approx(0.5)
    pace.note(6.0, 0)
    assert pace.step_s() is None
    for i in range(1, 5):
        pace.note(6.0 + i * 0.01, i)
    assert pace.step_s() is None  # 4 steps in 0.04 s: too little to tell
    pace.note(7.0, 100)
    assert pace.step_s() == pytest.approx(0.01)


def test_a_chosen_round_length_is_kept(monkeypatch):
    monkeypatch.setenv(pacing.ROUND_STEPS_ENV, "5")
    q = QuorumKeeper(_RunStore(), [0, 1])
    q.on_store_ready()
    for r in range(2):
        _join(q, r, 0)
    q.poll(0.0)
    for i in range(20):
        for r in range(2):
            q._s.set(keys.info_key(r), MemberReport(inc=0, quorum_id=1, round=i, phase="compute", step=i).encode())
        q.poll(1.0 + i)
    q.on_exit(1, 0)
    assert _quorum(q, 1)["round_steps"] == 5 and _quorum(q, 2)["round_steps"] == 5


def test_joiner_scanning_quorums_never_waits_on_a_deleted_one():
    """A joining worker looks for the newest started quorum that lists it, scanning down; the
    keeper deletes quorums nobody is in. Reaching a deleted one ends the scan (nothing older can
    list it) at once: a blocking read would wait for the store's timeout, deaf to the quorum
    its peers then start (a deadlock seen in 1 chaos run in 28)."""
    import time

    from ftrun.wire import Quorum
    from ftrun.worker.ft.member.membership import started_quorum_with_me

    store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=30))
    for e in (4, 5):
        store.set(keys.quorum_key(e), Quorum(e, ((0, 1), (1, 1))).to_json())
    t0 = time.monotonic()
    assert started_quorum_with_me(store, (0, 1), 5) is None  # 4 and 5 not started, 3 deleted
    assert time.monotonic() - t0 < 5
    store.set(keys.start_key(5), "17")
    assert started_quorum_with_me(store, (0, 1), 5) == (5, 17)


def test_no_quorum_is_deleted_while_a_live_replica_is_joining(keeper):
    """Rank 1 rejoins and is about to enter quorum 3 while every other replica dies and comes
    back: with no live replica reporting a quorum, the keeper once deleted quorums up to the
    newest minus two, and with them the decision rank 1 then waited for forever."""
    for r in range(3):
        _join(keeper, r, 0)
    keeper.poll(0.0)
    keeper.on_exit(1, 0)                      # quorum 2
    _join(keeper, 1, 1)
    keeper.poll(0.1)                          # quorum 3: rank 1 (incarnation 1) joins
    keeper.on_exit(0, 0)                      # quorum 4
    keeper.on_exit(2, 0)                      # quorum 5: rank 1 alone
    _join(keeper, 0, 1)
    keeper.poll(0.2)                          # quorum 6
    _join(keeper, 2, 1)
    keeper.poll(0.3)                          # quorum 7
    assert keeper.quorum_id == 7
    for r, inc in ((0, 1), (1, 1), (2, 1)):
        _report(keeper, r, inc, None, 0, "join")
    keeper._collected_at, keeper._collected_when = -99, -1e9  # collect on this poll
    keeper.poll(1.0)
    assert all(keeper._s.check([keys.quorum_key(e)]) for e in range(1, 8))
    _report(keeper, 1, 1, 3, 28, "vote")     # rank 1 entered quorum 3 after all
    for r in (0, 2):
        _report(keeper, r, 1, 7, 30, "vote")
    keeper.poll(2.0)                          # reads the reports (the keeper collects before it reads)
    keeper._collected_at, keeper._collected_when = -99, -1e9
    keeper.poll(2.1)
    assert all(keeper._s.check([keys.quorum_key(e)]) for e in range(1, 8))  # rank 1 is in quorum 3
    _report(keeper, 1, 1, 7, 30, "vote")     # every live replica in quorum 7: older ones go
    keeper.poll(3.0)
    keeper._collected_at, keeper._collected_when = -99, -1e9
    keeper.poll(3.1)
    assert [e for e in range(1, 8) if keeper._s.check([keys.quorum_key(e)])] == [5, 6, 7]


@pytest.mark.parametrize("second", ["ok", "fail"])
def test_a_dead_members_abstention_leaves_the_decision_to_the_survivors(keeper, second):
    """Members whose collectives succeeded step before the decision is in (it is read a round
    later). If a member dies after its part of the round went through, its peers' round must
    still commit, or every survivor would have stepped past a discarded round with nobody to
    heal from: the keeper abstains for the dead, it does not vote them down. A survivor's
    failed vote still fails the round."""
    for r in range(3):
        _join(keeper, r, 0)
    keeper.poll(0.0)
    keeper._s.set(keys.TOP, "4")              # rounds up to 4 decided: 5 and 6 are in flight
    keeper._s.add(keys.count_key(1, 5), votes.OK_VOTE)
    keeper._s.add(keys.count_key(1, 5), votes.OK_VOTE if second == "ok" else votes.FAIL_VOTE)
    _in_round(keeper, [1, 2])
    keeper.on_exit(0, 0)                      # rank 0 never voted in round 5
    assert keeper._s.get(keys.decision_key(1, 5)).decode() == ("commit 2" if second == "ok" else "fail 2")


def test_no_abstention_piles_up_in_an_quorum_nobody_is_in(keeper):
    """Rank 0 dies and restarts; while its new incarnation starts (no report yet) the old quorum
    that lists the dead one may still be entered, so it is kept. The others train on in quorum
    2: the keeper abstains for the dead in the rounds of quorum 2 they reach, not in rounds of
    quorum 1 nobody will come to (those counts never close: found by the simulator, where a
    store grew past 300 keys)."""
    for r in range(3):
        _join(keeper, r, 0)
    keeper.poll(0.0)
    keeper.on_exit(0, 0)                      # quorum 2: ranks 1, 2
    keeper.alive[0] = 1                       # its next incarnation, starting: it has not reported
    for top in (4, 8, 12, 16):
        keeper._s.set(keys.TOP, str(top))
        _in_round(keeper, [1, 2], quorum=2, rnd=top + 1, now=top / 10)
    rounds_1 = sorted(keys.parse_key(k)[1][1] for k in keeper._s.list_keys()
                      if (keys.parse_key(k) or ("", ()))[0] == "n" and keys.parse_key(k)[1][0] == 1)
    assert rounds_1 == [0, 1], rounds_1  # its start (where a joiner would begin), nothing more
    assert keeper._s.check([keys.quorum_key(1)])  # kept: the starting replica may yet enter it


def test_a_round_whose_closer_died_is_decided_by_its_votes(keeper):
    """Every member voted ok in round 5, and the one whose vote closed the round died before it
    wrote the decision. The others have stepped already: the keeper decides the round by its
    votes (commit), never as failed."""
    for r in range(3):
        _join(keeper, r, 0)
    keeper.poll(0.0)
    keeper._s.set(keys.TOP, "4")
    for _ in range(3):
        keeper._s.add(keys.count_key(1, 5), votes.OK_VOTE)
    _in_round(keeper, [0, 1])
    keeper.on_exit(2, 0)  # the closer: its abstention over-counts; the keeper sees the round closed, undecided
    assert keeper._s.get(keys.decision_key(1, 5)).decode() == "commit 2"


def test_a_failed_round_keeps_the_steps_every_member_took(keeper):
    """Rounds are several steps, one vote each. A member dies in round 5's third step (index 2):
    rank 1's collective of that step fails (it took 2 steps), rank 2's went through and its next
    one fails (it took 3). Both vote fail from threads at once, each lowering the round's kept
    count first; the keeper abstains for the dead. The decision keeps 2 steps: rank 1 goes on,
    rank 2, one step past them, restarts and heals."""
    for r in range(3):
        _join(keeper, r, 0)
    keeper.poll(0.0)
    keeper._s.set(keys.TOP, "4")
    _in_round(keeper, [1, 2])
    host, port = "127.0.0.1", keeper._s.port
    out = {}

    def member(rank: int, taken: int) -> None:
        own = dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=10))
        out[rank] = vote.cast(own, 1, 5, 3, False, 1, taken=taken)

    threads = [threading.Thread(target=member, args=(r, t)) for r, t in ((2, 3), (1, 2))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while votes.tally(keeper._s.add(keys.count_key(1, 5), 0)).votes < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    keeper.on_exit(0, 0)  # its abstention closes the round: the keeper decides it
    for t in threads:
        t.join(10)
    assert keeper._s.get(keys.decision_key(1, 5)).decode() == "fail 2 2"
    assert out[1] == (False, 2, False, 2) and out[2] == (False, 2, False, 2)
    # A member's vote that closes a failed round writes the same: lowest count, newest quorum it saw.
    keeper._s.set(keys.kept_key(1, 9), "7")
    vote.lower_kept(keeper._s, 1, 9, 9)
    vote.lower_kept(keeper._s, 1, 9, 4)
    keeper._s.add(keys.count_key(1, 9), 2 * votes.OK_VOTE)
    assert vote.cast(keeper._s, 1, 9, 3, False, 3, taken=5) == (False, 3, True, 4)
    assert votes.parse_decision("fail 3") == (False, 3, 0) and votes.parse_decision("commit 3") == (True, 3, None)


def test_tally_reads_each_kind_of_vote():
    total = 3 * votes.OK_VOTE + 2 * votes.ABSTAIN_VOTE + votes.FAIL_VOTE
    assert votes.tally(total) == (6, 1, 3) and not votes.tally(total).commit
    assert votes.tally(2 * votes.ABSTAIN_VOTE + votes.OK_VOTE).commit
    assert not votes.tally(3 * votes.ABSTAIN_VOTE).commit  # nobody voted ok: nothing to commit


# ------------------------------------------------------------------ votes through node relays
_SERVERS = []  # kept to the end: a store server torn down under its clients' feet stalls for seconds


class _Node:
    """A node's own store, hosted here as a node's ftrun hosts it."""

    def __init__(self) -> None:
        self.server = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=10))
        _SERVERS.append(self.server)
        self.addr = f"127.0.0.1:{self.server.port}"

    def client(self) -> dist.TCPStore:
        return dist.TCPStore("127.0.0.1", self.server.port, None, False, datetime.timedelta(seconds=30))


class _Counting:
    """A run's-store client that counts the calls members make on it."""

    def __init__(self, store) -> None:
        self.store, self.calls = store, 0

    def __getattr__(self, name):
        fn = getattr(self.store, name)

        def call(*a):
            self.calls += 1
            return fn(*a)
        return call


@pytest.fixture
def relayed(monkeypatch):
    """Four replicas on two relaying nodes (ranks 0-1 on node 1, 2-3 on node 2), quorum 1 formed."""
    monkeypatch.setattr(dead, "STUCK_S", 0.0)
    nodes = {1: _Node(), 2: _Node()}
    q = QuorumKeeper(_RunStore(), [0, 1, 2, 3], routes=Routes({1: (nodes[1].addr, [0, 1]),
                                                                 2: (nodes[2].addr, [2, 3])}))
    _SERVERS.append(q._s)
    q.on_store_ready()
    for r in range(4):
        _join(q, r, 0)
    q.poll(0.0)
    assert q.quorum_id == 1
    q._s.set(keys.TOP, "4")  # rounds up to 4 decided: 5 and 6 are in flight
    return q, nodes


def _member(q, nodes, rank: int):
    node = 1 if rank < 2 else 2
    run = _Counting(dist.TCPStore("127.0.0.1", q._s.port, None, False, datetime.timedelta(seconds=30)))
    return run, vote.Node(node, 2 * (node - 1), 2, nodes[node].client())


def _cast_in_thread(run, node, rnd: int = 5, ok: bool = True):
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("d", vote.cast(run, 1, rnd, 4, ok, 1, node, 2)), daemon=True)
    t.start()
    return t, out


def test_votes_through_node_relays_reach_the_run_store_once_per_node(relayed):
    q, nodes = relayed
    members = [_member(q, nodes, r) for r in range(4)]
    threads = [_cast_in_thread(run, node) for run, node in members]
    for t, _ in threads:
        t.join(10)
    assert [out["d"][:2] for _, out in threads] == [(True, 1)] * 4
    # Two members forwarded their node's count (one add, one decision read or write each); the
    # others only talked to their node's store.
    assert sorted(run.calls for run, _ in members) == [0, 0, 2, 3]
    assert votes.tally(q._s.add(keys.count_key(1, 5), 0)) == (4, 0, 4)


def test_a_dead_members_vote_goes_through_its_node_and_the_relay_delivers_the_decision(relayed):
    """Rank 1 dies before voting: the keeper abstains in node 1's store, which completes node 1's
    count; the keeper forwards it, and node 1's relay copies the decision to rank 0, which waits."""
    q, nodes = relayed
    (run0, node0), (run2, node2), (run3, node3) = (_member(q, nodes, r) for r in (0, 2, 3))
    waiting = _cast_in_thread(run0, node0)
    others = [_cast_in_thread(run2, node2), _cast_in_thread(run3, node3)]
    _in_round(q, [0, 2, 3])
    q.on_exit(1, 0)
    relay = NodeRelay(1, [0, 1], lambda: nodes[1].client(), lambda: q._s)
    deadline = time.monotonic() + 30
    while any(t.is_alive() for t, _ in [waiting] + others) and time.monotonic() < deadline:
        q.poll(time.monotonic())  # as the supervisor polls: a vote its node's store missed is cast again
        relay.poll(time.monotonic())
        time.sleep(0.05)
    assert [out["d"][0] for _, out in [waiting] + others] == [True] * 3
    assert votes.tally(q._s.add(keys.count_key(1, 5), 0)) == (4, 0, 3)


def test_a_node_count_whose_forwarder_died_is_forwarded_by_the_keeper(relayed):
    """Rank 1 completed node 1's count and died before forwarding it: nobody else would. The
    keeper sees the count complete with no forward mark and forwards it, less its own vote."""
    q, nodes = relayed
    run0, node0 = _member(q, nodes, 0)
    waiting = _cast_in_thread(run0, node0)
    local = nodes[1].client()
    deadline = time.monotonic() + 10
    while votes.tally(local.add(keys.node_count_key(1, 1, 5), 0)).votes < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    local.add(keys.node_count_key(1, 1, 5), votes.OK_VOTE)  # rank 1's vote: the node's last; then it dies
    for r in (2, 3):
        run, node = _member(q, nodes, r)
        threading.Thread(target=vote.cast, args=(run, 1, 5, 4, True, 1, node, 2), daemon=True).start()
    _in_round(q, [0, 2, 3])
    q.on_exit(1, 0)
    relay = NodeRelay(1, [0, 1], lambda: nodes[1].client(), lambda: q._s)
    while waiting[0].is_alive() and time.monotonic() < deadline:
        q.poll(time.monotonic())
        relay.poll(time.monotonic())
        time.sleep(0.05)
    assert waiting[1]["d"][0] is True
    assert votes.tally(q._s.add(keys.count_key(1, 5), 0)) == (4, 0, 4)  # the keeper's own vote left out


def test_a_lost_nodes_members_are_voted_for_in_the_run_store(relayed):
    """Node 2 is gone with its store: the keeper's abstentions for ranks 2 and 3 go to the run's
    store, and node 1's members, who forwarded their count, read the commit."""
    q, nodes = relayed
    members = [_member(q, nodes, r) for r in (0, 1)]
    threads = [_cast_in_thread(run, node) for run, node in members]
    _SERVERS.remove(nodes[2].server)
    del nodes[2].server  # the node's store goes with it
    q.routes.lose(2)     # as the supervisor does when its node watch declares node 2 lost
    _in_round(q, [0, 1])
    q.on_exit(2, 0)
    q.on_exit(3, 0)
    for t, _ in threads:
        t.join(10)
    assert [out["d"][0] for _, out in threads] == [True] * 2
    assert votes.tally(q._s.add(keys.count_key(1, 5), 0)) == (4, 0, 2)


def test_members_waiting_on_their_node_follow_a_moved_store(relayed):
    """The run's store moved while node 1's forwarder was cut off from the old one: the node's
    relay ends the wait of its other member, which follows the store (vote.StoreMovedMidVote)."""
    q, nodes = relayed
    run0, node0 = _member(q, nodes, 0)
    failed = {}

    def wait() -> None:
        try:
            vote.cast(run0, 1, 5, 4, True, 1, node0, 2)
        except vote.StoreMovedMidVote as e:
            failed["e"] = e

    t = threading.Thread(target=wait, daemon=True)
    t.start()
    relay = NodeRelay(1, [0, 1], lambda: nodes[1].client(), lambda: q._s)
    relay.moved(1)
    deadline = time.monotonic() + 10
    while t.is_alive() and time.monotonic() < deadline:
        relay.poll(time.monotonic())
        time.sleep(0.05)
    assert "e" in failed


def test_a_relayed_nodes_reports_reach_the_keeper_through_one_key(relayed):
    """Workers of relaying nodes report in their node's store (as ftrun.worker.progress writes
    there); each node's relay copies them into one key of the run's store, only when one changed,
    and the keeper (leader and follower) reads every replica's report there. The run's store
    holds no per-rank report of theirs."""
    from ftrun.worker.progress import ProgressReporter

    q, nodes = relayed
    reporters = {}
    for r in range(4):
        node = nodes[1 if r < 2 else 2]
        rep = ProgressReporter("127.0.0.1", node.server.port, r, 0, relayed=True)
        rep.info_provider = lambda r=r: MemberReport(inc=0, quorum_id=1, round=7, phase="compute", step=10 + r)
        rep.move_to(f"127.0.0.1:{q._s.port}")  # the run's store moved: the node's store did not
        assert rep.port == node.server.port
        reporters[r] = (rep, node.client())
        rep._write(reporters[r][1], 1)
    runs = {k: _Counting(dist.TCPStore("127.0.0.1", q._s.port, None, False, datetime.timedelta(seconds=30)))
            for k in nodes}
    relays = {k: NodeRelay(k, [2 * k - 2, 2 * k - 1], lambda c=nodes[k].client(): c, lambda k=k: runs[k])
              for k in nodes}
    now = time.monotonic()

    def relay_and_poll(now: float) -> None:
        for relay in relays.values():
            relay.poll(now)
        q.poll(now)

    relay_and_poll(now)
    assert {r: q.info[r].step for r in range(4)} == {0: 10, 1: 11, 2: 12, 3: 13}
    assert [runs[k].calls for k in nodes] == [1, 1]  # one set per node
    assert not any(q._s.check([keys.info_key(r)]) or q._s.check([keys.progress_key(r)]) for r in range(4))
    assert nodes[1].client().check([keys.progress_key(0), keys.info_key(0)])
    follower = QuorumKeeper(q.store, [0, 1, 2, 3], local_ranks=[0, 1], leader=False, routes=q.routes)
    follower.on_store_ready()
    follower.poll(now)
    assert {r: follower.info[r].step for r in range(4)} == {0: 10, 1: 11, 2: 12, 3: 13}

    # Rank 0 beats again: only its report is new (the keeper tells a live report by its beat).
    seen = dict(q.info_seen)
    rep, client = reporters[0]
    rep._write(client, 2)
    relay_and_poll(now + 1)
    assert q.info[0].beat == 2 and q.info_seen[0] > seen[0]
    assert [q.info_seen[r] for r in (1, 2, 3)] == [seen[r] for r in (1, 2, 3)]
    assert [runs[k].calls for k in nodes] == [2, 1]  # node 2's reports did not change: not written

    # The run's store moved: the relay writes its reports to the new one at its next poll.
    relays[2].moved(1)
    relay_and_poll(now + 2)
    assert runs[2].calls == 2


def test_a_malformed_node_environment_means_not_relayed():
    env = {keys.NODE_RANKS_ENV: "1 2 2", keys.NODE_STORE_ENV: "10.0.0.2:5000"}
    assert keys.relayed_node(env) == (1, 2, 2, "10.0.0.2:5000")
    for bad in ({**env, keys.NODE_RANKS_ENV: "1 2"}, {**env, keys.NODE_RANKS_ENV: "1 x 2"},
                {**env, keys.NODE_STORE_ENV: ""}, {keys.NODE_RANKS_ENV: "1 2 2"}):
        assert keys.relayed_node(bad) is None


def test_a_report_of_another_wire_version_is_refused_in_one_line(keeper):
    """A member of another ftrun (another node's install) writes its report in another format: the
    keeper ignores it (the replica has no report, and the old one it had goes), and the console
    gets one line naming the versions and the fix, once however often that member reports."""
    for r in range(3):
        _join(keeper, r, 0)
    keeper.poll(0.0)
    _report(keeper, 1, 0, 1, 5, "vote")
    keeper.poll(0.1)
    assert keeper.info[1].quorum_id == 1
    keeper.take_history()
    for beat in range(3):  # an older ftrun's report: no version, the quorum id under its old word
        keeper._s.set(keys.info_key(1), json.dumps({"inc": 0, "epoch": 1, "round": 6, "phase": "vote", "beat": beat}))
        keeper.poll(0.2 + beat / 10)
    lines = [line for line in keeper.take_history() if "wire" in line]
    assert lines == [f"rank 1's ftrun.ft reports without a wire version, and this ftrun reads version "
                     f"{WIRE_VERSION}: they are ignored; run the same ftrun on every node"], lines
    assert 1 not in keeper.info and keeper.replica_fields(1)["ft_phase"] is None
    keeper._s.set(keys.info_key(1), json.dumps({"version": WIRE_VERSION + 1, "inc": 0}))
    keeper.poll(0.6)
    assert [line for line in keeper.take_history() if f"in wire version {WIRE_VERSION + 1}," in line]
    _report(keeper, 1, 0, 1, 7, "vote")  # the same ftrun again: read as before
    keeper.poll(0.7)
    assert keeper.info[1].round == 7 and not keeper.take_history()
