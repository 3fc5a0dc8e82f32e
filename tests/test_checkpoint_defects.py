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

from conftest import SCRIPTS, run_ftrun, start_ftrun
from ftrun import keys
from ftrun.supervisor.ft.keeper.core import Pace
from ftrun.supervisor.ft.quorum import KeeperSettings, QuorumKeeper
from ftrun.wire import MemberReport
from helpers import assert_bad, err_text, wait_for
from test_checkpoint import _complete
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


@pytest.mark.extended
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


@pytest.mark.alone
def test_sigterm_saves_within_the_default_grace_when_steps_are_slow(ftrun_home, tmp_path):
    """Steps of 0.5 s, no failure before the signal, the default --shutdown-timeout (5 s): the
    stop reaches every replica within a few steps (the keeper sizes rounds to the pace as soon
    as it knows it, not only at a failure's new quorum: 8 steps a round kept the save past the
    grace, and nothing was written), the last committed step is saved, exit 143."""
    d = tmp_path / "ck"
    run = start_ftrun(["--nproc", 2, "--ft", "--run-id", "slow", "--checkpoint-dir", d, "--checkpoint-every", 50,
                       TRAIN, "--steps", 1000, "--step-sleep", 0.5, "--print-every", 1], files=("stderr",))
    try:
        # past step 16, where the rounds sized once the pace was known (about step 4) began
        wait_for(lambda: _printed_step(ftrun_home, "slow") >= 20, 120, "step 20", run)
        at_signal = _printed_step(ftrun_home, "slow")
        t0 = time.monotonic()
        run.send_signal(signal.SIGTERM)
        code = run.wait(timeout=60)
        took = time.monotonic() - t0
    finally:
        run.kill()
    err = err_text(run)
    assert code == 128 + signal.SIGTERM, (code, err[-3000:])
    assert "no checkpoint was written within" not in err, err[-3000:]
    saved = re.search(rf"ftrun: checkpoint of step (\d+) written to {re.escape(str(d))}/step-(\d+) in", err)
    assert saved and saved.group(1) == saved.group(2), err[-3000:]
    step = int(saved.group(1))
    assert _complete(d) == [step], _complete(d)
    # The step printed last was taken (step N prints after its optimizer step: N + 1 committed at
    # most); the stop comes within a few 0.5 s steps of the signal, not a round of 8 later.
    assert at_signal <= step <= at_signal + 4, (at_signal, step)
    assert took < 10, took  # the 5 s grace, plus ftrun's own exit on a loaded machine
    assert "Traceback" not in err


def _report_steps(q, steps_at, n: int, step_s: float, first: int = 0, quorum: int = 1) -> float:
    """n steps reported by every member at `step_s` each (as the members' info keys say), the
    keeper polling after each; the time reached."""
    t = 0.0
    for i in range(n):
        t = steps_at + (i + 1) * step_s
        for r in q.ranks:
            q._s.set(keys.info_key(r), MemberReport(inc=0, quorum_id=quorum, round=i, phase="compute",
                                                    step=first + i, beat=first + i).encode())
        q.poll(t)
    return t


@pytest.mark.quick
@pytest.mark.parametrize("step_s,rounds", [(0.5, None), (0.1, 2), (0.005, 8)])
def test_keeper_sizes_rounds_to_the_pace_once_it_knows_it(step_s, rounds):
    """A run without failures: its first epoch has rounds of 1 (no pace known yet); once the
    pace is known, they get an epoch of the same members with rounds re-sized, said nowhere,
    and so do rounds far from 0.2 s, once per pace window (it came only with a failure's new
    quorum: 8 steps of 0.6 s kept a SIGTERM's save past the 5 s grace). A slow run keeps its 1."""
    from test_quorum_keeper import _RunStore, _join, _quorum

    q = QuorumKeeper(_RunStore(), [0, 1], settings=KeeperSettings())
    q.on_store_ready()
    for r in range(2):
        _join(q, r, 0)
    q.poll(0.0)
    assert _quorum(q, 1)["round_steps"] == 1
    for r in range(2):
        q._s.set(keys.healed_key(r), "0")  # both hold the state (the source, and its healed peer)
    n = max(8, int(2.0 / step_s))
    t = _report_steps(q, 0.0, n, step_s)
    assert q.quorum_id == (2 if rounds else 1), q.history
    if rounds:
        assert _quorum(q, 2)["round_steps"] == rounds and _quorum(q, 2)["members"] == _quorum(q, 1)["members"]
        assert not _quorum(q, 2)["healers"] and not _quorum(q, 2)["fresh"]
        _report_steps(q, t, n, step_s / 20, first=n, quorum=2)  # far faster now, within the window: not yet
        assert q.quorum_id == 2
    assert q.history == ["quorum 1: 2 replicas (first replicas joined)"], q.history


@pytest.mark.quick
def test_a_resumed_runs_first_report_is_no_pace():
    """A resumed run's replicas first report step 0, then the checkpoint's step: that jump is
    no pace (it made a run of slow steps look fast, and its rounds 8 steps long)."""
    pace = Pace()
    pace.note(0.0, 0)
    pace.note(1.0, 1500)
    pace.note(1.5, 1501)
    assert pace.step_s() is None
    for i in range(2, 6):
        pace.note(1.0 + 0.5 * i, 1500 + i)
    assert pace.step_s() == pytest.approx(0.5)


@pytest.mark.quick
def test_a_checkpoint_written_before_the_loaders_fingerprint_still_fits():
    """A checkpoint an earlier ftrun wrote has no dataset fingerprint in ft.DataLoader's state: the
    field is left out of what is loaded, so the resume is not refused as 'another model' (probed
    for real with a checkpoint of the release before: refused, then resumed); a field the
    checkpoint has, and the user's own state, are left alone."""
    from types import SimpleNamespace

    from ftrun.worker.ft.checkpoint.read import drop_fields_added_since

    old = SimpleNamespace(state_dict_metadata={f"extras.ftrun.data.0.{f}": None for f in ("epoch", "pos", "size")}
                          | {"extras.mine.fingerprint": None})
    target = {"extras": {"ftrun.data.0": {"epoch": 0, "pos": 0, "size": 48, "fingerprint": "ab"},
                         "mine": {"fingerprint": "cd"}}}
    drop_fields_added_since(target, old)
    assert target["extras"]["ftrun.data.0"] == {"epoch": 0, "pos": 0, "size": 48}
    assert target["extras"]["mine"] == {"fingerprint": "cd"}
    new = SimpleNamespace(state_dict_metadata=dict(old.state_dict_metadata, **{"extras.ftrun.data.0.fingerprint": None}))
    target = {"extras": {"ftrun.data.0": {"epoch": 0, "fingerprint": "ab"}}}
    drop_fields_added_since(target, new)
    assert target["extras"]["ftrun.data.0"] == {"epoch": 0, "fingerprint": "ab"}
