"""Real training scripts, ported: pytorch/examples' DDP tutorial (tests/ported/ddp_tutorial.py)
runs under torchrun and under ftrun alike, and its port to --ft (tests/ported/ddp_tutorial_ft.py)
trains exactly what the original trains when nothing fails, and survives kills."""

from __future__ import annotations

import pytest

import os
import re
import shutil
import subprocess
import sys
import time

from conftest import FTRUN, ROOT, run_ftrun, start_ftrun
from helpers import finish, restarts_of_kills, wait_replica

ORIGINAL = ROOT / "tests" / "ported" / "ddp_tutorial.py"
PORTED = ROOT / "tests" / "ported" / "ddp_tutorial_ft.py"


def _weights(text: str) -> dict:
    return {int(r): float(w) for r, w in re.findall(r"rank (\d+) weight (\S+)", text)}


@pytest.mark.extended
def test_tutorial_port_trains_what_the_original_trains(ftrun_home, tmp_path):
    """No failure: torchrun running the original, ftrun running it unchanged, and ftrun --ft
    running the port all end with the same weights, to the bit (ft.DataLoader gives each rank
    DistributedSampler's batches; two replicas sum the same way as DDP)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PET_")}
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or "torchrun"
    oracle = [torchrun, "--nproc-per-node", "2", str(ORIGINAL), "3", "1", "--snapshot", str(tmp_path / "t.pt")]
    t = subprocess.run(oracle, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    if t.returncode != 0 and "terminate called without an active exception" in t.stderr:
        # The oracle itself (plain torchrun, no ftrun) once had a worker abort in torch's C++
        # teardown (once in this stop's clean runs; 14 runs after it passed): that is torch's, so the
        # oracle is run once more, from the start. ftrun's own runs below get no second try.
        (tmp_path / "t.pt").unlink(missing_ok=True)
        t = subprocess.run(oracle, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert t.returncode == 0, t.stderr[-3000:]
    plain = run_ftrun(["--nproc", 2, ORIGINAL, 3, 1, "--snapshot", tmp_path / "f.pt"], timeout=300)
    assert plain.returncode == 0, plain.stderr[-3000:]
    ported = run_ftrun(["--nproc", 2, "--ft", PORTED, 3, 1], timeout=300)
    assert ported.returncode == 0, ported.stderr[-3000:]
    theirs, same, ours = _weights(t.stdout), _weights(plain.stdout), _weights(ported.stdout)
    assert len(theirs) == len(same) == len(ours) == 2, (t.stdout, plain.stdout, ported.stdout)
    assert len(set(theirs.values()) | set(same.values()) | set(ours.values())) == 1, (theirs, same, ours)


def test_tutorial_port_survives_kills(ftrun_home, tmp_path):
    """The port under two SIGKILLs of different replicas: each restarts alone, heals, and the run
    ends with every replica's weights equal."""
    # 12 epochs of about 43 steps of a few milliseconds: the second kill leaves the restarted
    # replica time to heal before the end (with 4, the run ended 0.5 s after it, never back).
    proc = start_ftrun(["--nproc", 3, "--ft", "--run-id", "tut", PORTED, 12, 1, "--batch_size", 16], files=("stderr",))
    try:
        for rank, step in ((1, 20), (2, 70)):
            for _ in range(20):  # the state file may still name a process that has just exited: read again
                r = wait_replica(ftrun_home, "tut", rank, lambda r, st: r["step"] >= step and r["state"] == "running",
                                 proc=proc)
                try:
                    os.kill(r["pid"], 9)
                    break
                except ProcessLookupError:
                    time.sleep(0.1)
            else:
                raise AssertionError(f"rank {rank} never had a live process to kill")
        rc, err = finish(proc, 300)
    finally:
        proc.kill()
    assert rc == 0, err[-3000:]
    restarts = restarts_of_kills(err, 2)
    assert err.count("healed from a peer") >= len(restarts), err[-3000:]
    logs = [(ftrun_home / "tut" / "logs" / f"rank{r}" / "stdout.log").read_text() for r in range(3)]
    finals = [_weights(log.split("=====")[-1]) for log in logs]
    assert len({w for f in finals for w in f.values()}) == 1, finals
