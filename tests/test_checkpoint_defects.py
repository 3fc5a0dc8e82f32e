"""Checkpoint defects of issue 40, through the real CLI (and the quorum keeper's pace, driven
against a real store): a pre-emption of a run of slow steps saves its last committed step
within the shutdown timeout; a checkpoint folder that can never
be written is one line in a run and in its dry run; a checkpoint moved aside never replaces an
earlier one of the same step; an optimizer of another class is named, not its missing field.
"""

from __future__ import annotations

import json
import re
import signal
import time

import pytest

from conftest import SCRIPTS, run_ftrun
from ftrun import protocol as keys
from ftrun.supervisor.quorum import KeeperSettings, QuorumKeeper
from ftrun.supervisor.quorum_status import Pace
from helpers import assert_bad, err_text, start_logged
from test_checkpoint import _complete, _wait_for
from test_checkpoint_faults import _printed_step

TRAIN = SCRIPTS / "train_ft.py"


@pytest.mark.quick
@pytest.mark.parametrize("folder", ["/proc/ck", "/sys/ck"])
@pytest.mark.parametrize("dry", [False, True])
def test_a_checkpoint_folder_on_a_kernel_file_system_is_one_line(ftrun_home, tmp_path, folder, dry):
    """/proc and /sys take no folder of a run, root's included (os.access says yes to root): the
    run and its dry run say so in one line, exit 2, and nothing starts (it was a traceback from
    the folder's lock, exit 1, after a dry run that said 0)."""
    script = tmp_path / "x.py"
    script.write_text("print('never')\n")
    proc = run_ftrun([*(["--dry-run"] if dry else []), "--nproc", 1, "--ft", "--run-id", "k",
                      "--checkpoint-dir", folder, script], timeout=60)
    assert_bad(proc, f"--checkpoint-dir {folder} ", "kernel", "give a folder you can write")
    assert "never" not in proc.stdout and not (ftrun_home / "k").exists()


def test_a_second_damaged_checkpoint_of_a_step_keeps_the_first(ftrun_home, tmp_path):
    """step-20 damaged, resumed (moved aside to step-20.damaged), written again and damaged
    again: the second resume moves it to step-20.damaged.2 and keeps the first (it was
    removed to make room: against 'never deleted')."""
    d = tmp_path / "ck"
    cmd = ["--nproc", 1, "--ft", "--run-id", "twice", "--checkpoint-dir", d, "--checkpoint-every", 10, TRAIN,
           "--dim", 64, "--hidden", 224, "--optim", "adam", "--steps", 20, "--print-every", 1000]

    def damage() -> bytes:
        with open(d / "step-20" / "__0_0.distcp", "r+b") as f:
            f.write(b"\0" * 4096)
        return (d / "step-20" / "ftrun.json").read_bytes()

    first = run_ftrun(cmd, timeout=120)
    assert first.returncode == 0 and _complete(d) == [10, 20], (_complete(d), first.stderr[-2000:])
    metas = [damage()]
    for aside in ("step-20.damaged", "step-20.damaged.2"):
        again = run_ftrun(cmd, timeout=120)
        assert again.returncode == 0, again.stderr[-3000:]
        assert f"moved aside to {d}/{aside} (never read again" in again.stderr, again.stderr[-3000:]
        assert f"resumed from checkpoint {d}/step-10 at step 10" in again.stderr and _complete(d) == [10, 20]
        metas.append(damage())
    # both kept, each as it was moved aside (the second run's step-20 is another write)
    assert (d / "step-20.damaged" / "ftrun.json").read_bytes() == metas[0]
    assert (d / "step-20.damaged.2" / "ftrun.json").read_bytes() == metas[1]
    assert sorted(p.name for p in d.glob("step-20.damaged*")) == ["step-20.damaged", "step-20.damaged.2"]


def test_an_sgd_checkpoint_resumed_by_adam_names_both_optimizers(ftrun_home, tmp_path):
    """Adam on SGD's checkpoint: the documented line naming both classes, exit 2, not the first
    field SGD lacks (param_groups.0.betas), which says nothing of what happened."""
    d = tmp_path / "ck"

    def cmd(optim):
        return ["--nproc", 1, "--ft", "--checkpoint-dir", d, "--checkpoint-every", 10, TRAIN, "--dim", 64,
                "--hidden", 224, "--optim", optim, "--steps", 10, "--print-every", 1000]

    assert run_ftrun(cmd("sgd"), timeout=120).returncode == 0 and _complete(d) == [10]
    other = run_ftrun(cmd("adam"), timeout=120)
    assert other.returncode == 2, other.stderr[-3000:]
    lines = [line for line in other.stderr.splitlines() if "does not fit this run" in line]
    assert len(lines) == 1, other.stderr[-3000:]
    assert (f"checkpoint {d}/step-10 does not fit this run: it was written with optimizer SGD, this run uses "
            f"Adam. Another model or optimizer wrote it; give this run its own --checkpoint-dir") in lines[0], lines[0]
    assert "betas" not in other.stderr and "Traceback" not in other.stderr
