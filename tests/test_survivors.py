"""Survivors of another replica's failure under --ft, through the real CLI: a member that stepped
past a round its peers then voted down takes the committed state from a peer in place, as its
next incarnation, without leaving its process.
"""

from __future__ import annotations

import re

import pytest

from conftest import SCRIPTS, start_ftrun
from helpers import assert_identical, finish, rank_log, read_state

TRAIN = SCRIPTS / "train_ft.py"


@pytest.mark.parametrize("round_steps", ["8", "1"])
def test_a_survivor_the_peers_decision_contradicts_takes_the_committed_state_in_place(ftrun_home, tmp_path,
                                                                                    round_steps):
    """Rank 1 votes step 12 down after every collective of it went through (FTRUN_FT_INJECT_FAIL):
    ranks 0 and 2 had stepped past it. They used to exit 75 and be restarted (with
    --max-restarts 0 that once spent the budget and dropped both). A survivor's process is sound:
    it becomes its next incarnation in place, heals from rank 1 into its own model and optimizer,
    and goes on from the committed step, in the same process (one incarnation banner in its log,
    no restart, no exit 75); all three replicas finish identical. Rounds of several steps: the
    survivors learn it from the failed member's vote ("keeps its first k steps"); rounds of one:
    from the decision of the round they stepped past ("voted down after ...")."""
    out = tmp_path / "p"
    run_id = f"peers{round_steps}"
    proc = start_ftrun(["--nproc", 3, "--ft", "--max-restarts", 0, "--run-id", run_id, TRAIN, "--steps", 60,
                        "--step-sleep", 0.05, "--out", out],
                       env={"FTRUN_FT_INJECT_FAIL": "1:12", "FTRUN_FT_ROUND_STEPS": round_steps}, files=("stderr",))
    try:
        rc, err = finish(proc, 240)
    finally:
        proc.kill()
    assert rc == 0, err[-3000:]
    assert "exited with code 75" not in err and "restarted to take the committed state" not in err, err[-3000:]
    rejoined = 0
    for r in (0, 2):
        log = rank_log(ftrun_home, run_id, r)
        assert len(re.findall(rf"===== ftrun: rank {r}, incarnation", log)) == 1, log[-2000:]  # one process
        assert "restarting to take the committed state" not in log, log[-2000:]
        rejoined += "taking the committed state from a peer in place" in log
    assert rejoined >= 1, err[-3000:]
    assert assert_identical(out, [0, 1, 2])[1]["step"] == 60, err[-3000:]
    st = read_state(ftrun_home, run_id)
    assert all(rep.get("restarts", 0) == 0 for rep in st["replicas"]), st["replicas"]
