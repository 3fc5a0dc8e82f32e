"""A script in the shape of pytorch/examples' minGPT-ddp (tests/ported/mingpt.py) and its port to
--ft (tests/ported/mingpt_ft.py): with no failure the port trains, to the bit, what torchrun
trains with the original (its DistributedSampler kept, seed=1 for the script's set_epoch(1..N));
under kills every training sample is trained exactly once an epoch (the model's counter) and
the replicas end identical, the evaluation loader's DistributedSampler(dataset) working on the
restarted ones. Real CLI, real SIGKILL."""

from __future__ import annotations

import pytest

import os
import re
import shutil
import subprocess
import sys

from conftest import ROOT, run_ftrun, start_ftrun
from helpers import finish, restarts_of_kills, wait_replica

ORIGINAL = ROOT / "tests" / "ported" / "mingpt.py"
PORTED = ROOT / "tests" / "ported" / "mingpt_ft.py"
REPORT = re.compile(r"rank (\d+) seen (\S+) (\S+) weights (\S+)")


def _printed_reports(text: str) -> dict:
    """{rank: (lowest, highest sample seen, weights)} of the report lines the script printed."""
    return {int(r): (float(lo), float(hi), w) for r, lo, hi, w in REPORT.findall(text)}


@pytest.mark.extended
def test_mingpt_port_trains_what_the_original_trains(ftrun_home, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PET_")}
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or "torchrun"
    t = subprocess.run([torchrun, "--nproc-per-node", "2", str(ORIGINAL), "--max-epochs", "2"], capture_output=True,
                       text=True, env=env, timeout=300, cwd=tmp_path)
    assert t.returncode == 0, t.stderr[-3000:]
    ported = run_ftrun(["--nproc", 2, "--ft", PORTED, "--max-epochs", 2], timeout=300)
    assert ported.returncode == 0, ported.stderr[-3000:]
    theirs, ours = _printed_reports(t.stdout), _printed_reports(ported.stdout)
    assert len(theirs) == len(ours) == 2, (t.stdout[-2000:], ported.stdout[-2000:])
    assert set(theirs.values()) == set(ours.values()) == {(-2.0, -2.0, theirs[0][2])}, (theirs, ours)
    # The port says nothing about its order: the sampler's shuffle and the seed are right.
    assert "set_epoch" not in ported.stderr and "shuffle" not in ported.stderr, ported.stderr[-3000:]


def test_mingpt_port_trains_every_sample_once_an_epoch_under_kills(ftrun_home, tmp_path):
    """Three replicas, two SIGKILLs of different replicas (the second while the first is back):
    each restarts alone and heals; every training sample ends trained exactly 3 times (once an
    epoch) on every replica, and the replicas end identical. Each evaluation pass, the restarted
    replicas' included, goes through its DistributedSampler(dataset) without a default group."""
    proc = start_ftrun(["--nproc", 3, "--ft", "--run-id", "gpt", PORTED, "--max-epochs", 3], files=("stderr",))
    try:
        for rank, step in ((1, 15), (2, 110)):
            r = wait_replica(ftrun_home, "gpt", rank, lambda r, st: r["step"] >= step and r["state"] == "running",
                             120, proc=proc)
            os.kill(r["pid"], 9)
        rc, err = finish(proc, 300)
    finally:
        proc.kill()
    assert rc == 0, err[-3000:]
    restarts_of_kills(err, 2)
    assert "Traceback" not in err, err[-3000:]
    logs = [(ftrun_home / "gpt" / "logs" / f"rank{r}" / "stdout.log").read_text() for r in range(3)]
    finals = [_printed_reports(log.split("=====")[-1]) for log in logs]
    assert all(len(f) == 1 for f in finals), finals
    assert {v for f in finals for v in f.values()} == {(-3.0, -3.0, finals[0][0][2])}, finals
    for rank in (1, 2):  # the restarted replicas evaluated too
        assert re.search(r"Epoch 3 \| Iter 0 \| Eval Loss", logs[rank].split("=====")[-1]), logs[rank][-2000:]
