"""Every worker starts with the random state a fresh interpreter has, as under torchrun.

Workers are forked from one prepared process (the zygote); without a reseed every rank, and
every restart of a rank, would draw the same numbers from torch, `random` and numpy. torchrun
is the oracle: its workers are fresh interpreters.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import FTRUN, ROOT

DRAW = """
import json, os, random, sys
import numpy, torch
seed = os.environ.get("SEED")
if seed:
    torch.manual_seed(int(seed)); random.seed(int(seed)); numpy.random.seed(int(seed))
inc = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
draw = {"initial_seed": torch.initial_seed(), "torch": torch.rand(1).item(), "random": random.random(),
        "numpy": float(numpy.random.rand()), "dropout": torch.nn.functional.dropout(torch.ones(64), 0.5).tolist()}
path = os.path.join(sys.argv[1], f"{os.environ['RANK']}.{inc}.json")
with open(path + ".tmp", "w") as f:
    json.dump(draw, f)
os.replace(path + ".tmp", path)  # whole or absent, should the group be stopped now
if os.environ.get("FAIL_FIRST") and inc == "0":
    # fail once every rank has drawn: a rank that fails first would have the group stopped
    # before a slower peer wrote its draw (torchrun's behaviour too)
    import time
    world = int(os.environ["WORLD_SIZE"])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not all(
            os.path.exists(os.path.join(sys.argv[1], f"{r}.0.json")) for r in range(world)):
        time.sleep(0.05)
    sys.exit(3)
"""

FIELDS = ("initial_seed", "torch", "random", "numpy", "dropout")


def _draws(folder):
    return {p.stem: json.loads(p.read_text()) for p in folder.glob("*.json")}


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PET_")}
    env.update(extra)
    return env


def _launch(launcher, nproc, script, out, env, extra=()):
    """`launcher` (ftrun or torchrun) running `script OUT` on `nproc` processes, to the end."""
    out.mkdir()
    proc = subprocess.run(launcher + ["--nproc-per-node", str(nproc), *extra, str(script), str(out)],
                          capture_output=True, text=True, env=env, timeout=180, cwd=ROOT)
    return proc


@pytest.mark.quick
def test_each_rank_draws_its_own_numbers_as_under_torchrun(ftrun_home, tmp_path):
    script = tmp_path / "draw.py"
    script.write_text(DRAW)
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or "torchrun"
    t = _launch([torchrun], 3, script, tmp_path / "t", _env())
    assert t.returncode == 0, t.stderr
    f = _launch(FTRUN, 3, script, tmp_path / "f", _env())
    assert f.returncode == 0, f.stderr
    theirs, ours = _draws(tmp_path / "t"), _draws(tmp_path / "f")
    assert len(theirs) == len(ours) == 3
    for field in FIELDS:
        # The oracle: torchrun's ranks draw apart; so must ftrun's.
        assert len({json.dumps(d[field]) for d in theirs.values()}) == 3, (field, theirs)
        assert len({json.dumps(d[field]) for d in ours.values()}) == 3, (field, ours)


def test_a_restarted_group_draws_new_numbers(ftrun_home, tmp_path):
    script = tmp_path / "draw.py"
    script.write_text(DRAW)
    f = _launch(FTRUN, 2, script, tmp_path / "f", _env(FAIL_FIRST="1"), ["--max-restarts", "1"])
    assert f.returncode == 0, f.stderr
    ours = _draws(tmp_path / "f")
    assert sorted(ours) == ["0.0", "0.1", "1.0", "1.1"]
    for field in FIELDS:
        assert len({json.dumps(d[field]) for d in ours.values()}) == 4, (field, ours)


def test_a_scripts_own_seed_still_decides(ftrun_home, tmp_path):
    script = tmp_path / "draw.py"
    script.write_text(DRAW)
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or "torchrun"
    t = _launch([torchrun], 2, script, tmp_path / "t", _env(SEED="1234"))
    f = _launch(FTRUN, 2, script, tmp_path / "f", _env(SEED="1234"))
    assert t.returncode == 0 and f.returncode == 0, (t.stderr, f.stderr)
    theirs, ours = _draws(tmp_path / "t"), _draws(tmp_path / "f")
    for field in FIELDS:
        values = {json.dumps(d[field]) for d in list(theirs.values()) + list(ours.values())}
        assert len(values) == 1, (field, theirs, ours)
