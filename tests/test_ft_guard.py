"""The guard: replicas compare a fingerprint of their whole state after every heal and every few
steps, and one that differs is healed, named, or the run stops; state a script keeps without
registering it (an EMA) is found and healed. Real CLI, real processes; every replica's whole state compared at the end."""

from __future__ import annotations

import re

from conftest import ROOT, run_ftrun
from helpers import load_params

WORKER = ROOT / "tests" / "ft_guard_worker.py"
# Each replica's BatchNorm statistics are its own (its forward updates them from its own batch, and
# an AveragedModel copies the model's): the guard leaves them out, and so does this comparison.
OWN = re.compile(r"(running_mean|running_var|num_batches_tracked)'\)")


def _differing(out, world: int) -> list:
    """The entries of each rank's saved state that differ from rank 0's, BatchNorm statistics aside."""
    from torch.utils._pytree import tree_flatten_with_path

    states = load_params(out, world)
    flat = [{str(k): v for k, v in tree_flatten_with_path(s)[0]} for s in states]
    return [(r, k) for r in range(1, world) for k, v in flat[0].items()
            if not OWN.search(k) and (not hasattr(v, "shape") and v != flat[r][k] or hasattr(v, "shape") and not v.equal(flat[r][k]))]


def test_planted_divergences_are_found_named_and_healed(ftrun_home, tmp_path):
    """A weight on rank 1, the unregistered EMA's count of averaged models (a buffer) on rank 2 and
    the registered scheduler's counter on rank 0, each changed outside the optimizer once, just
    before a check (every 10 steps): each is found there, named alone, and healed from the
    majority; the run ends with every replica's whole state the same."""
    out = tmp_path / "s"
    r = run_ftrun(["--nproc", 3, "--ft", WORKER, "--steps", 70, "--out", out,
                   "--plant", "1:20:param,2:40:buffer,0:60:state"], env={"FTRUN_FT_CHECK_STEPS": "10"}, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    err = r.stderr
    assert "heals and checks state the script keeps but did not register: ema (AveragedModel)" in err, err[-3000:]
    for rank, step, what in ((1, 20, "model 0 0.weight"), (2, 40, "'ftrun.found.ema' n_averaged"),
                             (0, 60, "'sched'['last_epoch']")):
        line = rf"rank {rank}: its state differs from its peers' at step {step} \(1 of \d+ entries differ: {re.escape(what)}\);"
        assert re.search(line, err), (line, err[-3000:])
    assert err.count("its state differs from its peers'") == 3, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert _differing(out, 3) == []


def test_two_replicas_that_differ_stop_the_run_naming_what_differs(ftrun_home, tmp_path):
    """With two replicas there is no majority: the run stops at the first check after the change,
    in one line naming the tensor, exit 2, nothing restarted."""
    r = run_ftrun(["--nproc", 2, "--ft", WORKER, "--steps", 40, "--plant", "1:12:adam"],
                  env={"FTRUN_FT_CHECK_STEPS": "5"}, timeout=120)
    assert r.returncode == 2, r.stderr[-3000:]
    err = r.stderr
    assert "states differ at step 15 and no majority holds one of them" in err, err[-3000:]
    assert "exp_avg of model 0 0.weight" in err, err[-3000:]
    assert "Traceback" not in err and "restarting" not in err, err[-3000:]


def test_an_unregistered_ema_is_healed_with_the_model(ftrun_home, tmp_path):
    """The EMA the script keeps without registering it travels with the heal: a replica killed at
    step 20 ends with the same EMA (its count of averaged models included) as its peers, where it
    used to start its EMA over; the guard's check after the heal finds nothing. (Steps of 30 ms:
    the restarted replica is back well before the end, on a loaded machine too.)"""
    out = tmp_path / "e"
    r = run_ftrun(["--nproc", 3, "--ft", WORKER, "--steps", 200, "--step-sleep", 0.03, "--out", out,
                   "--die-at", "1:20"], timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "healed from a peer" in r.stderr, r.stderr[-3000:]
    assert "differs from its peers'" not in r.stderr, r.stderr[-3000:]
    assert _differing(out, 3) == []
    assert int(load_params(out, 3)[1]["ema"]["n_averaged"]) == 200
