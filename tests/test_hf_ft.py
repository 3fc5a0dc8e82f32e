"""--ft for an unmodified Hugging Face Trainer script: only the killed replica restarts, its train()
goes on mid-epoch with the Trainer's whole state from a peer, and every sample is trained once an
epoch (the counter model of tests/hf_counter.py). Real CLI, real SIGKILL, CPU gloo, no download."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="transformers is a test-only dependency (scripts/test.sh installs it)")
pytest.importorskip("accelerate", reason="accelerate is a test-only dependency (scripts/test.sh installs it)")

from conftest import ROOT  # noqa: E402
from helpers import finish  # noqa: E402
from test_ft import start_ftrun  # noqa: E402
from test_ft_data import _kill_at  # noqa: E402

WORKER = ROOT / "tests" / "hf_counter.py"
os.environ["HF_HUB_OFFLINE"] = "1"  # nothing comes from a hub: models from configs, data synthetic


def _strengths(report, epochs):
    """Each (epoch, sample) weight is -1/n for the n replicas of the one committed step that
    trained it: once, at full or reduced strength."""
    strengths = {}
    for e in range(epochs):
        for i, w in enumerate(report["weights"][e]):
            n = next((n for n in (3, 2, 1) if abs(w + 1 / n) < 1e-5), None)
            assert n is not None, (e, i, w)
            strengths.setdefault(e, set()).add(n)
    return strengths


def test_unmodified_trainer_script_heals_mid_epoch(ftrun_home, tmp_path):
    """Three replicas, 2 epochs of 30 steps; replica 1 killed early in epoch 1, then replica 2: the
    run finishes, each restarted replica's train() went on where the run was (not from step 0),
    every sample was trained once an epoch, and the replicas end identical."""
    out, size, epochs, steps = tmp_path / "o", 180, 2, 30
    proc = start_ftrun(["--nproc", 3, "--ft", "--max-restarts", 4, "--run-id", "hf", WORKER, epochs, out,
                        "--size", size, "--batch", 2, "--sleep", 0.25])
    try:
        _kill_at(ftrun_home, "hf", proc, [(1, steps + 1), (2, steps + 4)])
        rc, err = finish(proc, 300)
    finally:
        proc.kill()
    assert rc == 0, err[-3000:]
    assert err.count("restarting it alone") == 2, err[-3000:]
    assert "cannot heal" not in err, err[-3000:]
    reports = {r: json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(3)}
    assert all(rep["step"] == epochs * steps for rep in reports.values()), {r: rep["step"] for r, rep in reports.items()}
    assert reports[0]["weights"] == reports[1]["weights"] == reports[2]["weights"]
    strengths = _strengths(reports[0], epochs)
    assert strengths[0] == {3}, strengths  # nothing failed in epoch 0
    assert 2 in strengths[1] or 1 in strengths[1], strengths  # steps ran with replicas away
    for r in (1, 2):
        starts = [json.loads(line) for line in Path(f"{out}.rank{r}.starts").read_text().splitlines()]
        assert len(starts) == 2 and starts[0] == {**starts[0], "epoch": 0, "step": 0}, starts
        # Went on where the run was, in epoch 1, not from step 0:
        assert steps + 1 <= starts[1]["step"] < epochs * steps and starts[1]["epoch"] == 1, starts
