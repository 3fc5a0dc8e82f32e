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
import signal
import time
from pathlib import Path

import pytest

from conftest import SCRIPTS, run_ftrun
from helpers import assert_bad, finish, read_state, start_logged

TRAIN = SCRIPTS / "train_ft.py"
TINY = ["--dim", 8, "--hidden", 16, "--data", "step", "--print-every", 5]


def _wait(home: Path, run_id: str, proc, what: str, pred, timeout: float = 90.0) -> dict:
    """Wait until pred(state file) holds; the state when it did."""
    deadline = time.time() + timeout
    st = None
    while time.time() < deadline:
        st = read_state(home, run_id)
        if st:
            if st.get("phase") == "ended":
                raise AssertionError(f"the run ended while waiting for {what}: {st.get('exit_summary')}\n"
                                     f"{Path(proc.err_path).read_text()[-3000:]}")
            if pred(st):
                return st
        time.sleep(0.05)
    raise AssertionError(f"never {what}; last state: {st}\n{Path(proc.err_path).read_text()[-3000:]}")


def _replica(st: dict, rank: int) -> dict:
    return next(r for r in st["replicas"] if r["rank"] == rank)


def _kill(st: dict, rank: int) -> None:
    os.kill(_replica(st, rank)["pid"], signal.SIGKILL)


def _identical(out: Path, ranks) -> int:
    """The ranks that wrote OUT.rankR.* ended with the same parameters, optimizer state and step; the step."""
    import torch

    params = {r: torch.load(f"{out}.rank{r}.pt", weights_only=True) for r in ranks}
    opts = {r: torch.load(f"{out}.rank{r}.opt.pt", weights_only=True) for r in ranks}
    first = ranks[0]
    for r in ranks[1:]:
        for k in params[first]:
            assert torch.equal(params[first][k], params[r][k]), f"rank {r} parameter {k} differs"
        for idx, st in opts[first]["state"].items():
            for name, value in st.items():
                other = opts[r]["state"][idx][name]
                assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other, (r, idx, name)
    steps = {Path(f"{out}.rank{r}.json").read_text().split('"step": ')[1].split(",")[0] for r in ranks}
    assert len(steps) == 1, steps
    return int(steps.pop())


def _replicas_seen(log_dir: Path, rank: int) -> set:
    """The ft.num_replicas() values a rank's loop printed ("step S loss L replicas N")."""
    text = (log_dir / f"rank{rank}" / "stdout.log").read_text()
    return {int(n) for n in re.findall(r"replicas (\d+)", text)}


def test_a_spare_takes_each_failed_replicas_place_and_the_failed_one_becomes_the_spare(ftrun_home, tmp_path):
    """3 training replicas and 1 spare, two kills at different moments. The spare (replica 3) waits
    out of the quorum (status: spare), takes rank 1's place in the quorum published without it, and
    rank 1, restarted, becomes the spare; it then takes rank 0's place the same way. The training
    replicas are 3 throughout (ft.num_replicas() is never 4), the three that trained to the end are
    bitwise identical, and rank 0, the spare at the end, exits 0 without running the code after its
    loop (it saved nothing)."""
    out = tmp_path / "p"
    run_id = "spares"
    proc = start_logged(["--nproc", 4, "--ft", "--spares", 1, "--run-id", run_id, "--max-restarts", 3, TRAIN, *TINY,
                         "--steps", 160, "--step-sleep", 0.03, "--out", out])
    try:
        st = _wait(ftrun_home, run_id, proc, "replica 3 waiting as the spare with the others training",
                   lambda st: _replica(st, 3).get("spare") and _replica(st, 0)["step"] >= 10)
        assert st["spares"] == 1 and st["quorum_size"] == 3, st
        assert [_replica(st, r).get("spare") for r in range(4)] == [False, False, False, True], st["replicas"]
        _kill(st, 1)
        st = _wait(ftrun_home, run_id, proc, "rank 1 restarted as the spare and rank 3 training",
                   lambda st: _replica(st, 1)["restarts"] == 1 and _replica(st, 1).get("spare")
                   and _replica(st, 3).get("in_quorum"))
        _kill(st, 0)
        _wait(ftrun_home, run_id, proc, "rank 0 restarted as the spare",
              lambda st: _replica(st, 0)["restarts"] == 1 and _replica(st, 0).get("spare")
              and _replica(st, 1).get("in_quorum"))
        rc, err = finish(proc, 180)
    finally:
        proc.kill()
    assert rc == 0, err[-3000:]
    assert "quorum 1: 3 replicas (first replicas joined; 1 spare held back)" in err, err[-3000:]
    assert "(rank 1 left; spare replica 3 takes its place)" in err, err[-3000:]
    assert "(rank 0 left; spare replica 1 takes its place)" in err, err[-3000:]
    assert not re.search(r"quorum \d+: [124] replicas", err), err[-3000:]
    assert "rank 0: the run finished at step 160 while this replica was" in err, err[-3000:]
    assert not Path(f"{out}.rank0.pt").exists()  # the spare never ran the code after the loop
    assert _identical(out, [1, 2, 3]) == 160
    log_dir = Path(read_state(ftrun_home, run_id)["log_dir"])
    assert set().union(*(_replicas_seen(log_dir, r) for r in range(4))) == {3}


def test_a_killed_spare_is_only_restarted_and_more_failures_than_spares_still_finish(ftrun_home, tmp_path):
    """The spare itself is killed: it restarts and waits as the spare again, and no quorum changes.
    Then two training replicas die together with one spare: the spare takes one place, the quorum
    trains on with 2 replicas until the restarted ones are back, one of which trains again while
    the other becomes the spare. The three that trained to the end are bitwise identical."""
    out = tmp_path / "p"
    run_id = "spares2"
    proc = start_logged(["--nproc", 4, "--ft", "--spares", 1, "--run-id", run_id, TRAIN, *TINY,
                         "--steps", 160, "--step-sleep", 0.03, "--out", out])
    try:
        st = _wait(ftrun_home, run_id, proc, "replica 3 waiting as the spare",
                   lambda st: _replica(st, 3).get("spare") and _replica(st, 0)["step"] >= 5)
        quorum = st["quorum_id"]
        _kill(st, 3)
        st = _wait(ftrun_home, run_id, proc, "rank 3 restarted as the spare again",
                   lambda st: _replica(st, 3)["restarts"] == 1 and _replica(st, 3).get("spare"))
        assert st["quorum_size"] == 3, st
        _kill(st, 0)
        _kill(st, 1)
        _wait(ftrun_home, run_id, proc, "ranks 0 and 1 back, one training, one the spare",
              lambda st: all(_replica(st, r)["restarts"] == 1 for r in (0, 1)) and st.get("spares") == 1
              and st["quorum_size"] == 3)
        rc, err = finish(proc, 180)
    finally:
        proc.kill()
    assert rc == 0, err[-3000:]
    lines = [line for line in err.splitlines() if re.match(r"ftrun: quorum \d+:", line)]
    assert not any(f"quorum {q}:" in line for line in lines for q in range(quorum + 1, quorum + 2)
                   if "rank 3" in line), lines  # the spare's death changed no quorum
    assert "spare replica 3 takes its place" in err, lines
    assert "quorum" in err and re.search(r"quorum \d+: 2 replicas", err), lines
    assert not re.search(r"quorum \d+: [14] replicas", err), lines
    trained = [r for r in range(4) if Path(f"{out}.rank{r}.pt").exists()]
    assert len(trained) == 3, trained
    assert _identical(out, trained) == 160


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
    pytest.param(_snap(spares=0, members={0: 0, 2: 0, 3: 0}, quorum_id=4, alive={0: 0, 1: 1, 2: 0, 3: 0}),
                 {1: 1}, {1: 1}, {}, "rank 1 joined", id="without spares every joiner is admitted"),
]


@pytest.mark.parametrize("s, joins, pending, held, publish", ADMIT)
def test_the_keeper_holds_back_spares(s, joins, pending, held, publish):
    from ftrun.supervisor.ft.keeper import core

    a = core.admit(s, joins, 1.0)
    assert (dict(a.pending), dict(a.held), a.publish) == (pending, held, publish)


EXITS = [
    pytest.param(_snap(members={0: 0, 1: 0, 2: 0}, held={3: 0}), 1, {3: 0}, "rank 1 left; spare replica 3 takes its place",
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
