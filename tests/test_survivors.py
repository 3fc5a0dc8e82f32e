"""Survivors of another replica's failure under --ft, through the real CLI: a member that stepped
past a round its peers then voted down restarts to take the committed state from a peer, and
that restart is neither charged to its restart budget nor reported as a failure of its own.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from conftest import SCRIPTS
from helpers import finish, read_state, start_logged

TRAIN = SCRIPTS / "train_ft.py"


def _rank_log(home: Path, run_id: str, rank: int) -> str:
    st = read_state(home, run_id)
    assert st, f"no state for {run_id}"
    return (Path(st["log_dir"]) / f"rank{rank}" / "stderr.log").read_text()


def _assert_identical(out: Path, ranks) -> int:
    """The listed ranks ended with the same parameters and step; that step."""
    params = [torch.load(f"{out}.rank{r}.pt", weights_only=True) for r in ranks]
    for r, p in zip(ranks[1:], params[1:]):
        for k in params[0]:
            assert torch.equal(params[0][k], p[k]), f"rank {r} parameter {k} differs"
    steps = {json.loads(Path(f"{out}.rank{r}.json").read_text())["step"] for r in ranks}
    assert len(steps) == 1, steps
    return steps.pop()


def test_a_survivor_restarted_by_its_peers_decision_pays_no_budget_and_is_told_why(ftrun_home, tmp_path):
    """Rank 1 votes step 12 down after every collective of it went through (FTRUN_FT_INJECT_FAIL):
    ranks 0 and 2 had stepped past it, and each restarts to take the committed state from rank 1.
    With --max-restarts 0 these restarts used to spend the budget at once: both replicas were
    dropped ("its restart budget (0) is spent"), the run went on with rank 1 alone, and the
    console said "exited with code 75". A restart that the other members' decision forced is not
    the replica's own failure: it restarts whatever its budget, the console names its cause, and
    all three replicas finish identical."""
    out = tmp_path / "p"
    run_id = "peers"
    proc = start_logged(["--nproc", 3, "--ft", "--max-restarts", 0, "--run-id", run_id, TRAIN, "--steps", 60, "--step-sleep", 0.05,
                         "--out", out], env={"FTRUN_FT_INJECT_FAIL": "1:12"})
    try:
        rc, err = finish(proc, 240)
    finally:
        proc.kill()
    assert rc == 0, err[-3000:]
    assert "restart budget (0) is spent" not in err and "exited with code 75" not in err, err[-3000:]
    for r in (0, 2):
        log = _rank_log(ftrun_home, run_id, r)
        assert ("was voted down after this member had stepped past it" in log
                or re.search(r"keeps its first \d+ steps while this member had taken", log)), log[-2000:]
        line = next((ln for ln in err.splitlines() if re.search(rf"ftrun: rank {r} \(pid \d+\) restarted to take "
                                                                 rf"the committed state again after ", ln)), None)
        assert line is not None, err[-3000:]
        assert "a peer's failed collective" in line and "not counted against its restart budget" in line, line
    assert _assert_identical(out, [0, 1, 2]) == 60, err[-3000:]
    st = read_state(ftrun_home, run_id)
    assert all(rep.get("restarts", 0) == 0 for rep in st["replicas"]), st["replicas"]
