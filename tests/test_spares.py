"""Hot spares (--ft --spares N) through the real CLI, with real SIGKILLs.

A spare is a replica the keeper holds out of its quorums: it runs the script up to its first
ft.steps() and waits there, never counted in ft.num_replicas(). When a training replica dies, the
quorum published without it lists a spare in its place; the replica that died restarts and is the
spare from then on. A spare still waiting at the end exits 0 without running the script's code
after its loop. Every replica that trained to the end ends bitwise identical.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from conftest import SCRIPTS, run_ftrun, start_ftrun
from ftrun.wire import MemberReport
from helpers import assert_bad, assert_identical, finish, read_state, replica, wait_state

TRAIN = SCRIPTS / "train_ft.py"
TINY = ["--dim", 8, "--hidden", 16, "--data", "step", "--print-every", 5]


def _kill(st: dict, rank: int) -> None:
    os.kill(replica(st, rank)["pid"], signal.SIGKILL)


def _replicas_seen(log_dir: Path, rank: int) -> set:
    """The ft.num_replicas() values a rank's loop printed ("step S loss L replicas N")."""
    text = (log_dir / f"rank{rank}" / "stdout.log").read_text()
    return {int(n) for n in re.findall(r"replicas (\d+)", text)}


def test_spares_take_failed_replicas_places_and_the_failed_ones_become_spares(ftrun_home, tmp_path):
    """3 training replicas and 1 spare, one run, four kills at different moments:
    - the spare (replica 3, status: spare) is killed: it restarts and waits as the spare again, and
      no quorum changes;
    - rank 1 is killed: the quorum published without it lists the spare in its place, and rank 1,
      restarted, is the spare;
    - ranks 0 and 2 are killed together (more failures than spares): the spare (rank 1) takes one
      place, the quorum trains on with 2 replicas until one of them is back, and the other waits
      as the spare.
    The training replicas are never more than 3 (ft.num_replicas() is never 4), the three that
    trained to the end are bitwise identical, and the spare at the end exits 0 without running
    the code after its loop (it saves nothing)."""
    out = tmp_path / "p"
    run_id = "spares"
    proc = start_ftrun(["--nproc", 4, "--ft", "--spares", 1, "--run-id", run_id, TRAIN, *TINY,
                        "--steps", 300, "--step-sleep", 0.03, "--out", out], files=("stderr",))
    try:
        st = wait_state(ftrun_home, run_id, lambda st: replica(st, 3).get("spare") and replica(st, 0)["step"] >= 5, 90,
                        "replica 3 waiting as the spare with the others training", proc)
        assert st["spares"] == 1 and st["quorum_size"] == 3, st
        assert [replica(st, r).get("spare") for r in range(4)] == [False, False, False, True], st["replicas"]
        table = run_ftrun(["status", run_id], timeout=30, env={"COLUMNS": "200"})
        assert re.search(r"quorum \d+: 3 replicas and 1 spare;", table.stdout), table.stdout
        assert re.search(r"(?m)^\W*3\b.*\bspare\b", table.stdout), table.stdout  # rank 3's row says spare
        _kill(st, 3)
        st = wait_state(ftrun_home, run_id, lambda st: replica(st, 3)["restarts"] == 1 and replica(st, 3).get("spare"),
                        90, "rank 3 restarted as the spare again", proc)
        _kill(st, 1)
        st = wait_state(ftrun_home, run_id, lambda st: replica(st, 1)["restarts"] == 1 and replica(st, 1).get("spare")
                        and replica(st, 3).get("in_quorum"), 90, "rank 1 restarted as the spare and rank 3 training", proc)
        _kill(st, 0)
        _kill(st, 2)
        wait_state(ftrun_home, run_id, lambda st: all(replica(st, r)["restarts"] == 1 for r in (0, 2))
                   and st.get("spares") == 1 and st["quorum_size"] == 3,
                   90, "ranks 0 and 2 back, one training, one the spare", proc)
        rc, err = finish(proc, 180)
    finally:
        proc.kill()
    assert rc == 0, err[-3000:]
    lines = [line for line in err.splitlines() if re.match(r"ftrun: quorum \d+:", line)]
    assert lines[0] == "ftrun: quorum 1: 3 replicas (first replicas joined; 1 spare held back)", lines
    assert not any("rank 3 left" in line for line in lines), lines  # the spare's death changed no quorum
    assert any("(rank 1 left; spare replica 3 takes its place)" in line for line in lines), lines
    assert any(re.search(r"rank [02] left; spare replica 1 takes its place", line) for line in lines), lines
    assert not any(re.search(r"quorum \d+: [14] replicas", line) for line in lines), lines
    trained = [r for r in range(4) if Path(f"{out}.rank{r}.pt").exists()]
    assert len(trained) == 3 and 1 in trained and 3 in trained, trained
    spare = ({0, 2} - set(trained)).pop()
    assert f"rank {spare}: the run finished at step 300 while this replica was" in err, err[-3000:]
    assert assert_identical(out, trained)[1]["step"] == 300
    log_dir = Path(read_state(ftrun_home, run_id)["log_dir"])
    assert set().union(*(_replicas_seen(log_dir, r) for r in range(4))) <= {2, 3}


def test_a_spare_never_needed_exits_0_without_the_code_after_its_loop(ftrun_home, tmp_path):
    """No failure: the spare waits the whole run, then exits 0 with one line saying it was a spare,
    without running the script's code after its loop (it saves nothing); the others finish. The
    goodput books the spare's start-up and wait apart (spare_s, its lane drawn as spare, the
    summary's "less ... waiting as hot spares"), not in the replica-time of the 2 that trained."""
    import json

    out = tmp_path / "p"
    proc = run_ftrun(["--nproc", 3, "--ft", "--spares", 1, "--run-id", "idle-spare", TRAIN, *TINY, "--steps", 20,
                      "--out", out], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("rank 2: the run finished at step 20 while this replica was waiting to join as a hot spare; no peer is "
            "left to heal it") in proc.stderr, proc.stderr[-3000:]
    assert not Path(f"{out}.rank2.pt").exists()
    assert assert_identical(out, [0, 1])[1]["step"] == 20
    st = read_state(ftrun_home, "idle-spare")
    timeline = json.loads((ftrun_home / "idle-spare" / "timeline.json").read_text())
    wall = st["ended"] - st["started"]
    # The spare's lane from its start to its exit: all of it a spare's (its tail to the run's end is the end's).
    assert 0.5 * wall < st["spare_s"] <= wall + 0.01, (st["spare_s"], wall)
    assert st["replica_s"] == pytest.approx(3 * wall - st["spare_s"], abs=0.2), (st["replica_s"], wall)
    spare_lane = next(lane for lane in timeline["lanes"] if lane["replica"] == 2)
    assert {seg[2] for seg in spare_lane["segments"]} <= {"spare", "done"}, spare_lane
    assert timeline["spare_s"] == pytest.approx(st["spare_s"], abs=0.01)
    table = run_ftrun(["status", "idle-spare"], timeout=30, env={"COLUMNS": "200"}).stdout
    assert re.search(r"goodput [\d.]+%; lost: .*; hot spares waited [\d.]+s", table), table
    head = next(line for line in proc.stderr.splitlines() if "goodput " in line)
    assert re.search(r"\(3 replicas x [\d.]+ s, less [\d.]+ s waiting as hot spares\)", head), head
    browser = shutil.which("chromium")
    if browser:  # the report draws the spare's lane as a spare, and its wait in a row apart from the replica-time
        page = tmp_path / "page.html"
        assert run_ftrun(["report", "idle-spare", "-o", page], timeout=60).returncode == 0
        dom = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                              f"--user-data-dir={tmp_path / 'chrome'}", "--dump-dom", f"file://{page}"],
                             capture_output=True, text=True, timeout=90)
        html = dom.stdout
        assert 'data-drawn="1"' in html, dom.stderr[-2000:]
        lane = re.search(r'<g class="lane" data-replica="2".*?</g>', html, re.S).group(0)
        assert 'data-state="spare"' in lane and 'data-state="starting"' not in lane, lane
        assert re.findall(r'class="cause" data-cause="(\w+)"', html)[-1] == "spare"


def test_a_sharded_spare_replica_takes_a_failed_replicas_place(ftrun_home, tmp_path):
    """--replica-size 2 --spares 1 on 6 workers: replicas 0 and 1 train (FSDP2 over their 2 workers),
    replica 2 (ranks 4 and 5) waits whole as the spare. A worker of replica 0 is killed: replica 0
    leaves whole, replica 2 takes its place and receives its shards from replica 1 (a transfer held
    open by an injected delay), and a worker of replica 2 is killed mid-promotion, while it heals:
    replica 2 leaves whole too, replica 1 trains on alone, and the two restarted replicas come back,
    one to train and one as the spare, which at the end saves nothing. The two replicas that trained
    to the end hold the same shards, bitwise."""
    import torch

    out = tmp_path / "p"
    run_id = "sharded-spare"
    proc = start_ftrun(["--nproc", 6, "--ft", "--replica-size", 2, "--spares", 1, "--run-id", run_id,
                        SCRIPTS / "train_fsdp_ft.py", "--dim", 32, "--hidden", 64, "--blocks", 1, "--steps", 150,
                        "--out", out], env={"FTRUN_FT_INJECT_SEND_DELAY": "1.5"}, files=("stderr",))
    try:
        st = wait_state(ftrun_home, run_id,
                        lambda st: all(replica(st, r).get("spare") for r in (4, 5)) and replica(st, 0)["step"] >= 10,
                        90, "replica 2 waiting as the spare", proc)
        assert not any(replica(st, r).get("spare") for r in range(4)), st["replicas"]
        _kill(st, 1)
        st = wait_state(ftrun_home, run_id, lambda st: replica(st, 4).get("ft_phase") == "heal", 90,
                        "the spare healing as it takes replica 0's place", proc)
        _kill(st, 4)
        wait_state(ftrun_home, run_id,
                   lambda st: any(replica(st, r)["restarts"] == 1 and replica(st, r).get("in_quorum") for r in (0, 4)),
                   90, "a restarted replica training again", proc)
        rc, err = finish(proc, 180)
    finally:
        proc.kill()
    assert rc == 0, err[-3000:]
    assert "(replica 0 left (rank 1 of ranks 0-1); spare replica 2 takes its place)" in err, err[-3000:]
    assert "(replica 2 left (rank 4 of ranks 4-5)" in err, err[-3000:]
    assert "waitForInput" not in err, err[-3000:]  # torch's store-read warnings stay in the ranks' logs
    trained = [rep for rep in (0, 2) if Path(f"{out}.rank{2 * rep}.pt").exists()]
    assert len(trained) == 1, trained  # the other, the spare at the end, saved nothing
    for j in (0, 1):
        a, b = (torch.load(f"{out}.rank{r}.pt", weights_only=True) for r in (2 + j, 2 * trained[0] + j))
        for name, t in a["model"].items():
            assert torch.equal(t, b["model"][name]), f"shard {j}: parameter {name} differs"
        for idx, group in a["optim"].items():
            for name, t in group.items():
                assert torch.equal(t, b["optim"][idx][name]), f"shard {j}: optimizer state {idx}.{name} differs"


@pytest.mark.parametrize("args, needles", [
    (["--nproc", 4, "--spares", 1], ("--spares 1 applies only to --ft runs", "add --ft")),
    (["--nproc", 4, "--ft", "--spares", 4], ("--spares 4 leaves no training replica", "4 replicas",
                                             "--spares 3 or fewer")),
    (["--nproc", 4, "--ft", "--replica-size", 2, "--spares", 2], ("--spares 2 leaves no training replica",
                                                                  "2 replicas of 2 workers")),
    (["--nproc", 4, "--ft", "--spares", 1, "--min-replicas", 4], ("--min-replicas 4 exceeds the 3 training",)),
    (["--nproc", 4, "--ft", "--spares", -1], ("--spares", ">= 0")),
    (["--nproc", 4, "--ft", "--spares", "one"], ("--spares", "whole number")),
])
def test_bad_spares_are_one_line_and_nothing_starts(args, needles, tmp_path):
    assert_bad(run_ftrun([*args, tmp_path / "never.py"], timeout=30), *needles)


@pytest.mark.quick
def test_spares_from_a_recipe_and_pet_show_in_the_dry_run(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("nproc: 6\nft: true\nreplica_size: 2\nspares: 1\n")
    proc = run_ftrun(["--recipe", recipe, "--dry-run", TRAIN], timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert "2 training replicas and 1 hot spare (replica 2 at the start)" in proc.stdout, proc.stdout
    assert re.search(r"(?m)^\s+0\s+6\s+0-5\s+0-2\s+.*replica 2 starts as a spare$", proc.stdout), proc.stdout
    proc = run_ftrun(["--nproc", 4, "--ft", "--dry-run", TRAIN], timeout=30, env={"PET_SPARES": "2"})
    assert proc.returncode == 0, proc.stderr
    assert "2 training replicas and 2 hot spares (replicas 2-3 at the start)" in proc.stdout, proc.stdout
    proc = run_ftrun(["--nproc", 4, "--dry-run", TRAIN], timeout=30, env={"PET_SPARES": "1"})
    assert_bad(proc, "--spares 1 applies only to --ft runs")


# ------------------------------------------------------------------ the keeper's rules (pure, tables)
def _snap(n: int = 4, **kw):
    from ftrun.supervisor.ft.keeper.core import KeeperSnapshot

    kw.setdefault("ranks", list(range(n)))
    kw.setdefault("alive", {r: 0 for r in range(n)})
    kw.setdefault("spares", 1)
    return KeeperSnapshot(**kw)


ALL = {0: 0, 1: 0, 2: 0, 3: 0}
ADMIT = [
    pytest.param(_snap(), ALL, {0: 0, 1: 0, 2: 0}, {3: 0}, "first replicas joined; 1 spare held back",
                 id="the first quorum holds back the highest replica"),
    pytest.param(_snap(), {3: 0, 1: 0}, {1: 0, 3: 0}, {}, None,
                 id="the first quorum waits for the lowest replicas, whatever asked first"),
    pytest.param(_snap(members={0: 0, 2: 0, 3: 0}, quorum_id=4, alive={0: 0, 1: 1, 2: 0, 3: 0}), {1: 1},
                 {}, {1: 1}, None, id="a restarted replica with the training replicas whole is the spare"),
    pytest.param(_snap(members={0: 0, 2: 0}, quorum_id=4, alive={0: 0, 1: 1, 2: 0, 3: 1}), {1: 1, 3: 1},
                 {1: 1}, {3: 1}, "rank 1 joined; 1 spare held back", id="one of two restarted trains, one waits"),
    pytest.param(_snap(n=8, k=2, spares=1, members={0: 0, 1: 0, 2: 0, 3: 0}, quorum_id=2,
                       alive={r: 0 for r in range(8)}), {4: 0, 5: 0, 6: 0, 7: 0}, {4: 0, 5: 0}, {6: 0, 7: 0},
                 "ranks 4, 5 joined; 1 spare held back", id="a spare of --replica-size 2 is a whole replica"),
    pytest.param(_snap(ranks=[2, 3], alive={2: 0, 3: 0}, spares=2, moved=True, awaited={2}, quorum_id=5),
                 {2: 0, 3: 0}, {2: 0}, {3: 0}, "rank 2 joined; 1 spare held back",
                 id="a moved store's keeper with fewer replicas than the spares plus one still trains one"),
    pytest.param(_snap(ranks=[1, 2, 3], alive={1: 0, 2: 0, 3: 0}, moved=True, awaited={2, 3}, quorum_id=5),
                 {1: 0, 2: 0, 3: 0}, {2: 0, 3: 0}, {1: 0}, "ranks 2, 3 joined; 1 spare held back",
                 id="on a moved store the last quorum's members train, a former spare waits"),
    pytest.param(_snap(spares=0, members={0: 0, 2: 0, 3: 0}, quorum_id=4, alive={0: 0, 1: 1, 2: 0, 3: 0}),
                 {1: 1}, {1: 1}, {}, "rank 1 joined", id="without spares every joiner is admitted"),
]


@pytest.mark.parametrize("s, joins, pending, held, publish", ADMIT)
def test_the_keeper_holds_back_spares(s, joins, pending, held, publish):
    from ftrun.supervisor.ft.keeper import core

    a = core.admit(s, joins, 1.0)
    assert (dict(a.pending), dict(a.held), a.publish) == (pending, held, publish)


EXITS = [
    pytest.param(_snap(members={0: 0, 1: 0, 2: 0}, held={3: 0}), 1, {3: 0},
                 "rank 1 left; spare replica 3 takes its place",
                 id="the spare takes the dead replica's place"),
    pytest.param(_snap(members={0: 0, 1: 0, 2: 0}, held={3: 0}, alive={0: 0, 1: 0, 2: 0, 3: None}), 1, {},
                 "rank 1 left", id="a spare that died meanwhile is not promoted"),
    pytest.param(_snap(members={0: 0, 1: 0, 2: 0}, held={}), 1, {}, "rank 1 left", id="no spare left"),
    pytest.param(_snap(n=8, k=2, members={r: 0 for r in range(6)}, held={6: 0, 7: 0}, alive={r: 0 for r in range(8)}),
                 3, {6: 0, 7: 0}, "replica 1 left (rank 3 of ranks 2-3); spare replica 3 takes its place",
                 id="a sharded spare replaces a whole replica"),
]


@pytest.mark.parametrize("s, rank, promote, publish", EXITS)
def test_a_training_replicas_death_promotes_a_spare(s, rank, promote, publish):
    from ftrun.supervisor.ft.keeper import core

    d = core.exit_plan(s, rank, 0, False)
    assert (dict(d.promote), d.publish) == (promote, publish)


def test_a_spares_death_changes_no_quorum():
    from ftrun.supervisor.ft.keeper import core

    d = core.exit_plan(_snap(members={0: 0, 1: 0, 2: 0}, held={3: 0}), 3, 0, False)
    assert (d.publish, dict(d.leaving), dict(d.promote)) == (None, {}, {})


FOLLOWED = [
    pytest.param(_snap(members={0: 0, 1: 0, 2: 0}, quorum_id=1, info={3: MemberReport(inc=0, phase="join")}), {3: 0},
                 id="a replica waiting to join beside a whole quorum is the spare"),
    pytest.param(_snap(members={0: 0, 2: 0, 3: 0}, quorum_id=3,
                       info={1: MemberReport(inc=1, phase="join"), 3: MemberReport(inc=0, phase="compute")}), {1: 1},
                 id="a restarted replica waiting beside a whole quorum is the spare"),
    pytest.param(_snap(members={0: 0, 2: 0}, quorum_id=3, info={1: MemberReport(inc=1, phase="join")}), {},
                 id="a joiner beside a quorum short of a replica is no spare"),
    pytest.param(_snap(spares=0, members={0: 0, 1: 0, 2: 0}, info={3: MemberReport(inc=0, phase="join")}), {},
                 id="without spares nobody is one"),
]


@pytest.mark.parametrize("s, held", FOLLOWED)
def test_a_follower_node_sees_the_leaders_spares(s, held):
    """Another node's keeper is not told whom the leader holds back: it reads the spares from the
    replicas' reports, so that node's `ftrun status` says spare (not out) and its goodput books them apart."""
    from ftrun.supervisor.ft.keeper import core, spares

    assert spares.followed(s) == held
    alive = {r: s.report(r).inc or 0 for r in range(4)}
    s = _snap(**{f: getattr(s, f) for f in ("members", "quorum_id", "info", "spares")}, held=held, alive=alive)
    assert [core.replica_status(s, r).get("spare") for r in range(4)] == [r in held if s.spares else None
                                                                          for r in range(4)]
