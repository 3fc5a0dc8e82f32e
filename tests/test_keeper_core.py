"""The quorum keeper's core (ftrun.supervisor.ft.keeper), tested by tables: each row is a snapshot of
what the keeper knows and `now`, and the decision the core must take, with its reason. No store,
no clock, no process: the whole file runs in milliseconds. The keeper's shell, against a real
store, is tests/test_quorum_keeper.py; the interleavings, tests/test_simulate.py.
"""

from __future__ import annotations

from typing import Optional

import dataclasses

import pytest

from ftrun import keys, votes
from ftrun.supervisor.ft.keeper import core, dead
from ftrun.supervisor.ft.keeper.core import KeeperSnapshot
from ftrun.supervisor.ft.keeper.dead import KeeperRules
from ftrun.wire import MemberReport, Quorum, SurvivorReport

pytestmark = pytest.mark.quick

RULES = KeeperRules()
A, F, O = votes.ABSTAIN_VOTE, votes.FAIL_VOTE, votes.OK_VOTE


def snap(**kw) -> KeeperSnapshot:
    """A snapshot of replicas 0..n-1 (`n`, default 3), all alive as incarnation 0 unless said."""
    n = kw.pop("n", 3)
    kw.setdefault("ranks", list(range(n)))
    kw.setdefault("alive", {r: 0 for r in range(n)})
    return KeeperSnapshot(**kw)


def rep(quorum: Optional[int], rnd: int = 5, inc: int = 0, phase: str = "vote", **more) -> MemberReport:
    """A replica's status report: in `quorum` (None: joining), at round `rnd`."""
    return MemberReport(inc=inc, quorum_id=quorum, round=rnd, phase=phase, **more)


def seen(*ranks, at: float = 10.0) -> dict:
    return {r: at for r in ranks}


def row(id_: str, *values):
    return pytest.param(*values, id=id_)


# ------------------------------------------------------------------ admission: who joins, when a quorum is published
ADMIT = [
    row("first replicas all joined",
        snap(), {0: 0, 1: 0, 2: 0}, 1.0, {0: 0, 1: 0, 2: 0}, "first replicas joined", "admitted"),
    row("first quorum waits for a replica still starting",
        snap(), {0: 0, 1: 0}, 1.0, {0: 0, 1: 0}, None, "waits for ranks [2]"),
    row("first quorum stops waiting after FIRST_QUORUM_WAIT_S",
        snap(pending={0: 0, 1: 0}, pending_since=1.0), {0: 0, 1: 0}, 1.0 + core.FIRST_QUORUM_WAIT_S,
        {0: 0, 1: 0}, "first replicas joined", "admitted"),
    row("first quorum does not wait for a dead replica",
        snap(alive={0: 0, 1: 0, 2: None}), {0: 0, 1: 0}, 1.0, {0: 0, 1: 0}, "first replicas joined", "admitted"),
    row("a join of an older incarnation is not the live one's",
        snap(alive={0: 0, 1: 0, 2: 1}), {0: 0, 1: 0, 2: 0}, 1.0, {0: 0, 1: 0}, None, "waits for ranks [2]"),
    row("a restarted replica joins a running quorum at once",
        snap(quorum_id=3, members={0: 0, 1: 0}, alive={0: 0, 1: 0, 2: 1}), {0: 0, 1: 0, 2: 1}, 5.0,
        {2: 1}, "rank 2 joined", "admitted [2]"),
    row("two replicas join together",
        snap(quorum_id=3, members={0: 0}, alive={0: 0, 1: 2, 2: 1}), {0: 0, 1: 2, 2: 1}, 5.0,
        {1: 2, 2: 1}, "ranks 1, 2 joined", "admitted [1, 2]"),
    row("a sharded replica is admitted only whole",
        snap(n=4, k=2, quorum_id=2, members={0: 0, 1: 0}, alive={0: 0, 1: 0, 2: 1, 3: 1}), {2: 1, 3: -1}, 5.0,
        {}, None, "nobody to admit"),
    row("a sharded replica whose workers all asked is admitted",
        snap(n=4, k=2, quorum_id=2, members={0: 0, 1: 0}, alive={0: 0, 1: 0, 2: 1, 3: 1}), {2: 1, 3: 1}, 5.0,
        {2: 1, 3: 1}, "ranks 2, 3 joined", "admitted"),
    row("a sharded replica's workers asking as different incarnations wait",
        snap(n=4, k=2, quorum_id=2, members={0: 0, 1: 0}, alive={0: 0, 1: 0, 2: 1, 3: 2}), {2: 1, 3: 2}, 5.0,
        {}, None, "nobody to admit"),
    row("a stopping run admits nobody",
        snap(quorum_id=3, members={0: 0, 1: 0}, alive={0: 0, 1: 0, 2: 1}, stopping=True), {2: 1}, 5.0,
        {}, None, "stopping"),
    row("every member lost: the next quorum waits for the others like a first",
        snap(quorum_id=4, members={}, alive={0: 1, 1: 1, 2: 1}), {0: 1}, 5.0, {0: 1}, None, "waits for ranks [1, 2]"),
    row("every member lost: published after the wait",
        snap(quorum_id=4, members={}, pending={0: 1}, pending_since=5.0, alive={0: 1, 1: 1, 2: 1}), {0: 1}, 36.0,
        {0: 1}, "rank 0 joined", "admitted"),
    row("on a moved store only the last quorum's members are awaited",
        snap(awaited={0, 1}), {0: 0, 1: 0}, 1.0, {0: 0, 1: 0}, "first replicas joined", "admitted"),
    row("a member does not join again",
        snap(quorum_id=2, members={0: 0, 1: 0, 2: 0}), {0: 0, 1: 0, 2: 0}, 5.0, {}, None, "nobody to admit"),
]


@pytest.mark.parametrize("s,joins,now,pending,publish,reason", ADMIT)
def test_admission(s, joins, now, pending, publish, reason):
    d = core.admit(s, joins, now)
    assert dict(d.pending) == pending
    assert d.publish == publish
    assert reason in d.reason
    assert not d.quiet
    if pending:
        assert d.pending_since == (s.pending_since if s.pending_since is not None else now)
    else:
        assert d.pending_since is None


# ------------------------------------------------------------------ the pace: rounds re-sized without a failure
def _steady(**kw) -> KeeperSnapshot:
    """Members 0, 1 in quorum 2 holding the state and reporting freshly, rounds of 8 steps."""
    base = dict(n=2, quorum_id=2, members={0: 0, 1: 0}, healed={(0, 0), (1, 0)},
                info={0: rep(2), 1: rep(2)}, info_seen=seen(0, 1), quorum_steps=8, round_steps=8)
    base.update(kw)
    return snap(**base)


REPACE = [
    row("slow steps: rounds of 8 last 2.4 s", _steady(step_s=0.3), 10.0, True, "re-sized to 1"),
    row("fast steps: rounds of 8 last 0.04 s, shorter than allowed", _steady(step_s=0.005), 10.0, False, None),
    row("rounds near the target stay", _steady(step_s=0.025), 10.0, False, None),
    row("pace not known yet", _steady(step_s=None), 10.0, False, None),
    row("the user chose the round length", _steady(step_s=0.3, round_steps_chosen=True), 10.0, False, None),
    row("once per window", _steady(step_s=0.3, repace_after=20.0), 10.0, False, None),
    row("a member still heals", _steady(step_s=0.3, healed={(0, 0)}), 10.0, False, None),
    row("a member reports another quorum", _steady(step_s=0.3, info={0: rep(2), 1: rep(1)}), 10.0, False, None),
    row("a member's report is stale", _steady(step_s=0.3, info_seen={0: 10.0, 1: 8.0}), 10.0, False, None),
    row("no members", _steady(step_s=0.3, members={}), 10.0, False, None),
    row("slow rounds of 2 steps get 1", _steady(step_s=0.3, quorum_steps=2), 10.0, True, "re-sized to 1"),
    row("sharded replicas step one a round whatever the quorum says: no group rebuilt for it",
        _steady(step_s=0.3, k=2, n=4, members={0: 0, 1: 0, 2: 0, 3: 0},
                healed={(r, 0) for r in range(4)}, info={r: rep(2) for r in range(4)}, info_seen=seen(0, 1, 2, 3)),
        10.0, False, None),
    # Rounds of one step, sized before the pace was known (quorum_paced False).
    row("one-step rounds until the pace was known grow to it, though they last within the bounds",
        _steady(step_s=0.06, quorum_steps=1, quorum_paced=False), 10.0, True, "until the pace was known"),
    row("... however short they last", _steady(step_s=0.005, quorum_steps=1, quorum_paced=False), 10.0, True,
        "re-sized to 8"),
    row("... without waiting for the pace window: they follow no earlier pace",
        _steady(step_s=0.06, quorum_steps=1, quorum_paced=False, repace_after=20.0), 10.0, True, "re-sized to 3"),
    row("... not when the pace wants one step", _steady(step_s=0.3, quorum_steps=1, quorum_paced=False), 10.0, False,
        None),
    row("... nor while a member heals", _steady(step_s=0.06, quorum_steps=1, quorum_paced=False, healed={(0, 0)}),
        10.0, False, None),
    row("paced one-step rounds within the bounds stay", _steady(step_s=0.06, quorum_steps=1), 10.0, False, None),
]


@pytest.mark.parametrize("s,now,due,reason", REPACE)
def test_repace(s, now, due, reason):
    why = core.repace_due(s, now)
    assert (why is not None) == due
    d = core.admit(s, {}, now)
    if due:
        assert reason in why
        assert d.publish == "" and d.quiet and d.repace_after == now + core.Pace.WINDOW_S
    else:
        assert d.publish is None and d.repace_after is None


def test_rounds_sized_before_the_pace_is_known_are_one_step_said_nowhere_and_provisional():
    """A quorum published before the keeper has seen the pace has rounds of one step (a restarted
    replica joins at the survivors' next step's top, not up to ROUND_STEPS slow steps later), not
    said in its history line (every run's first quorum has them), and marked provisional, so that
    repace_due re-sizes them once the pace is known; a paced one is said."""
    s = snap(quorum_id=2, top=9, members={0: 0, 1: 0}, healed={(0, 0), (1, 0)}, entered={0: 0}, round_steps=8)
    d = core.next_quorum(s, "rank 2 left", {})
    assert (d.quorum.round_steps, d.paced, d.history) == (1, False, "quorum 3: 2 replicas (rank 2 left)")
    d = core.next_quorum(KeeperSnapshot(**{**s.__dict__, "step_s": 0.05}), "rank 2 left", {})
    assert (d.quorum.round_steps, d.paced) == (4, True)
    assert d.history == "quorum 3: 2 replicas (rank 2 left), rounds of 4 steps"
    d = core.next_quorum(KeeperSnapshot(**{**s.__dict__, "round_steps": 5, "round_steps_chosen": True}), "x", {})
    assert (d.quorum.round_steps, d.paced) == (5, True)


PACED = [
    row("unknown pace: one step (a joiner and a stop wait for a round's top)", snap(step_s=None, round_steps=8), 1),
    row("unknown pace, the user's choice stands", snap(step_s=None, round_steps=6, round_steps_chosen=True), 6),
    row("50 ms steps: 4 a round", snap(step_s=0.05, round_steps=8), 4),
    row("slow steps: one a round", snap(step_s=1.0, round_steps=8), 1),
    row("very fast steps: the most", snap(step_s=0.001, round_steps=8), 8),
    row("the user's choice stands", snap(step_s=0.05, round_steps=6, round_steps_chosen=True), 6),
]


@pytest.mark.parametrize("s,steps", PACED)
def test_paced_steps(s, steps):
    assert core.paced_steps(s) == steps


CHECKS = [
    row("about 300 s of 1 s steps", snap(step_s=1.0), 300),
    row("about 300 s of 7 ms steps", snap(step_s=0.007), 42857),
    row("unknown pace: a fixed count", snap(step_s=None), 1000),
    row("the user's count stands", snap(step_s=1.0, check_steps=25), 25),
    row("the guard off: none, whatever the count", snap(step_s=1.0, check_s=0.0, check_steps=25), 0),
]


@pytest.mark.parametrize("s,steps", CHECKS)
def test_check_steps(s, steps):
    assert core.check_steps(s) == steps
    s = dataclasses.replace(s, members={0: 0, 1: 0, 2: 0})
    assert core.next_quorum(s, "test", {}).quorum.check_steps == steps


# ------------------------------------------------------------------ the next quorum: members, healers, source, start
def _moved(**kw) -> KeeperSnapshot:
    base = dict(n=4, quorum_id=7, top=40, moved=True, pending={0: 1, 1: 1, 2: 1, 3: 1},
                alive={0: 1, 1: 1, 2: 1, 3: 1}, round_steps=1, round_steps_chosen=True)
    base.update(kw)
    return snap(**base)


def said(step: int, inc: int = 1, in_sync: bool = True, decided: bool = False) -> str:
    return SurvivorReport(inc=inc, step=step, in_sync=in_sync, decided=decided).encode()


NEXT = [
    # (snapshot, why, healed read now) -> (members, healers, fresh, start, fresh after the first, history part,
    #  the heal's source ranks, one a shard)
    row("the first quorum: the lowest replica sends its state",
        snap(pending={0: 0, 1: 0, 2: 0}, top=-1), "first replicas joined", {},
        {0: 0, 1: 0, 2: 0}, (1, 2), True, 0, False, "quorum 1: 3 replicas (first replicas joined)", (0,)),
    row("a joiner heals from the holders; members that entered continue",
        snap(quorum_id=2, top=9, members={0: 0, 1: 0}, pending={2: 1}, healed={(0, 0), (1, 0)},
             entered={0: 0, 1: 0}), "rank 2 joined", {},
        {0: 0, 1: 0, 2: 1}, (2,), False, -1, False, "quorum 3: 3 replicas (rank 2 joined)", (0,)),
    row("nobody entered yet: the quorum starts after the newest decided round",
        snap(quorum_id=2, top=9, members={0: 0, 1: 0}, pending={2: 1}, healed={(0, 0), (1, 0)},
             entered={0: -1, 1: -1}), "rank 2 joined", {},
        {0: 0, 1: 0, 2: 1}, (2,), False, 10, False, "quorum 3", (0,)),
    row("a member that healed a moment ago holds the state",
        snap(quorum_id=2, top=9, members={0: 0, 1: 0}, healed={(0, 0)}, entered={0: 0}), "rank 2 left", {1: 0},
        {0: 0, 1: 0}, (), False, -1, False, "(rank 2 left)", (0,)),
    row("an older incarnation's heal is not the member's",
        snap(quorum_id=2, top=9, members={0: 0, 1: 1}, healed={(0, 0), (1, 0)}, entered={0: 0}), "rank 2 left", {},
        {0: 0, 1: 1}, (1,), False, -1, False, "(rank 2 left)", (0,)),
    row("no holder left: a fresh quorum, said so",
        snap(quorum_id=4, top=20, members={1: 1}, pending={0: 2}, healed={(1, 0)}), "rank 0 joined", {},
        {0: 2, 1: 1}, (1,), True, 21, True, "no replica holding the trained state is left: starting again", (0,)),
    row("no holder left, resumed from a checkpoint: said so",
        snap(quorum_id=4, top=20, members={1: 1}, fresh_start="resuming from the newest checkpoint"), "x", {},
        {1: 1}, (), True, 21, True, "left: resuming from the newest checkpoint", (1,)),
    row("a sharded replica heals whole when one of its workers does not hold its shard",
        snap(n=4, k=2, quorum_id=2, top=3, members={0: 0, 1: 0, 2: 0, 3: 0}, healed={(0, 0), (1, 0), (2, 0)},
             entered={0: 0, 1: 0, 2: 0, 3: 0}), "rank 3 joined", {},
        {0: 0, 1: 0, 2: 0, 3: 0}, (2, 3), False, -1, False, "2 replicas of 2 workers", (0, 1)),
    row("a fresh quorum of sharded replicas: replica 0's workers send",
        snap(n=4, k=2, pending={0: 0, 1: 0, 2: 0, 3: 0}), "first replicas joined", {},
        {0: 0, 1: 0, 2: 0, 3: 0}, (2, 3), True, 0, False, "2 replicas of 2 workers", (0, 1)),
    row("the lowest replica left sends a fresh quorum's state",
        snap(quorum_id=0, pending={1: 0, 2: 0}), "first replicas joined", {},
        {1: 0, 2: 0}, (2,), True, 0, False, "2 replicas", (1,)),
    row("rounds paced to the run: said in the history",
        snap(quorum_id=2, top=9, members={0: 0, 1: 0}, healed={(0, 0), (1, 0)}, entered={0: 0}, step_s=0.05,
             round_steps=8), "rank 2 left", {},
        {0: 0, 1: 0}, (), False, -1, False, "rounds of 4 steps", (0,)),
    row("moved store: the replica with the newest whole step heals the others",
        _moved(survivors={0: said(10), 1: said(12), 2: said(11), 3: said(12)}), "first replicas joined", {},
        {0: 1, 1: 1, 2: 1, 3: 1}, (0, 2, 3), False, 41, False, "replica 1 holds the newest step", (1,)),
    row("moved store, sharded: a replica whose workers hold different steps is not whole",
        _moved(k=2, survivors={0: said(12), 1: said(11), 2: said(10), 3: said(10)}), "first replicas joined", {},
        {0: 1, 1: 1, 2: 1, 3: 1}, (0, 1), False, 41, False, "replica 1 holds the newest step", (2, 3)),
    row("moved store: a replica out of sync, of another incarnation, or unreadable says nothing",
        _moved(survivors={0: said(30, in_sync=False), 1: said(30, inc=0), 2: "{not json", 3: said(5)}),
        "first replicas joined", {},
        {0: 1, 1: 1, 2: 1, 3: 1}, (0, 1, 2), False, 41, False, "replica 3 holds the newest step", (3,)),
    row("moved store: nobody said anything: a fresh quorum from the lowest replica",
        _moved(), "first replicas joined", {},
        {0: 1, 1: 1, 2: 1, 3: 1}, (1, 2, 3), True, 41, True, "no replica holding the trained state is left", (0,)),
    row("moved store: a tie goes to the lowest replica",
        _moved(survivors={2: said(9), 3: said(9)}), "first replicas joined", {},
        {0: 1, 1: 1, 2: 1, 3: 1}, (0, 1, 3), False, 41, False, "replica 2 holds the newest step", (2,)),
    row("moved store: a decided state beats a newer step past a round whose decision was lost",
        _moved(survivors={0: said(11), 1: said(10, decided=True), 2: said(11), 3: said(9, decided=True)}),
        "first replicas joined", {},
        {0: 1, 1: 1, 2: 1, 3: 1}, (0, 2, 3), False, 41, False, "replica 1 holds the newest step", (1,)),
    row("moved store, the first source died in its transfer: the survivors' words stand",
        _moved(quorum_id=8, members={0: 1, 1: 1, 3: 1}, pending={}, survivors={0: said(10), 1: said(12), 3: said(11)}),
        "rank 2 left", {},
        {0: 1, 1: 1, 3: 1}, (0, 3), False, 41, False, "replica 1 holds the newest step", (1,)),
    row("moved store, a replica holds the state there: an ordinary quorum, the survivors' words spent",
        _moved(quorum_id=8, members={0: 1, 1: 1, 3: 1}, pending={}, healed={(1, 1)},
               survivors={0: said(10), 1: said(12), 3: said(11)}), "rank 2 left", {},
        {0: 1, 1: 1, 3: 1}, (0, 3), False, 41, False, "rank 2 left", (1,)),
]


@pytest.mark.parametrize("s,why,healed,members,healers,fresh,start,fresh_after,history,sources", NEXT)
def test_next_quorum(s, why, healed, members, healers, fresh, start, fresh_after, history, sources):
    d = core.next_quorum(s, why, healed)
    e = d.quorum
    assert e.id == s.quorum_id + 1 and not e.stop
    assert dict(e.members) == members
    assert e.healers == healers
    assert e.sources == sources and [e.source(shard) for shard in range(s.k)] == list(sources)
    assert Quorum.from_json(e.to_json()) == e
    assert (e.fresh, e.start_round, d.fresh) == (fresh, start, fresh_after)
    assert e.round_steps == core.paced_steps(s)
    assert history in d.history and d.reason
    assert d.healed == frozenset((r, h) for r, h in healed.items() if h >= 0)
    assert d.moving == (s.moved and not (set(s.healed) | d.healed) & set(e.members))
    assert set(d.forget) == (set(s.survivors) & set(members) if s.moved and not d.moving else set())
    quiet = core.next_quorum(s, why, healed, quiet=True)
    assert quiet.history is None and quiet.quorum == e


STOP = [
    # (snapshot, healed read now) -> (writer, start, saver)
    row("the lowest holder writes",
        snap(quorum_id=3, top=7, members={0: 0, 1: 0, 2: 0}, healed={(1, 0), (2, 0)}, entered={0: 0}, local={0, 1, 2}),
        {}, 1, -1, "replica 1 saves"),
    row("a holder on the keeper's node writes before a lower one elsewhere",
        snap(quorum_id=3, top=7, members={0: 0, 1: 0, 2: 0}, healed={(0, 0), (1, 0), (2, 0)}, local={2}),
        {}, 2, 8, "replica 2 saves"),
    row("nobody holds the state: nothing is saved",
        snap(quorum_id=3, top=7, members={0: 0, 1: 0}, entered={1: 0}), {}, -1, -1, "nothing to save"),
    row("a member that healed a moment ago writes",
        snap(quorum_id=3, top=7, members={0: 0, 1: 0}), {1: 0}, 1, 8, "replica 1 saves"),
    row("a holder that left the loop never reads the quorum: the next writes",
        snap(quorum_id=3, top=7, members={0: 0, 1: 0, 2: 0}, healed={(0, 0), (1, 0), (2, 0)},
             info={0: rep(3, phase="done"), 1: rep(3, phase="done", inc=1)}), {}, 1, 8, "replica 1 saves"),
    row("every holder left the loop: nothing to save",
        snap(quorum_id=3, top=7, members={0: 0, 1: 0}, healed={(0, 0), (1, 0)},
             info={0: rep(3, phase="done"), 1: rep(3, phase="done")}), {}, -1, 8, "left the loop, which saved"),
    row("sharded: a replica whose every worker holds its shard writes",
        snap(n=4, k=2, quorum_id=3, top=7, members={0: 0, 1: 0, 2: 0, 3: 0}, healed={(0, 0), (2, 0), (3, 0)},
             local={0, 1, 2, 3}), {}, 1, 8, "replica 1 saves"),
]


@pytest.mark.parametrize("s,healed,writer,start,saver", STOP)
def test_stop_quorum(s, healed, writer, start, saver):
    for d in (core.stop_quorum(s, "a stop signal", healed),
              core.next_quorum(KeeperSnapshot(**{**s.__dict__, "stopping": True, "pending": {9: 0}}),
                               "a stop signal", healed)):
        assert d.quorum.stop and d.quorum.writer == writer and d.quorum.start_round == start
        assert dict(d.quorum.members) == dict(s.members)  # nobody joins a stop quorum
        assert d.quorum.healers == () and d.quorum.round_steps == 1
        assert saver in d.history


def test_stop_word_when_no_writer_is_left():
    """A stop quorum that names nobody after one that named a writer: the keeper's word stands in
    for the writer's (the supervisor waits for one); the first stop quorum needs none."""
    later = snap(quorum_id=5, members={2: 1}, stopping=True, writer=1, info={2: MemberReport(step=15)})
    d = core.stop_quorum(later, "the writer died", {})
    assert d.quorum.writer == -1 and d.stop_word["ok"] is False and d.stop_word["step"] == 15
    assert "replica 1" in d.stop_word["why"] and not d.stop_word.get("nothing")
    for ended in (snap(quorum_id=5, members={2: 1}, stopping=True, writer=1, finished={(1, 0)}),
                  snap(quorum_id=5, members={1: 0, 2: 1}, stopping=True, writer=1, healed={(1, 0)},
                       info={1: rep(4, phase="done")})):
        word = core.stop_quorum(ended, "the writer left the loop", {}).stop_word
        assert word["nothing"] and "the training loop had ended" in word["why"]  # its end saved the last step
    assert core.stop_quorum(snap(quorum_id=5, members={2: 1}, stopping=True), "a stop signal", {}).stop_word is None
    held = core.stop_quorum(snap(quorum_id=5, members={2: 1}, stopping=True, writer=1, healed={(2, 1)}), "x", {})
    assert held.quorum.writer == 2 and held.stop_word is None


def test_a_writer_that_left_the_loop_is_replaced():
    """The stop quorum's writer reports it left the loop (of its member incarnation): a stop quorum
    naming another is due; not for another replica's report, an older incarnation's, or no writer."""
    base = dict(quorum_id=4, members={0: 0, 1: 0, 2: 0}, stopping=True, writer=0)
    assert "replica 0, the writer, left the loop" in core.stop_writer_left(snap(**base, info={0: rep(3, phase="done")}))
    assert core.stop_writer_left(snap(**base, info={1: rep(3, phase="done")})) is None
    assert core.stop_writer_left(snap(**base, info={0: rep(3, phase="done", inc=1)})) is None
    assert core.stop_writer_left(snap(**base, info={0: rep(3, phase="stop")})) is None
    assert core.stop_writer_left(snap(**{**base, "writer": -1}, info={0: rep(3, phase="done")})) is None
    assert core.stop_writer_left(snap(**{**base, "stopping": False}, info={0: rep(3, phase="done")})) is None
    sharded = snap(n=4, k=2, quorum_id=4, members={r: 0 for r in range(4)}, stopping=True, writer=1,
                   info={3: rep(3, phase="done")})
    assert "replica 1" in core.stop_writer_left(sharded)


EXITS = [
    # (snapshot, rank, inc, finished) -> (leaving, publish, finished, unpend)
    row("a member dies: a quorum without it",
        snap(quorum_id=2, members={0: 0, 1: 0, 2: 0}), 1, 0, False, {1: 0}, "rank 1 left", False, (1,)),
    row("the last member dies: no quorum",
        snap(quorum_id=2, members={1: 0}), 1, 0, False, {1: 0}, None, False, (1,)),
    row("a member finishes: it never votes again, no quorum",
        snap(quorum_id=2, members={0: 0, 1: 0}), 1, 0, True, {1: 0}, None, True, (1,)),
    row("the stop quorum's writer finishes: a stop quorum naming another",
        snap(quorum_id=4, members={0: 0, 1: 0, 2: 0}, stopping=True, writer=1), 1, 0, True, {1: 0},
        "the writer, rank 1, finished before the stop", True, (1,)),
    row("a stop quorum's other member finishes: no quorum",
        snap(quorum_id=4, members={0: 0, 1: 0, 2: 0}, stopping=True, writer=0), 1, 0, True, {1: 0}, None, True, (1,)),
    row("the stop quorum's last member, its writer, finishes: no quorum",
        snap(quorum_id=4, members={1: 0}, stopping=True, writer=1), 1, 0, True, {1: 0}, None, True, (1,)),
    row("an older incarnation dies: nothing changes",
        snap(quorum_id=2, members={0: 0, 1: 2}), 1, 1, False, {}, None, False, (1,)),
    row("a sharded replica leaves whole",
        snap(n=6, k=2, quorum_id=2, members={r: 0 for r in range(6)}), 3, 0, False, {2: 0, 3: 0},
        "replica 1 left (rank 3 of ranks 2-3)", False, (2, 3)),
    row("a pending sharded replica waits for its next incarnation",
        snap(n=4, k=2, quorum_id=2, members={0: 0, 1: 0}, pending={2: 1, 3: 1}), 2, 1, False, {}, None, False, (2, 3)),
]


@pytest.mark.parametrize("s,rank,inc,finished,leaving,publish,done,unpend", EXITS)
def test_exit_plan(s, rank, inc, finished, leaving, publish, done, unpend):
    d = core.exit_plan(s, rank, inc, finished)
    assert (dict(d.leaving), d.publish, d.finished, tuple(d.unpend)) == (leaving, publish, done, unpend)
    assert d.reason


REJOIN = [
    row("the live incarnation rejoins in place", snap(alive={0: 3}), 0, 3, True),
    row("an incarnation that died meanwhile stays dead", snap(alive={0: None}), 0, 3, False),
    row("a newer incarnation is already booked", snap(alive={0: 4}), 0, 3, False),
    row("sharded replicas restart instead", snap(k=2, alive={0: 3}), 0, 3, False),
]


@pytest.mark.parametrize("s,rank,inc,applies", REJOIN)
def test_rejoin_applies(s, rank, inc, applies):
    assert core.rejoin_applies(s, rank, inc) == applies


# ------------------------------------------------------------------ votes for the dead
DEAD = [
    # (snapshot, dead member) -> {quorum: rounds}, vote
    row("the newest quorum: the two rounds after the newest decided one",
        snap(quorum_id=2, top=9, quorums={2: {(0, 0), (1, 0)}}, alive={0: 0, 1: None}), (1, 0),
        {2: (10, 11)}, A),
    row("a quorum started afresh: its start too",
        snap(quorum_id=2, top=9, quorums={2: {(0, 0), (1, 0)}}, starts={2: 4}, alive={0: 0, 1: None}), (1, 0),
        {2: (4, 5, 10, 11)}, A),
    row("the rounds live members report being in",
        snap(quorum_id=2, top=9, quorums={2: {(0, 0), (1, 0)}}, alive={0: 0, 1: None}, info={0: rep(2, rnd=7)}),
        (1, 0), {2: (7, 8, 10, 11)}, A),
    row("an older quorum nobody reports being in: its start only",
        snap(quorum_id=3, top=9, quorums={2: {(0, 0), (1, 0)}, 3: {(0, 0)}}, starts={2: 4}, alive={0: 0, 1: None},
             info={0: rep(None)}), (1, 0), {2: (4, 5)}, A),
    row("every member of the newest quorum dead: no rounds ahead",
        snap(quorum_id=2, top=9, quorums={2: {(0, 0), (1, 0)}}, alive={0: None, 1: None}), (1, 0), {2: ()}, A),
    row("a quorum below every live replica's is past",
        snap(quorum_id=3, top=9, quorums={1: {(0, 0), (1, 0)}, 3: {(0, 0), (1, 0)}}, alive={0: 0, 1: None},
             info={0: rep(3, rnd=8)}), (1, 0), {3: (8, 9, 10, 11)}, A),
    row("a joiner that reports no quorum yet keeps the old ones",
        snap(quorum_id=3, top=9, quorums={1: {(0, 0), (1, 0)}, 3: {(0, 0), (1, 0)}}, starts={1: 0},
             alive={0: 0, 1: None, 2: 1}, info={0: rep(3, rnd=8), 2: rep(None, inc=1)}), (1, 0),
        {1: (0, 1), 3: (8, 9, 10, 11)}, A),
    row("never below the collected horizon",
        snap(quorum_id=2, top=9, quorums={2: {(0, 0), (1, 0)}}, starts={2: 4}, collected_below={2: 6},
             alive={0: 0, 1: None}), (1, 0), {2: (10, 11)}, A),
    row("never in a quorum whose keys are all gone",
        snap(quorum_id=2, top=9, quorums={2: {(0, 0), (1, 0)}}, starts={2: 4}, collected_below={2: dead.QUORUM_COLLECTED},
             alive={0: 0, 1: None}), (1, 0), {2: ()}, A),
    row("sharded replicas: a failed vote",
        snap(n=4, k=2, quorum_id=2, top=9, quorums={2: {(0, 0), (1, 0), (2, 0), (3, 0)}},
             alive={0: 0, 1: 0, 2: None, 3: None}), (2, 0), {2: (10, 11)}, F),
    row("a quorum that does not list it: nothing",
        snap(quorum_id=2, top=9, quorums={2: {(0, 0)}}, alive={0: 0, 1: None}), (1, 0), {}, A),
]


@pytest.mark.parametrize("s,member,rounds,vote", DEAD)
def test_votes_for_the_dead(s, member, rounds, vote):
    due = dead.dead_votes(RULES, s, member)
    assert {d.quorum: d.rounds for d in due} == rounds
    assert all(d.vote == vote and d.reason for d in due)


FORGET = [
    # (snapshot, dead members) -> forgotten
    row("every live replica is past every quorum that listed it",
        snap(quorums={1: {(1, 0)}, 2: {(0, 0)}}, alive={0: 0, 1: None, 2: None}, info={0: rep(2)}), [(1, 0)], [(1, 0)]),
    row("a live replica is still in its quorum",
        snap(quorums={1: {(0, 0), (1, 0)}}, alive={0: 0, 1: None}, info={0: rep(1)}), [(1, 0)], []),
    row("a joiner not reporting yet may enter it",
        snap(quorums={1: {(1, 0), (2, 0)}, 2: {(0, 0)}}, alive={0: 0, 1: None, 2: 0}, info={0: rep(2)}), [(1, 0)], []),
    row("nobody alive reports: kept",
        snap(quorums={1: {(1, 0)}}, alive={0: None, 1: None}), [(1, 0)], []),
]


@pytest.mark.parametrize("s,members,gone", FORGET)
def test_forget_dead(s, members, gone):
    forgotten, kept = dead.forget_dead(s, members)
    assert list(forgotten) == gone and set(kept) == set(members) - set(gone)


def _waiting(**kw) -> KeeperSnapshot:
    """Rank 0 votes in round 5 of quorum 2, which lists ranks 0 and 1, since t=1 (STUCK_S ago at t=3)."""
    base = dict(quorum_id=3, quorums={2: {(0, 0), (1, 0)}, 3: {(1, 0)}}, info={0: rep(2)}, info_seen=seen(0, 1, at=3.0))
    base.update(kw)
    return snap(**base)


SINCE = {0: ((2, 5), 1.0)}
UNSTICK = [
    # (snapshot, voting since, cast before, now) -> failed votes (rank, quorum, round), since kept for rank 0
    row("a member in another quorum: fail in its place",
        _waiting(info={0: rep(2), 1: rep(3)}), SINCE, set(), 3.0, [(1, 2, 5)], ((2, 5), 1.0)),
    row("not before STUCK_S",
        _waiting(info={0: rep(2), 1: rep(3)}), SINCE, set(), 2.9, [], ((2, 5), 1.0)),
    row("first seen voting: the wait starts now",
        _waiting(info={0: rep(2), 1: rep(3)}), {}, set(), 3.0, [], ((2, 5), 3.0)),
    row("a new round: the wait starts again",
        _waiting(info={0: rep(2, rnd=6), 1: rep(3)}), SINCE, set(), 3.0, [], ((2, 6), 3.0)),
    row("a joiner reporting no quorum while a newer one is out",
        _waiting(info={0: rep(2), 1: rep(None)}), SINCE, set(), 3.0, [(1, 2, 5)], ((2, 5), 1.0)),
    row("a joiner of the newest quorum is waited for",
        _waiting(quorum_id=2, info={0: rep(2), 1: rep(None)}), SINCE, set(), 3.0, [], ((2, 5), 1.0)),
    row("a member that finished",
        _waiting(finished={(1, 0)}, alive={0: 0, 1: None}), SINCE, set(), 3.0, [(1, 2, 5)], ((2, 5), 1.0)),
    row("a member in the same quorum is waited for",
        _waiting(info={0: rep(2), 1: rep(2, rnd=4, phase="step")}), SINCE, set(), 3.0, [], ((2, 5), 1.0)),
    row("a member whose report is stale says nothing",
        _waiting(info={0: rep(2), 1: rep(3)}, info_seen={0: 3.0, 1: 1.0}), SINCE, set(), 3.0, [], ((2, 5), 1.0)),
    row("an older incarnation's report is not the member's",
        _waiting(info={0: rep(2), 1: rep(3, inc=1)}), SINCE, set(), 3.0, [], ((2, 5), 1.0)),
    row("never twice",
        _waiting(info={0: rep(2), 1: rep(3)}), SINCE, {(1, 0, 2, 5)}, 3.0, [], ((2, 5), 1.0)),
    row("a voter whose report is stale waits for nothing",
        _waiting(info={0: rep(2), 1: rep(3)}, info_seen={0: 1.0, 1: 3.0}), SINCE, set(), 3.0, [], None),
    row("a voter in a quorum the keeper never published",
        _waiting(info={0: rep(9), 1: rep(3)}), SINCE, set(), 3.0, [], None),
]


@pytest.mark.parametrize("s,since,cast,now,votes,kept", UNSTICK)
def test_unstick(s, since, cast, now, votes, kept):
    voting_since, due = dead.unstick(RULES, s, since, cast, now)
    assert [(v.rank, v.quorum, v.rnd) for v in due] == votes
    assert all("voted fail in its place" in v.reason for v in due)
    assert voting_since.get(0) == kept


COUNTS = [
    # (total after the add, added, size) -> decision of the add (None: not closed)
    row("the last ok vote commits", 3 * O, O, 3, True),
    row("an abstention closing a round of oks commits", 2 * O + A, A, 3, True),
    row("a failed vote fails the round", 2 * O + F, F, 3, False),
    row("only abstentions: no ok, the round fails", 2 * A, A, 2, False),
    row("not the last vote", 2 * O, O, 3, None),
    row("a count jumping past its size closes it", 3 * O + F, 2 * O, 3, False),
    row("an add after the count was complete does not close it again", 4 * O, O, 3, None),
]


@pytest.mark.parametrize("after,added,size,decision", COUNTS)
def test_closed_round(after, added, size, decision):
    assert dead.closed_round(RULES, after, added, size) is decision


ORPHANS = [
    row("every vote in, all ok: commit", 3 * O, 3, True),
    row("every vote in, one failed: fail", 2 * O + F, 3, False),
    row("a vote counted twice: decided by its votes", 3 * O + A, 3, True),
    row("a vote missing: not orphaned", 2 * O, 3, None),
]


@pytest.mark.parametrize("total,size,decision", ORPHANS)
def test_orphan_commit(total, size, decision):
    assert dead.orphan_commit(total, size) is decision


FORWARDS = [
    # (node count, node size, forwarded, first seen, now, the keeper's votes there) -> action, total forwarded
    row("forwarded by the node's last voter", 2 * O, 2, True, 1.0, 5.0, [], "clear", 0),
    row("votes missing", O, 2, False, 1.0, 5.0, [], "clear", 0),
    row("first seen: wait", 2 * O, 2, False, None, 5.0, [], "wait", 0),
    row("not yet STUCK_S", 2 * O, 2, False, 4.0, 5.0, [], "wait", 0),
    row("the forwarder died: forward in its place", O + A, 2, False, 1.0, 5.0, [A], "forward", O + A),
    row("the keeper's excess votes are left out", 2 * O + A, 2, False, 1.0, 5.0, [A], "forward", 2 * O),
]


@pytest.mark.parametrize("total,size,forwarded,since,now,mine,action,sent", FORWARDS)
def test_node_forward(total, size, forwarded, since, now, mine, action, sent):
    d = dead.node_forward(total, size, forwarded, since, now, mine)
    assert (d.action, d.total) == (action, sent)
    assert dead.node_counted(total, size) == (votes.tally(total).votes >= size)


# ------------------------------------------------------------------ collection
def _round_keys(e: int, rnd: int):
    return [keys.count_key(e, rnd), keys.decision_key(e, rnd), keys.kept_key(e, rnd), keys.heal_key(e, rnd),
            keys.pg_prefix(e, rnd) + "addr"]


def _names(*quorums_rounds, extra=()):
    names = [keys.LATEST, keys.TOP, keys.join_key(0), keys.info_key(1), "not/ours"]
    for e, rounds in quorums_rounds:
        names += [keys.quorum_key(e), keys.start_key(e)]
        for rnd in rounds:
            names += _round_keys(e, rnd)
    return names + list(extra)


COLLECT = [
    # (snapshot, key names) -> keys deleted, collected horizons, oldest quorum kept
    row("rounds more than ROUND_KEYS_KEPT behind a quorum's newest decided one go",
        snap(n=2, info={0: rep(3), 1: rep(3)}), _names((3, range(10))),
        [k for rnd in range(5) for k in _round_keys(3, rnd)], {3: 5}, 1),
    row("quorums two below the oldest any live replica is in go whole",
        snap(n=2, info={0: rep(4), 1: rep(5)}), _names((1, [0]), (2, [1]), (4, [2])),
        [keys.quorum_key(1), keys.start_key(1)] + _round_keys(1, 0), {1: dead.QUORUM_COLLECTED, 2: -1, 4: -1}, 2),
    row("a live replica reporting no quorum yet: no quorum goes",
        snap(n=2, info={0: rep(5)}), _names((1, [0]), (5, [1])), [], {1: -1, 5: -1}, -1),
    row("a dead replica's silence keeps nothing",
        snap(n=2, alive={0: 0, 1: None}, info={0: rep(5)}), _names((1, [0]), (5, [1])),
        [keys.quorum_key(1), keys.start_key(1)] + _round_keys(1, 0), {1: dead.QUORUM_COLLECTED, 5: -1}, 3),
    row("a sharded replica's group of an earlier incarnation goes",
        snap(n=4, k=2, alive={0: 2, 1: 2, 2: 0, 3: 0}),
        _names(extra=[keys.replica_prefix(0, 1) + "addr", keys.replica_prefix(0, 2) + "addr",
                      keys.replica_prefix(1, 0) + "addr"]),
        [keys.replica_prefix(0, 1) + "addr"], {}, -1),
    row("the horizon never goes back",
        snap(n=2, info={0: rep(3), 1: rep(3)}, collected_below={3: 8}), _names((3, [6])), [], {3: 8}, 1),
]


@pytest.mark.parametrize("s,names,deleted,below,oldest", COLLECT)
def test_collect(s, names, deleted, below, oldest):
    c = dead.collect(RULES, s, names)
    assert sorted(c.delete) == sorted(deleted)
    assert dict(c.collected_below) == below and c.oldest_kept == oldest


DUE = [
    row("a round decided since, long enough after", 5, 1.0, 4, 0.5, True),
    row("no round decided since", 4, 1.0, 4, 0.5, False),
    row("too soon", 5, 0.6, 4, 0.5, False),
]


@pytest.mark.parametrize("top,now,at,when,due", DUE)
def test_collect_due(top, now, at, when, due):
    assert dead.collect_due(top, now, at, when) == due


# ------------------------------------------------------------------ the replicas' views: waits, status
WAITS = [
    # (snapshot, waited since before, now) -> waited since after
    row("a member still stepping while another votes in its round is waited for",
        snap(members={0: 0, 1: 0}, info={0: rep(2, rnd=5), 1: rep(2, rnd=5, phase="step")}, info_seen=seen(0, 1)),
        {}, 10.0, {1: 10.0}),
    row("the wait goes on from when it began",
        snap(members={0: 0, 1: 0}, info={0: rep(2, rnd=5), 1: rep(2, rnd=5, phase="step")}, info_seen=seen(0, 1)),
        {1: 7.0}, 10.0, {1: 7.0}),
    row("a member ahead of the voters is not waited for",
        snap(members={0: 0, 1: 0}, info={0: rep(2, rnd=5), 1: rep(2, rnd=6, phase="step")}, info_seen=seen(0, 1)),
        {1: 7.0}, 10.0, {}),
    row("a stale voter makes nobody look waited for",
        snap(members={0: 0, 1: 0}, info={0: rep(2, rnd=5), 1: rep(2, rnd=5, phase="step")},
             info_seen={0: 5.0, 1: 10.0}), {1: 7.0}, 10.0, {}),
    row("a member that is done is not waited for",
        snap(members={0: 0, 1: 0}, info={0: rep(2, rnd=5), 1: rep(2, rnd=5, phase="done")}, info_seen=seen(0, 1)),
        {}, 10.0, {}),
]


@pytest.mark.parametrize("s,before,now,after", WAITS)
def test_waits(s, before, now, after):
    assert core.waits(s, before, now) == after


def test_status_figures():
    s = snap(quorum_id=4, members={0: 1, 1: 0}, healed={(0, 1)}, alive={0: 1, 1: 0, 2: None},
             info={0: rep(4, inc=1, step=30, discarded=2, healing=False),
                   1: rep(4, step=31, discarded=1, healing=True, phase="heal"), 2: rep(3, step=12, discarded=5)})
    assert core.run_status(s) == {"quorum_id": 4, "quorum_size": 2, "steps_committed": 31, "steps_discarded": 5}
    assert core.global_step(s) == 31
    assert core.replica_status(s, 0) == {"in_quorum": True, "healing": False, "last_heal_s": None, "ft_phase": "vote"}
    assert core.replica_status(s, 1) == {"in_quorum": False, "healing": True, "last_heal_s": None, "ft_phase": "heal"}
    assert core.replica_status(s, 2)["in_quorum"] is False and core.replica_status(s, 2)["ft_phase"] is None


def test_a_spare_that_exited_is_neither_held_back_nor_promoted():
    """With --spares: a held replica is a spare, a member is not, and one whose incarnation exited
    is neither (None): read as not held, the books booked a promoted spare's heal for an idle
    spare's exit 0 at the run's end (stop 62's fresh-clone run)."""
    s = snap(quorum_id=2, members={0: 0, 1: 0}, spares=1, held={2: 0, 3: 1}, alive={0: 0, 1: 0, 2: 0, 3: None})
    assert [core.replica_status(s, r)["spare"] for r in range(4)] == [False, False, True, None]


PACE = [
    # notes (time, global step) -> seconds per step
    row("not enough steps", [(0.0, 1), (1.0, 2)], None),
    row("steady", [(0.0, 1), (1.0, 11)], 0.1),
    row("a fresh start forgets the old pace", [(0.0, 50), (1.0, 60), (2.0, 1), (2.4, 5)], None),
    row("a resumed run's first report is no pace", [(0.0, 0), (1.0, 1000), (2.0, 1010)], 0.1),
    row("the window follows a slower run", [(0.0, 1), (1.0, 101), (40.0, 140), (50.0, 150)], 1.0),
]


@pytest.mark.parametrize("notes,step_s", PACE)
def test_pace(notes, step_s):
    pace = core.Pace()
    for t, step in notes:
        pace.note(t, step)
    assert pace.step_s() == pytest.approx(step_s) if step_s is not None else pace.step_s() is None


def test_the_core_has_no_io():
    """The keeper's core imports nothing that reaches a store, a clock, a thread or a log: what
    it decides is a function of its arguments alone (the shell, ftrun.supervisor.ft.quorum, does IO)."""
    import ast
    from pathlib import Path

    # functools: a memo of a pure function (dead.py's parse of key names), no IO.
    # ftrun.wire: the members' report codecs (pure, torch-free, no IO).
    allowed = {"__future__", "collections", "dataclasses", "functools", "types", "typing", "ftrun",
               "ftrun.keys", "ftrun.votes", "ftrun.pacing", "ftrun.wire",
               "ftrun.supervisor.ft.keeper", "ftrun.supervisor.ft.keeper.core", "ftrun.supervisor.ft.keeper.dead"}
    folder = Path(core.__file__).parent
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) else [])
            assert set(names) <= allowed, f"{path.name} imports {names}"


def test_the_shells_snapshot_is_the_constructors():
    """The shell builds its snapshots without the frozen constructor (KeeperSnapshot.of): every field
    is given, and the snapshot is the one the constructor builds, frozen as well."""
    import dataclasses

    from ftrun.supervisor.ft.quorum import KeeperSettings, QuorumKeeper

    q = QuorumKeeper(None, [0, 1, 2], settings=KeeperSettings())
    s = q._snapshot(7, entered={0: 0})
    assert set(vars(s)) == {f.name for f in dataclasses.fields(KeeperSnapshot)}
    assert s == KeeperSnapshot(**vars(s)) and s.top == 7 and dict(s.entered) == {0: 0}
    assert dict(q._snapshot().survivors) == {}
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.top = 8


def test_a_moved_stores_first_quorum_counts_above_every_quorum_a_survivor_saw():
    """This keeper counts from its node's last read of the lost store, which may have published
    more since; a survivor that saw quorum 12 must not be given another quorum 12 (found by the
    simulator's store moves: a quorum id published twice)."""
    saw = SurvivorReport(inc=1, step=5, in_sync=True, decided=True, latest=12).encode()
    d = core.next_quorum(_moved(survivors={0: saw, 1: said(5)}), "first replicas joined", {})
    assert d.quorum.id == 13
    assert core.next_quorum(_moved(survivors={1: said(5)}), "first replicas joined", {}).quorum.id == 8


@pytest.mark.quick
@pytest.mark.parametrize("k, steps_first, one_step, dead, sub_steps, gives_up", [
    (1, True, False, A, True, True),
    (2, False, True, F, False, False),
    (4, False, True, F, False, False),
])
def test_the_voting_of_whole_and_sharded_replicas_differs_in_one_place(k, steps_first, one_step, dead, sub_steps,
                                                                        gives_up):
    """votes.Voting: whole replicas step before the decision (a dead member abstains), sharded ones
    wait for it and vote every step (a dead member fails the round); the member's driver, its core
    and the keeper read these rules there."""
    v = votes.Voting(k)
    assert (v.steps_first, v.one_step_rounds, v.dead_vote, v.sub_steps, v.gives_up_lost_rounds) == \
        (steps_first, one_step, dead, sub_steps, gives_up)
