"""Lightning's own public example, ported with no ftrun in it (tests/lightning_transformer_example.py:
examples/pytorch/basics/transformer.py of Lightning-AI/pytorch-lightning, on synthetic tokens),
run unmodified under `ftrun --ft`: a kill mid-run heals, and the run ends where a failure-free
run ends. Real CLI, real SIGKILL, CPU gloo."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import ROOT, start_ftrun
from helpers import finish, needs, read_reports
from test_ft_data import _kill_at

pytestmark = needs("lightning")

EXAMPLE = ROOT / "tests" / "lightning_transformer_example.py"


def _identical_report(out):
    """The replicas' report, after checking that they all ended with it."""
    reports = list(read_reports(out, 3).values())
    # The replicas end identical (a restarted one's list of validation losses starts at its restart).
    assert all(rep["params"] == reports[0]["params"] and rep["test_loss"] == reports[0]["test_loss"]
               and rep["step"] == reports[0]["step"] for rep in reports), reports
    return reports[0]


@pytest.mark.extended
def test_lightnings_transformer_example_heals_and_ends_as_a_failure_free_run(ftrun_home, tmp_path):
    """The example (a Transformer language model, SGD, gradient clipping, validation, then
    test()) with 3 replicas for 2 epochs, next to the same run with replica 1 killed in epoch 0: the killed replica goes on mid-run from a peer, every replica of each run ends identical,
    both runs take the same number of steps, and the killed run's validation and test losses
    match the failure-free run's (within what dropout drawn by other workers changes)."""
    ref, out = tmp_path / "ref", tmp_path / "o"
    common = ["--nproc", 3, "--ft", "--max-restarts", 3]
    clean = start_ftrun([*common, "--run-id", "clean", EXAMPLE, ref, "--epochs", 2], files=("stderr",))
    proc = start_ftrun([*common, "--run-id", "tx", EXAMPLE, out, "--epochs", 2, "--sleep", 0.05], files=("stderr",))
    try:
        _kill_at(ftrun_home, "tx", proc, [(1, 10)])
        rc, err = finish(proc, 400)
        rc_clean, err_clean = finish(clean, 400)
    finally:
        proc.kill()
        clean.kill()
    assert rc == 0, err[-3000:]
    assert rc_clean == 0, err_clean[-3000:]
    assert err.count("restarting it alone") == 1 and "cannot heal" not in err, err[-3000:]
    starts = [json.loads(line) for line in Path(f"{out}.rank1.starts").read_text().splitlines()]
    assert len(starts) == 2 and starts[1]["step"] >= 10, starts  # went on mid-run
    killed, clean_run = _identical_report(out), _identical_report(ref)
    assert killed["step"] == clean_run["step"] == 2 * 20, (killed["step"], clean_run["step"])
    assert clean_run["val"][-1] < 0.3 * clean_run["val"][0], clean_run["val"]  # it learns
    # The same global batch each step whoever is away: the same curve, to float summation order.
    for a, b in zip(killed["val"] + [killed["test_loss"]], clean_run["val"] + [clean_run["test_loss"]]):
        assert abs(a - b) < 0.02 + 0.05 * b, (killed, clean_run)
