"""A nanoGPT-shaped script (memmapped uint16 tokens, accumulation, clipping, a cosine LR from the
iteration, evaluation and saves on rank 0) before and after its port to --ft: the torchrun
version trains the same under torchrun and under ftrun; the port survives kills with every
replica identical, each evaluation printed once and best_val_loss right on whichever replica
evaluates; a whole-run kill resumes from --checkpoint-dir. Real CLI, real SIGKILL."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, run_ftrun, start_ftrun
from helpers import assert_identical, finish, read_reports, wait_printed, wait_replica

PORTED = ROOT / "tests" / "ported"
BEFORE = PORTED / "nanogpt_like.py"
AFTER = PORTED / "nanogpt_like_ft.py"
EVAL = re.compile(r"^\[rank (\d+)\] step (\d+): train loss ([\d.]+), val loss ([\d.]+)$", re.MULTILINE)


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    """train.bin and val.bin: seeded random walks over 64 tokens (100k and 10k tokens)."""
    sys.path.insert(0, str(PORTED))
    try:
        from nanogpt_model import random_walk_tokens
    finally:
        sys.path.remove(str(PORTED))
    d = tmp_path_factory.mktemp("tokens")
    random_walk_tokens(100_000, 64, seed=1).tofile(d / "train.bin")
    random_walk_tokens(10_000, 64, seed=2).tofile(d / "val.bin")
    return d


def _evals(text: str):
    """[(step, val loss)] of the evaluation lines printed, in order."""
    return [(int(m[1]), float(m[3])) for m in EVAL.findall(text)]


@pytest.mark.extended
def test_torchrun_version_trains_the_same_under_torchrun_and_ftrun(ftrun_home, tmp_path, tokens):
    """The script as written for torchrun (its own init_process_group, DDP, per-rank seeds and
    random batches) gives bitwise the same parameters, last loss and evaluations under ftrun."""
    common = ["--data_dir", tokens, "--max_iters", 20, "--eval_interval", 10]
    theirs = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             BEFORE, *map(str, common), "--out_dir", str(tmp_path / "o1"), "--out",
                             str(tmp_path / "t")], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert theirs.returncode == 0, theirs.stderr[-3000:]
    ours = run_ftrun(["--nproc", 2, BEFORE, *common, "--out_dir", tmp_path / "o2", "--out", tmp_path / "f"],
                     timeout=300)
    assert ours.returncode == 0, ours.stderr[-3000:]
    for r in range(2):
        a = torch.load(f"{tmp_path / 't'}.rank{r}.pt", weights_only=True)
        b = torch.load(f"{tmp_path / 'f'}.rank{r}.pt", weights_only=True)
        assert all(torch.equal(a[k], b[k]) for k in a), r
        ja = json.loads(Path(f"{tmp_path / 't'}.rank{r}.json").read_text())
        jb = json.loads(Path(f"{tmp_path / 'f'}.rank{r}.json").read_text())
        assert ja == jb, (r, ja, jb)  # the last loss to the bit, and rank 0's evaluations
    printed = [line for line in theirs.stdout.splitlines() if line.startswith("step ")]
    assert [f"[rank 0] {line}" for line in printed] == [m[0] for m in re.finditer(EVAL, ours.stdout)], ours.stdout
    assert [s for s, _ in _evals(ours.stdout)] == [0, 10, 20]


FT_ARGS = ["--gradient_accumulation_steps", 6, "--log_interval", 1]


def _best_is_the_runs(reports, printed, before=1e9):
    """Each evaluation a replica ran started from best_val_loss = the least val loss the run printed
    before it (`before`: the least of an earlier run's), and every replica ends with the least.
    Printed to 4 decimals; a replica that never evaluated, or lost the value, holds 1e9."""
    for r, rep in reports.items():
        for step, _, val, best in rep["evals"]:
            assert abs(val - printed[step]) < 6e-5, (r, step, val, printed)
            expect = min([before] + [v for s, v in printed.items() if s < step])
            assert abs(best - expect) < 6e-5, (f"rank {r} evaluated step {step} from best_val_loss {best}, the run's "
                                               f"was {expect}", printed)
        assert abs(rep["best_val_loss"] - min(printed.values())) < 6e-5, (r, rep["best_val_loss"], printed)
    # Every replica evaluated the same batches: the same figures to the bit.
    for step in printed:
        assert len({v for rep in reports.values() for s, _, v, _ in rep["evals"] if s == step}) <= 1, step


def test_port_under_two_kills(ftrun_home, tmp_path, tokens):
    """Three replicas. Replica 2 is killed inside step 20 (an evaluation step; its round is
    discarded and step 20 handed out again), replica 0, the one that prints and saves, at step
    45 or so. The run finishes, the replicas end bitwise identical, each evaluation is printed
    exactly once (no second line from the redone step 20), best_val_loss is the run's on every
    replica, the healed ones included, and the loss goes down."""
    out = tmp_path / "p"
    proc = start_ftrun(["--nproc", 3, "--ft", "--run-id", "ng", AFTER, "--data_dir", tokens, "--out_dir", tmp_path / "o",
                         "--out", out, *FT_ARGS], files=("stdout", "stderr"))
    try:
        victim = wait_replica(ftrun_home, "ng", 2, lambda r, st: r["state"] == "running", 120, proc=proc)
        # Replica 0 prints this when it has taken step 19: every replica is then at most inside step 20
        # (its all-reduce needs replica 0), which evaluates first.
        wait_printed(proc, "[rank 0] iter 19:", 180, "stdout", poll=0.005)  # a kill that must land inside the step
        os.kill(victim["pid"], signal.SIGKILL)
        r0 = wait_replica(ftrun_home, "ng", 0, lambda r, st: r["step"] >= 45 and r["state"] == "running", 180,
                          proc=proc)
        os.kill(r0["pid"], signal.SIGKILL)
        rc, err = finish(proc, 300)
    finally:
        proc.kill()
    console = Path(proc.out_path).read_text()
    assert rc == 0, err[-3000:]
    assert err.count("restarting it alone") == 2 and "healed from a peer" in err, err[-3000:]
    printed = _evals(console)
    assert [s for s, _ in printed] == [0, 20, 40, 60, 80, 100], console[-3000:]
    assert printed[-1][1] < printed[0][1] - 1.5, printed  # from ln(64) = 4.16 towards ln(4) = 1.39
    assert_identical(out, 3)
    reports = read_reports(out, 3)
    _best_is_the_runs(reports, dict(printed))
    # Replica 1, never killed, evaluated every evaluation step, printed or not.
    assert [e[0] for e in reports[1]["evals"]] == [0, 20, 40, 60, 80, 100], reports[1]["evals"]


@pytest.mark.extended
def test_port_resumes_from_checkpoint_after_a_whole_run_kill(ftrun_home, tmp_path, tokens):
    """--checkpoint-dir in place of the script's init_from='resume': the whole run (ftrun and every
    worker) is SIGKILLed after step 50, then started again with the same line: it resumes from
    the checkpoint of step 40, with its best_val_loss, and finishes."""
    ck, out = tmp_path / "ck", tmp_path / "p"
    args = ["--nproc", 2, "--ft", "--checkpoint-dir", ck, "--checkpoint-every", 20, "--run-id", "first", AFTER,
            "--data_dir", tokens, "--out_dir", tmp_path / "o", "--out", out, *FT_ARGS]
    proc = start_ftrun(args, files=("stdout", "stderr"))
    try:
        wait_replica(ftrun_home, "first", 0, lambda r, st: r["step"] >= 50, 180, proc=proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        proc.kill()
    first = _evals(Path(proc.out_path).read_text())
    args[args.index("first")] = "second"
    proc = start_ftrun(args, files=("stdout", "stderr"))
    try:
        rc, err = finish(proc, 300)
    finally:
        proc.kill()
    console = Path(proc.out_path).read_text()
    assert rc == 0, err[-3000:]
    resumed = re.search(r"resumed from checkpoint \S+ at step (\d+)", err)
    assert resumed and int(resumed[1]) == 40, err[-3000:]
    second = _evals(console)
    # The first run evaluated up to the kill; the second from the checkpoint's step on. Step 40 is
    # evaluated again: the checkpoint holds the state from before its evaluation ran (a run that
    # skipped it would leave that val loss out of best_val_loss). Resumed exactly: the same figures.
    assert [s for s, _ in first][:3] == [0, 20, 40] and [s for s, _ in second] == [40, 60, 80, 100], (first, second)
    assert dict(first)[40] == dict(second)[40], (first, second)
    assert second[-1][1] < first[0][1] - 1.5, (first, second)
    assert_identical(out, 2)
    reports = read_reports(out, 2)
    # best_val_loss came back with the checkpoint: the least of the first run's figures before step
    # 40, then of the second run's.
    _best_is_the_runs(reports, dict(second), before=min(v for s, v in first if s < 40))
    assert all([e[0] for e in rep["evals"]] == [40, 60, 80, 100] for rep in reports.values()), reports
