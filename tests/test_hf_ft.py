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
    """Three replicas, 2 epochs of 30 steps (epoch 1 slower, for the restarted replicas to come back
    in it), a loader with 2 workers (prefetching batches planned for a membership that changes);
    replica 1 killed early in epoch 1, then replica 2: the
    run finishes, each restarted replica's train() went on where the run was (not from step 0),
    every sample was trained once an epoch, and the replicas end identical."""
    out, size, epochs, steps = tmp_path / "o", 180, 2, 30
    proc = start_ftrun(["--nproc", 3, "--ft", "--max-restarts", 4, "--run-id", "hf", WORKER, epochs, out,
                        "--size", size, "--batch", 2, "--sleep", 0.08, "--sleep-late", 0.4,
                        "--workers", 2])
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
    # (No step need run with a replica away: forked from a zygote that has imported the Trainer, a
    # restarted replica is often back before its peers commit a step without it.)
    for r in (1, 2):
        starts = [json.loads(line) for line in Path(f"{out}.rank{r}.starts").read_text().splitlines()]
        assert len(starts) == 2 and starts[0] == {**starts[0], "epoch": 0, "step": 0}, starts
        # Went on where the run was, in epoch 1, not from step 0:
        assert steps + 1 <= starts[1]["step"] < epochs * steps and starts[1]["epoch"] == 1, starts


def test_whole_run_killed_and_resumed_mid_epoch(ftrun_home, tmp_path):
    """--checkpoint-dir: the whole run (ftrun and every worker) is SIGKILLed mid-epoch, then run
    again: train() goes on from the checkpoint's step, mid-epoch, and every sample is trained once
    an epoch (the steps after the checkpoint are trained again, on the checkpoint's model)."""
    import signal

    from conftest import run_ftrun
    from test_ft import _wait_replica

    out, ck, size, epochs = tmp_path / "o", tmp_path / "ck", 80, 2
    args = ["--nproc", 2, "--ft", "--checkpoint-dir", ck, "--checkpoint-every", 7, "--run-id", "first", WORKER,
            epochs, out, "--size", size, "--batch", 2, "--sleep", 0.05, "--sleep-late", 0.25]
    proc = start_ftrun(args)
    try:
        _wait_replica(ftrun_home, "first", 0, lambda r, st: r["step"] >= 24, 180)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        proc.kill()
    args[args.index("first")] = "second"
    again = run_ftrun(args, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from checkpoint" in again.stderr, again.stderr[-3000:]
    reports = {r: json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(2)}
    assert reports[0]["weights"] == reports[1]["weights"] and reports[0]["step"] == epochs * 20
    strengths = _strengths(reports[0], epochs)
    assert all(s == {2} for s in strengths.values()), strengths
    starts = [json.loads(line) for line in Path(f"{out}.rank0.starts").read_text().splitlines()]
    # A checkpoint's step in epoch 1 (steps 20 to 39: mid-epoch):
    assert starts[-1]["step"] in (21, 28, 35) and starts[-1]["epoch"] == 1, starts


GPT2 = ROOT / "tests" / "hf_gpt2.py"


def _evals(report):
    return {h["step"]: h["eval_loss"] for h in report["history"] if "eval_loss" in h}


def test_gpt2_with_accumulation_clipping_schedule_eval_and_saves_under_a_kill(ftrun_home, tmp_path):
    """A 2-layer GPT-2 from a config, gradient_accumulation_steps=2, max_grad_norm=1.0, a cosine
    schedule, evaluation every 4 steps and checkpoints every 6: a failure-free run, then the same
    run with replica 1 killed mid-epoch. The killed run finishes with every replica at the same
    parameters and learning rate, its evaluation losses are the failure-free run's within float
    noise (each step's gradient is the same global batch's), and the checkpoints are written."""
    from conftest import run_ftrun

    common = ["--nproc", 3, "--ft", "--max-restarts", 2]
    clean = run_ftrun(common + [GPT2, tmp_path / "c", "--size", 288], timeout=300)
    assert clean.returncode == 0, clean.stderr[-3000:]
    ref = json.loads(Path(f"{tmp_path / 'c'}.rank0.json").read_text())
    out = tmp_path / "k"
    proc = start_ftrun(common + ["--run-id", "gpt", GPT2, out, "--size", 288, "--sleep", 0.4])
    try:
        _kill_at(ftrun_home, "gpt", proc, [(1, 4)])
        rc, err = finish(proc, 300)
    finally:
        proc.kill()
    assert rc == 0, err[-3000:]
    assert err.count("restarting it alone") == 1 and "cannot heal" not in err, err[-3000:]
    reports = {r: json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(3)}
    assert all(rep["step"] == ref["step"] == 24 for rep in reports.values()), [rep["step"] for rep in reports.values()]
    assert len({(rep["params"], rep["lr"]) for rep in reports.values()}) == 1, reports
    evals, ref_evals = _evals(reports[0]), _evals(ref)
    assert sorted(evals) == sorted(ref_evals) == [4, 8, 12, 16, 20, 24], (evals, ref_evals)
    assert all(abs(evals[s] - ref_evals[s]) < 5e-3 for s in evals), (evals, ref_evals)
    assert ref_evals[24] < ref_evals[4] - 0.2, ref_evals  # it learns
    assert (Path(f"{out}.out") / "checkpoint-24" / "trainer_state.json").exists()
    assert (Path(f"{out}.final") / "config.json").exists()


def test_what_ftrun_cannot_heal_is_one_line_and_group_restarts(ftrun_home, tmp_path):
    """fp16 steps through a GradScaler, which the Trainer's part does not support: one line at the
    start, Accelerate's own DDP (all workers in one group), and the run trains as without --ft."""
    from conftest import run_ftrun

    out = tmp_path / "o"
    proc = run_ftrun(["--nproc", 2, "--ft", WORKER, 1, out, "--size", 24, "--fp16"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("TrainingArguments(fp16=True) steps through a GradScaler") == 1, proc.stderr[-3000:]
    assert "quorum 1" not in proc.stderr, proc.stderr[-3000:]  # no replica joined one: plain DDP
    reports = {r: json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(2)}
    assert reports[0]["weights"] == reports[1]["weights"]
    assert {round(w, 5) for w in reports[0]["weights"][0]} == {-0.5}


def test_a_script_that_says_so_with_ftrun_hf(ftrun_home, tmp_path):
    """`from ftrun.hf import FTTrainer`: the replicas form a quorum (no line) and train each sample once."""
    from conftest import run_ftrun

    out = tmp_path / "o"
    proc = run_ftrun(["--nproc", 2, "--ft", WORKER, 1, out, "--size", 24, "--subclass"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "quorum 1: 2 replicas" in proc.stderr and "ftrun: --ft:" not in proc.stderr, proc.stderr[-3000:]
    reports = {r: json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(2)}
    assert reports[0]["weights"] == reports[1]["weights"]
    assert {round(w, 5) for w in reports[0]["weights"][0]} == {-0.5}
