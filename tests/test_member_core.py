"""The member's decisions without IO (ftrun/worker/ft/member/core.py): events in, commands out,
in-process and in milliseconds. The worker's manager and the simulator's member both drive this
core; these tests pin the rules they share (the simulator and the --ft tests through the real
CLI show the rules at work under faults)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ftrun.wire import Quorum
from ftrun.worker.ft.member.core import (AskEntryRound, Backoff, ClosedOk, CollectiveFailed, Computing, Decided,
                                         Entered, Entering, Finish, FinishedRead, InSync, Join, Joined, MemberCore,
                                         ReadFinished, Received, Rejoin, Restart, RoundTop, Skipped, StoreLost, Switch,
                                         TakeStep, Voted, source_refuses, transfer_ends)

pytestmark = pytest.mark.quick
ROOT = Path(__file__).resolve().parents[1]


def _quorum(eid: int, members, healers=(), fresh=False, sources=()) -> Quorum:
    return Quorum(id=eid, members=tuple(tuple(m) for m in members), healers=tuple(healers), fresh=fresh,
                  sources=tuple(sources))


def _in_quorum(eid: int = 3, rnd: int = 10) -> MemberCore:
    core = MemberCore()
    core.handle(InSync())
    quorum = _quorum(eid, [(0, 0), (1, 0), (2, 0)])
    assert core.handle(Entering(quorum, (1, 0), joining=True)) == []
    core.handle(Entered(quorum, rnd))
    return core


def test_a_member_with_no_quorum_joins_and_enters_where_it_was_given():
    core = MemberCore()
    assert core.handle(RoundTop()) == [Join()]
    assert core.handle(Joined(quorum=4, round=17)) == [Switch(4, joining=True)]
    assert core.round == 17


def test_a_commit_naming_a_newer_quorum_switches_at_the_round_after_next():
    """Members read a commit at different moments of the next round: the round after it is the
    first boundary all of them reach knowing it."""
    core = _in_quorum(3, 10)
    core.handle(ClosedOk())                  # stepped round 10, its vote in flight
    assert core.round == 11
    assert core.handle(Decided(10, True, 5)) == []
    assert core.handle(RoundTop()) == []     # round 11: not yet
    core.handle(ClosedOk())
    assert core.handle(RoundTop()) == [Switch(5)]  # round 12


def test_a_member_that_stepped_past_a_round_voted_down_restarts():
    core = _in_quorum()
    core.handle(ClosedOk())
    out = core.handle(Decided(10, False, 3))
    assert len(out) == 1 and isinstance(out[0], Restart) and "voted down" in out[0].why


@pytest.mark.parametrize("event, why", [
    (Decided(10, False, 3), "round 10 was voted down after this member had stepped past it"),
    (Voted(ok=False, taken=2, commit=False, target=3, kept=1), "round 10 keeps its first 1 steps while this member "
                                                               "had taken 2"),
])
@pytest.mark.parametrize("can_rejoin", [True, False])
def test_a_member_the_peers_decision_contradicts_rejoins_in_place_where_its_driver_can(event, why, can_rejoin):
    """A sound process whose steps went past what its peers decided takes the committed state
    again without leaving the process (Rejoin); a driver that cannot (a sharded replica, a node
    of several) restarts as before. The rejoin keeps the run's decision state untouched: the
    driver carries it out at the next round's top with a fresh core."""
    core = _in_quorum()
    core.can_rejoin = can_rejoin
    if isinstance(event, Decided):
        core.handle(ClosedOk())
    out = core.handle(event)
    assert out == [Rejoin(why) if can_rejoin else Restart(why)]


def test_a_member_whose_collectives_failed_in_a_committed_round_still_restarts():
    core = _in_quorum()
    core.can_rejoin = True
    out = core.handle(Voted(ok=False, taken=0, commit=True, target=3, kept=0))
    assert isinstance(out[0], Restart)


def test_a_failed_round_rebuilds_at_the_next_round_and_looks_for_the_runs_end():
    core = _in_quorum(3, 10)
    core.handle(CollectiveFailed())
    assert not core.round_ok
    out = core.handle(Voted(ok=False, taken=0, commit=False, target=3, kept=0))
    assert out == [ReadFinished()]
    assert core.round == 11 and core.round_ok and core.rebuild
    assert core.handle(RoundTop()) == [Switch(3)]  # the same quorum: a fresh group
    core.handle(Voted(ok=False, taken=0, commit=False, target=6, kept=0))
    assert core.handle(RoundTop()) == [Switch(6)]  # a newer quorum named by a failed round: at once


def test_mixed_outcomes_restart_the_member_the_decision_contradicts():
    core = _in_quorum()
    out = core.handle(Voted(ok=False, taken=0, commit=True, target=3, kept=0))
    assert isinstance(out[0], Restart) and "committed" in out[0].why
    core = _in_quorum()
    out = core.handle(Voted(ok=False, taken=2, commit=False, target=3, kept=1))
    assert isinstance(out[0], Restart) and "keeps its first 1 steps" in out[0].why


def test_a_sharded_replicas_commit_is_stepped_then_switches_at_the_next_round():
    core = _in_quorum(3, 10)
    assert core.handle(Voted(ok=True, taken=0, commit=True, target=4, kept=0)) == [TakeStep()]
    assert core.handle(RoundTop()) == [Switch(4)]


def test_failed_rounds_with_no_new_quorum_back_off_boundedly():
    core = _in_quorum(3, 10)
    waits = []
    for _ in range(12):
        out = core.handle(Voted(ok=False, taken=0, commit=False, target=3, kept=0))
        waits.append(sum(c.seconds for c in out if isinstance(c, Backoff)))
    assert waits[:3] == [0, 0, 0] and waits[3] > 0
    assert waits == sorted(waits) and max(waits) == pytest.approx(0.2)
    core.handle(ClosedOk())
    assert core.failed_in_row == 0


def test_entering_an_quorum_that_leaves_this_incarnation_out_restarts():
    core = _in_quorum()
    out = core.handle(Entering(_quorum(4, [(0, 0), (1, 1)]), (1, 0)))
    assert isinstance(out[0], Restart) and "left out of quorum 4" in out[0].why


def test_continuing_members_agree_on_the_entry_round_a_joiner_does_not():
    core = _in_quorum(3, 10)
    nxt = _quorum(4, [(0, 0), (1, 0)])
    assert core.handle(Entering(nxt, (1, 0))) == [AskEntryRound()]
    assert core.handle(Entering(_quorum(3, [(0, 0), (1, 0), (2, 0)]), (1, 0))) == []  # a rebuild
    core.handle(Entered(nxt, 14))
    assert (core.quorum.id, core.round, core.group_round, core.target_quorum, core.rebuild) == (4, 14, 14, None, False)


def test_the_runs_end_finishes_a_member_alone_only_when_it_is_not_in_sync():
    core = _in_quorum()
    assert core.handle(FinishedRead(None)) == []
    assert core.handle(FinishedRead(40)) == [Finish(40, alone=False)] and core.finished
    joiner = MemberCore()
    assert joiner.handle(Joined(finished=40)) == [Finish(40, alone=True)]


def test_a_member_not_in_sync_never_votes_ok():
    core = MemberCore()
    core.handle(Entered(_quorum(2, [(0, 0), (1, 1)], healers=[1]), 5))
    core.handle(Computing())
    assert not core.round_ok
    core.handle(Skipped())
    core.handle(InSync())
    core.handle(Computing())
    assert core.round_ok and core.round == 6


def test_a_lost_store_leaves_the_member_to_rejoin():
    core = _in_quorum()
    core.handle(Voted(ok=False, taken=0, commit=False, target=5, kept=0))
    core.handle(StoreLost())
    assert core.quorum is None and core.target_quorum is None and not core.rebuild
    assert core.handle(RoundTop()) == [Join()]


def test_a_heal_takes_the_quorums_source_of_its_shard():
    """The member reads the keeper's source (Quorum.source), never one of its own making: here
    the keeper named replica 2, not the lowest holder."""
    e = _quorum(5, [(0, 0), (1, 0), (2, 1), (3, 1), (4, 0), (5, 0)], healers=[2, 3], sources=[4, 5])
    assert transfer_ends(e, 2, k=2) == [4, 2]
    assert transfer_ends(e, 3, k=2) == [5, 3]
    assert transfer_ends(e, 1, k=2) == [5, 3]  # a bystander of shard 1: these are the ends it waits on
    fresh = _quorum(6, [(1, 0), (0, 2)], healers=[1], fresh=True, sources=[0])
    assert transfer_ends(fresh, 1) == [0, 1]
    with pytest.raises(ValueError):
        transfer_ends(_quorum(7, [(0, 0), (1, 0)], healers=[1]), 1)
    assert source_refuses(True, tainted=True) is not None
    assert source_refuses(False, tainted=True) is None


def test_a_fresh_quorums_sharded_source_never_sends_shards_of_two_steps():
    """Fresh: no replica holds the whole state. A worker of the source replica that holds its
    shard of it (its mate never healed) restarts with its replica instead of sending."""
    assert source_refuses(True, False, fresh=True, holds_state=True, k=1) is None  # whole replicas: its own state
    assert source_refuses(True, False, fresh=True, holds_state=False, k=2) is None  # initial shards, like its mates'
    assert source_refuses(True, False, fresh=False, holds_state=True, k=2) is None  # a holder heals the others
    out = source_refuses(True, False, fresh=True, holds_state=True, k=2)
    assert isinstance(out, Restart) and "starts again whole" in out.why


def test_the_core_does_no_io():
    """No torch, no store, no clock, no environment: what it needs comes in as events."""
    code = ("import sys; import ftrun.worker.ft.member.core as m; "
            "bad = [n for n in ('torch', 'socket', 'threading', 'time', 'os') if n in vars(m)]; "
            "assert 'torch' not in sys.modules and not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# ------------------------------------------------------------------ one member driver (issue 41)
MEMBER = ROOT / "ftrun" / "worker" / "ft" / "member"


def _sources(folder: Path):
    import ast

    for path in sorted(folder.glob("*.py")):
        text = path.read_text()
        yield path, text, ast.parse(text)


def test_the_member_has_no_mixins_and_each_field_one_writer():
    """The worker's Manager is a facade over the driver (no base classes); the driver's components
    (heal, layout, stop, moves) never write a field of the driver: each field of the member is
    written in one module."""
    import ast

    from ftrun.worker.ft.manager import Manager
    from ftrun.worker.ft.member.driver import MemberDriver

    assert Manager.__bases__ == (object,) and MemberDriver.__bases__ == (object,)
    found = []
    for path, _, tree in _sources(MEMBER):
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, (ast.Assign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                targets = [t for tt in targets for t in (tt.elts if isinstance(tt, ast.Tuple) else [tt])]
            for t in targets:
                # d.X = ... or self.d.X = ...: a component writing the driver's field
                owner = t.value if isinstance(t, ast.Attribute) else None
                if isinstance(owner, ast.Name) and owner.id == "d" or (
                        isinstance(owner, ast.Attribute) and owner.attr in ("d", "member", "core")
                        and path.name != "driver.py"):
                    found.append(f"{path.name}:{node.lineno} writes {ast.unparse(t)}")
    manager = ROOT / "ftrun" / "worker" / "ft" / "manager.py"
    for node in ast.walk(ast.parse(manager.read_text())):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Attribute) and t.value.attr == "member":
                    found.append(f"manager.py:{node.lineno} writes {ast.unparse(t)}")
    assert not found, found


def test_the_rules_the_driver_asks():
    from ftrun.worker.ft.member import core

    assert core.votes_ok(True, True, True) and not core.votes_ok(True, False, True)
    assert not core.votes_ok(False, True, True) and not core.votes_ok(True, True, False)
    assert core.save_is_due(10, None, 5) and core.save_is_due(7, 7, 5) and not core.save_is_due(0, None, 5)
    assert not core.save_is_due(6, 9, 5)
    assert core.round_length(4, 1, False, 0, None, None) == 4
    assert core.round_length(4, 1, False, 8, 10, None) == 2  # the loop's end
    assert core.round_length(4, 1, False, 3, None, 5) == 2  # a checkpoint at step 5 needs it decided
    assert core.round_length(4, 2, False, 0, None, None) == 1  # sharded replicas: one step
    assert core.round_length(4, 1, True, 0, None, None) == 1  # a layout round
    assert core.round_length(8, 1, False, 7, None, None, 10) == 3  # the guard checks at step 10's top
    assert core.round_length(8, 1, False, 10, None, None, 10) == 8
    assert core.settles_first(True, False, True, 0, None) and not core.settles_first(False, True, True, 9, 9)
    assert core.settles_first(True, False, False, 9, 9) and not core.settles_first(True, False, False, 3, 9)
    assert core.holds_state(True, 2, 2) and not core.holds_state(True, 1, 2) and not core.holds_state(False, 2, 2)
    assert core.gives_up(5, 4, lambda: None) == "quorum 5 is out"
    assert core.gives_up(4, 4, lambda: "ranks [1] of quorum 4 are gone") == "ranks [1] of quorum 4 are gone"
    assert core.gives_up(4, 4, lambda: None) is None
    assert core.resumes_checkpoint(True, True, False, True, False)
    assert not core.resumes_checkpoint(True, True, False, True, True)  # once per incarnation
    assert not core.resumes_checkpoint(True, False, False, True, False)  # not a fresh quorum
    assert core.loop_ends(True, 0, 10) and core.loop_ends(False, 10, 10) and not core.loop_ends(False, 3, None)


def test_the_newest_quorum_seen_never_goes_back():
    """A rejoin in place reads the newest quorum while the watcher runs: a read older than what the
    watcher saw meanwhile must not take it back (the soak's stalls from seed 7: the member then
    closed rounds naming the older quorum for ever)."""
    from ftrun.worker.ft.member.watch import QuorumWatch

    watch = QuorumWatch(driver=None)
    watch.seen(4)
    assert watch.latest == 4
    watch.latest = 5  # the watcher's thread read quorum 5
    watch.seen(4)  # the join's read, from before it
    assert watch.latest == 5
    watch.seen(7)  # a store's move: the new store counts on above every quorum seen
    assert watch.latest == 7


def test_a_member_out_of_sync_gets_no_step_and_a_step_past_a_round_voted_down_is_a_redo():
    """Issue 41's flaky nanoGPT port: a restarted replica whose heal did not land was handed step
    0 on its initial state (its evaluation printed a second time), and a step handed out before
    the decision of the round under it, which was then voted down, was handed out again without
    ft.redo() (step 20's evaluation printed twice). The simulator's replays show the driver
    (tests/test_simulate.py); these are the rules it asks."""
    from ftrun.worker.ft.member import core

    assert core.sits_out(in_sync=False) and not core.sits_out(in_sync=True)
    assert core.sits_out(in_sync=True, healing=True)  # named a healer, its heal not landed
    assert core.redo(handed_before=True, retaking=False)   # the round that took it was discarded
    assert core.redo(handed_before=False, retaking=True)   # the round under it was voted down
    assert not core.redo(handed_before=False, retaking=False)


def test_a_healer_whose_heal_failed_trains_nothing_until_a_heal_lands():
    """Found by the simulator (--moves): after the store moved, a survivor that had stepped past a
    round whose decision went with the lost store is named a healer of the moved store's quorum
    and its transfer fails. It is in sync by its own books, but the keeper's rules said its state
    is not the run's: it sits out every round (no step for the script, no ok vote) until a heal
    lands, and a quorum that does not name it a healer (its source) takes it back as it is."""
    from ftrun.worker.ft.member import core as rules

    core = MemberCore()
    core.handle(InSync())  # what it held when the store moved
    healed = _quorum(7, [(2, 0), (3, 1), (4, 0)], healers=(2, 4), sources=(3,))
    assert core.handle(Entering(healed, (2, 0))) == [AskEntryRound()]
    core.handle(Entered(healed, 15))
    assert core.in_sync and core.healing  # its transfer failed: nothing landed
    assert rules.sits_out(core.in_sync, core.healing)
    core.handle(Computing())
    assert not rules.votes_ok(core.round_ok, core.in_sync, True)
    core.handle(Voted(False, 0, False, 7, 0))
    assert core.handle(Entering(healed, (2, 0))) == []  # the rebuild heals again
    core.handle(Received(15))
    assert not core.healing and not rules.sits_out(core.in_sync, core.healing)
    core.handle(Computing())
    assert rules.votes_ok(core.round_ok, core.in_sync, True)

    named_source = MemberCore()
    named_source.handle(InSync())
    named_source.handle(Entering(healed, (2, 0)))
    named_source.handle(Entered(healed, 15))
    nxt = _quorum(8, [(2, 0), (4, 0)], healers=(4,), sources=(2,))
    named_source.handle(Entering(nxt, (2, 0)))
    assert not named_source.healing


def test_the_guards_rules():
    """When the guard checks (the same top on every member) and what its fingerprints say."""
    from ftrun.worker.ft.member import core

    assert core.check_due(120, 20, 10, False, 7, 3)  # a multiple of the quorum's check_steps
    assert not core.check_due(120, 21, 10, False, 7, 3)
    assert core.check_due(120, 21, 0, True, 4, 3)  # the round after a quorum with healers began
    assert not core.check_due(120, 21, 0, True, 5, 3) and not core.check_due(120, 21, 0, False, 4, 3)
    assert not core.check_due(0, 20, 10, True, 4, 3)  # the guard off
    assert not core.check_due(120, 0, 10, True, 1, 0)  # nothing trained yet
    a, b = (3, 1, 2), (3, 1, 5)
    assert core.verdict([(0, a), (1, a), (2, a)]) == ("agree", ())
    assert core.verdict([(0, a), (1, b), (2, a)]) == ("heal", (1,))
    assert core.verdict([(0, b), (1, a), (2, a), (3, b), (4, a)]) == ("heal", (0, 3))
    assert core.verdict([(0, a), (1, b)]) == ("split", ())
    assert core.verdict([(0, a), (1, b), (2, (9, 9, 9))]) == ("split", ())
    assert core.verdict([(0, a), (1, a), (2, b), (3, b)]) == ("split", ())


def test_the_guards_verdict_as_the_member_takes_it():
    """The minority sits the round out and takes the state again; the majority sits it out; with no
    majority the run ends; a member found different again before any agreeing check ends it too."""
    from ftrun.worker.ft.member.core import Compared, EndRun, MemberCore, Rejoin, Restart, SitOut

    a, b = (3, 1, 2), (3, 1, 5)
    odd = MemberCore(can_rejoin=True)
    out = odd.handle(Compared(1, ((0, a), (1, b), (2, a)), 20, ((1, "1 of 9 entries differ: w"),)))
    assert [type(c) for c in out] == [SitOut, Rejoin] and "(1 of 9 entries differ: w)" in out[1].why
    assert [type(c) for c in MemberCore().handle(Compared(1, ((0, a), (1, b), (2, a)), 20))] == [SitOut, Restart]
    peer = MemberCore()
    assert [type(c) for c in peer.handle(Compared(0, ((0, a), (1, b), (2, a)), 20))] == [SitOut]
    again = peer.handle(Compared(0, ((0, a), (1, b), (2, a)), 30))
    assert [type(c) for c in again] == [EndRun] and "again after a heal" in again[0].why
    healed = MemberCore()
    healed.handle(Compared(0, ((0, a), (1, b), (2, a)), 20))
    assert healed.handle(Compared(0, ((0, a), (1, a), (2, a)), 30)) == []  # cured: forgiven
    assert [type(c) for c in healed.handle(Compared(0, ((0, a), (1, b), (2, a)), 90))] == [SitOut]
    split = MemberCore().handle(Compared(0, ((0, a), (1, b)), 20, ((1, "w"),)))
    assert [type(c) for c in split] == [EndRun] and "no majority" in split[0].why and "rank 1: w" in split[0].why


@pytest.mark.parametrize("followed, same, kept", [
    (True, True, True),     # every healer a fed spare, bit for bit the source's: only the rest moves
    (True, False, False),   # a feed wrote another state: the whole state moves
    (False, True, False),   # a healer not fed (a fresh joiner beside the spare): the whole state
    (False, False, False),
])
def test_a_heal_keeps_a_fed_spares_state_only_with_the_sources_fingerprints(followed, same, kept):
    from ftrun.worker.ft.member.core import FedCompared, MoveState, keeps_fed_state

    assert keeps_fed_state(followed, same) is kept
    assert MemberCore().handle(FedCompared(followed, same)) == [MoveState(kept)]
