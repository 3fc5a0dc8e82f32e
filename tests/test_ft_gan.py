"""Optimizers stepped one after another in each step of the loop (a GAN: the discriminator's
backward and step, then the generator's) under --ft: each ft.Optimizer's step is a sub-step of the
loop's step, a replica killed inside either backward or between the two is healed, every sample is
trained exactly once an epoch by each of the two steps, and the replicas end bitwise identical.
Real CLI, real kills."""

from __future__ import annotations

import torch

from conftest import ROOT, run_ftrun, start_ftrun
from helpers import load_params, wait_for

GAN = ROOT / "tests" / "ft_gan_worker.py"


def test_a_gans_two_steps_heal_with_each_sample_trained_once_by_each(ftrun_home, tmp_path):
    """Rank 1 killed inside the discriminator's backward at step 8 (no optimizer step of that loop
    step committed), rank 2 between the two steps at step 20 (the discriminator's committed, the
    generator's not: the step is handed out again, the discriminator's skipped, the generator's
    taken on the same samples over the two replicas left). Each counter (one weight per sample, one
    per step) ends at exactly -epochs, and every replica's whole state is the same."""
    out = tmp_path / "g"
    r = run_ftrun(["--nproc", 3, "--ft", GAN, "--epochs", 10, "--out", out, "--die-at", "1:8:d,2:20:between",
                   "--slow-while-away", 0.1],
                  timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.count("healed from a peer") == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    states = load_params(out, 3)
    for rank, s in enumerate(states):
        for counter in ("count_d", "count_g"):
            assert torch.unique(s[counter]).tolist() == [-10.0], (rank, counter, torch.unique(s[counter]))
    for s in states[1:]:
        for part in ("G", "D"):
            assert all(torch.equal(v, states[0][part][k]) for k, v in s[part].items()), part
        for part in ("opt_g", "opt_d"):
            for mine, theirs in zip(s[part], states[0][part]):
                assert all(torch.equal(a, b) for p_ in theirs["state"] for (a, b) in
                           zip(mine["state"][p_].values(), theirs["state"][p_].values())), part


def test_one_ft_optimizer_stepped_twice_a_step_is_refused_with_the_fix(ftrun_home):
    """Both optimizers in one ft.Optimizer, stepped twice a step (what the refusal of a second
    ft.Optimizer once advised): one line naming the fix (an ft.Optimizer each), exit 2, nothing
    restarted, instead of a generator whose gradients no round averaged."""
    r = run_ftrun(["--nproc", 2, "--ft", GAN, "--optimizers", "one"], timeout=120)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "opt.step() was called twice in one step" in r.stderr, r.stderr[-3000:]
    assert "give each its own: ft.Optimizer(opt_d), ft.Optimizer(opt_g)" in r.stderr, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "restarting" not in r.stderr, r.stderr[-3000:]


def _assert_counted_and_identical(out, replicas: int, epochs: int) -> None:
    states = load_params(out, replicas)
    for rank, s in enumerate(states):
        for counter in ("count_d", "count_g"):
            assert torch.unique(s[counter]).tolist() == [-float(epochs)], (rank, counter, torch.unique(s[counter]))
    for s in states[1:]:
        for part in ("G", "D"):
            assert all(torch.equal(v, states[0][part][k]) for k, v in s[part].items()), part


def test_a_gan_killed_whole_resumes_both_optimizers_from_its_checkpoint(ftrun_home, tmp_path):
    """--checkpoint-dir with two ft.Optimizers, each over an Adam and a momentum-free SGD (which keeps
    no state for its parameters): the run is killed whole after its checkpoint of step 10, and the
    next run resumes every optimizer from it (torch's set_state_dict could not place the param
    groups of optimizers without state, and the resumed run failed) and counts each sample once."""
    from test_checkpoint import _complete, _kill_everything

    ck, out = tmp_path / "ck", tmp_path / "g"
    cmd = ["--nproc", 2, "--ft", "--run-id", "gan-ck", "--checkpoint-dir", ck, "--checkpoint-every", 10, GAN,
           "--epochs", 4, "--out", out, "--step-sleep", 0.05]
    first = start_ftrun(cmd, files=("stderr",))
    wait_for(lambda: 10 in _complete(ck), 90, "the checkpoint of step 10", first)
    _kill_everything(first)
    r = run_ftrun(cmd, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from checkpoint" in r.stderr, r.stderr[-3000:]
    _assert_counted_and_identical(out, 2, 4)

