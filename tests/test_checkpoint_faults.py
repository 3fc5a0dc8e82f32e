"""Checkpoints under the faults a long run meets, through the real CLI: a full disk (a small
tmpfs, mounted as root), damaged files, two runs on one folder, pre-emption by SIGTERM and
SIGINT (mid-save included), another optimizer's checkpoint, a folder past the loop's end.
"""

from __future__ import annotations

import json
import re
import signal
import threading
import time
from pathlib import Path

import pytest

from conftest import SCRIPTS, run_ftrun, start_ftrun
from helpers import err_text, fill_disk, small_tmpfs, status_record, wait_for
from test_checkpoint import _assert_bitwise, _complete, _final_state, _kill_everything

TRAIN = SCRIPTS / "train_ft.py"
SMALL = ["--dim", 64, "--hidden", 224, "--depth", 2, "--optim", "adam"]  # 0.85 MB of checkpoint
# 21M parameters with Adam: 252 MB of model and optimizer state per replica.
AT_SIZE = ["--dim", 2048, "--hidden", 2048, "--depth", 5, "--optim", "adam", "--lr", 0.0005]


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs: a disk that fills up."""
    with small_tmpfs(tmp_path / "small") as mnt:
        yield mnt


def _checkpoint_status(home: Path, run_id: str) -> dict:
    """`ftrun status --json`'s checkpoint record of the run ({} while there is none to read)."""
    r = run_ftrun(["status", run_id, "--json"], timeout=30, env={"FTRUN_HOME": str(home)})
    try:
        return json.loads(r.stdout)[0].get("checkpoint") or {}
    except (ValueError, IndexError, AttributeError):
        return {}


def _log(home: Path, run_id: str, rank: int = 0, stream: str = "stderr") -> str:
    path = home / run_id / "logs" / f"rank{rank}" / f"{stream}.log"
    return path.read_text(errors="replace") if path.exists() else ""


def _printed_step(home: Path, run_id: str) -> int:
    steps = [int(m) for m in re.findall(r"^step (\d+) loss", _log(home, run_id, 0, "stdout"), re.M)]
    return max(steps, default=-1)


def _no_partials(d: Path) -> list:
    return [p.name for p in d.iterdir() if p.name.endswith(".partial")]


# ---------------------------------------------------------------------------- a full disk

def test_full_disk_from_the_start_never_hangs(ftrun_home, small_disk):
    """One replica on a disk with no room at all: every save fails in one line, training goes
    on to the end (the old writer thread died at the first failure and the next save waited
    for ever), the last step's save is tried three times, and the run's last lines say so,
    with exit 0: the training itself succeeded."""
    d = small_disk / "ck"
    d.mkdir()
    fill_disk(small_disk)
    r = run_ftrun(["--nproc", 1, "--ft", "--run-id", "full", "--checkpoint-dir", d, "--checkpoint-every", 10,
                   TRAIN, *SMALL, "--steps", 60, "--print-every", 100], timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    failed = [line for line in r.stderr.splitlines() if "not written" in line]
    assert len(failed) == 8, r.stderr  # steps 10..60, and two more tries of step 60
    assert all("is full or over quota" in line and line.count("\n") == 0 for line in failed), failed
    assert "Traceback" not in r.stderr and "CheckpointException" not in r.stderr, r.stderr[-3000:]
    last = [line for line in r.stderr.splitlines() if line.strip()][-2:]
    assert last[0].startswith("ftrun: the checkpoint of the last step (60) could not be written"), last
    # six saves (steps 10..60) failed: the retries of step 60 are that one save tried again
    assert last[1] == "ftrun: 6 checkpoint saves failed in this run; no checkpoint was written", last
    assert _no_partials(d) == [] and _complete(d) == []
    ck = status_record("full", ftrun_home)["checkpoint"]
    assert ck["failed_total"] == 6 and ck["failed_since"] == 6 and ck["last_failure"]["final"], ck


def test_full_disk_mid_run_recovers_and_no_replica_is_killed(ftrun_home, small_disk):
    """Two replicas; the disk fills up after the first checkpoints: each failed save is one
    line, `ftrun status` counts the failures since the last good checkpoint, no partial
    folder stays, no replica is stopped or killed as hung; once space is back the next save
    writes. Then the disk fills again and the run is stopped with SIGTERM: the save before
    stopping fails in one line, and ftrun exits with the usual status."""
    d = small_disk / "ck"
    run = start_ftrun(["--nproc", 2, "--ft", "--run-id", "fills", "--checkpoint-dir", d, "--checkpoint-every", 10,
                  TRAIN, *SMALL, "--steps", 100_000, "--step-sleep", 0.02, "--print-every", 100_000], files=("stderr",))
    try:
        wait_for(lambda: (d / "step-20" / "ftrun.json").exists(), 90, "the checkpoint of step 20", run)
        filler = fill_disk(small_disk)
        wait_for(lambda: err_text(run).count("not written") >= 2, 90, "two failed saves", run)
        # `ftrun status` follows within a fraction of a second (the supervisor reads the store a few times a second)
        wait_for(lambda: _checkpoint_status(ftrun_home, "fills").get("failed_since", 0) >= 2, 30,
                 "two failed saves in ftrun status", run)
        ck = status_record("fills", ftrun_home)["checkpoint"]
        assert ck["step"] >= 20 and "full or over quota" in ck["last_failure"]["why"], ck
        failed_steps = [int(s) for s in re.findall(r"checkpoint of step (\d+) not written", err_text(run))]
        filler.unlink()
        wait_for(lambda: any(s > max(failed_steps) for s in _complete(d)), 90, "a checkpoint after the failures", run)
        wait_for(lambda: _checkpoint_status(ftrun_home, "fills").get("failed_since") == 0, 30,
                 "the new checkpoint in ftrun status", run)
        ck = status_record("fills", ftrun_home)["checkpoint"]
        assert ck["failed_total"] >= 2, ck
        # The run goes on saving: the next save's partial folder may be there (1 in 8 looks saw one,
        # on 2 loaded cores). None is left by a failed save, and each one there now goes.
        partials = _no_partials(d)
        assert not [p for p in partials for s in failed_steps if p.startswith(f".step-{s}.")], partials
        wait_for(lambda: not set(partials) & set(_no_partials(d)), 90, f"{partials} published or removed", run)
        fill_disk(small_disk)
        seen = err_text(run).count("not written")
        wait_for(lambda: err_text(run).count("not written") > seen, 90, "a failed save on the full disk again", run)
        run.send_signal(signal.SIGTERM)
        assert run.wait(timeout=60) == 128 + signal.SIGTERM, err_text(run)[-3000:]
    finally:
        run.kill()
    err = err_text(run)
    assert "failed before stopping" in err, err[-3000:]
    assert not re.search(r"hung|restarting|Traceback|CheckpointException", err), err[-3000:]
    assert _no_partials(d) == [], list(d.iterdir())


# ---------------------------------------------------------------------------- damaged files

def _flip(path: Path, at: float, n: int = 4096) -> None:
    """Invert `n` bytes from `at` (a fraction of the file), the size unchanged."""
    size = path.stat().st_size
    start = int(size * at)
    with open(path, "r+b") as f:
        f.seek(start)
        block = f.read(min(n, size - start))
        f.seek(start)
        f.write(bytes(b ^ 0xFF for b in block))
    assert path.stat().st_size == size


def test_damaged_content_falls_back_to_the_newest_good_checkpoint(ftrun_home, tmp_path):
    """Four checkpoints damaged four ways at the same size or shorter: the first 4 KiB of the
    data file zeroed (torch raised a BaseException the old resume did not catch), a block
    flipped mid-file (it loaded silently: only a checksum finds it), the data file
    truncated, a block of .metadata flipped. Each is moved aside with one line, the fifth
    loads, and the run ends bitwise equal to one never interrupted."""
    d = tmp_path / "ck"

    def cmd(folder, steps, out=None):
        return (["--nproc", 1, "--ft", "--run-id", "dmg", "--checkpoint-dir", folder, "--checkpoint-every", 10,
                 "--checkpoint-keep", 5, TRAIN, *SMALL, "--steps", steps, "--print-every", 1000]
                + (["--out", out] if out else []))

    ref = start_ftrun(cmd(tmp_path / "ref-ck", 60, tmp_path / "ref"), env={"FTRUN_HOME": str(tmp_path / "ref-home")},
                      files=("stderr",))
    first = run_ftrun(cmd(d, 50), timeout=120)
    assert first.returncode == 0 and _complete(d) == [10, 20, 30, 40, 50], (_complete(d), first.stderr[-2000:])
    data = "__0_0.distcp"
    with open(d / "step-50" / data, "r+b") as f:
        f.write(b"\0" * 4096)
    _flip(d / "step-40" / data, 0.5)
    with open(d / "step-30" / data, "r+b") as f:
        f.truncate((d / "step-30" / data).stat().st_size * 2 // 3)
    _flip(d / "step-20" / ".metadata", 0.5, 64)

    again = run_ftrun(cmd(d, 60, tmp_path / "out"), timeout=120)
    assert again.returncode == 0, again.stderr[-3000:]
    damaged = [line for line in again.stderr.splitlines() if "is damaged" in line]
    assert len(damaged) == 4, again.stderr
    for step, why in ((50, f"{data} is damaged at byte 0"), (40, f"{data} is damaged at byte"),
                      (30, f"{data} is truncated"), (20, ".metadata does not match its checksum")):
        line = next(x for x in damaged if f"/step-{step} is damaged" in x)
        assert why in line and f"moved aside to {d}/step-{step}.damaged" in line, line
        assert (d / f"step-{step}.damaged").is_dir()
    assert f"resumed from checkpoint {d}/step-10 at step 10" in again.stderr, again.stderr[-3000:]
    assert "Traceback" not in again.stderr
    assert ref.wait(timeout=120) == 0, err_text(ref)[-2000:]
    _assert_bitwise(_final_state(tmp_path / "ref", [0]), _final_state(tmp_path / "out", [0]))


def test_pruning_keeps_the_new_run_and_never_counts_damaged_ones(ftrun_home, tmp_path):
    """Damaged step-30 and step-60 in the folder (the old pruning kept the two highest steps
    with an ftrun.json, and deleted each checkpoint a new run wrote right after writing it).
    The new run says on the console that it starts from the first step, and ends with its
    own newest two checkpoints, the damaged ones moved aside."""
    d = tmp_path / "ck"

    def cmd(run_id, steps, every):
        return ["--nproc", 1, "--ft", "--run-id", run_id, "--checkpoint-dir", d, "--checkpoint-every", every,
                "--checkpoint-keep", 2, TRAIN, "--steps", steps, "--print-every", 1000]

    assert run_ftrun(cmd("old", 60, 30), timeout=120).returncode == 0 and _complete(d) == [30, 60]
    (d / "step-60" / ".metadata").write_bytes(b"not a pickle")
    data = d / "step-30" / "__0_0.distcp"
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size // 2)
    new = run_ftrun(cmd("new", 40, 10), timeout=120)
    assert new.returncode == 0, new.stderr[-3000:]
    assert f"none of the 2 checkpoint(s) in {d} could be used (damaged or unreadable): starting from the first " \
           f"step" in new.stderr, new.stderr[-3000:]
    assert _complete(d) == [30, 40], sorted(p.name for p in d.iterdir())
    assert json.loads((d / "step-30" / "ftrun.json").read_text())["run_id"] == "new"
    assert (d / "step-30.damaged").is_dir() and (d / "step-60.damaged").is_dir()


# ---------------------------------------------------------------------------- two runs, one folder

@pytest.mark.extended
def test_two_runs_on_one_folder(ftrun_home, tmp_path):
    """A second live run on a folder in use is refused in one line (exit 2) naming the run that
    holds it, and starts nothing; a run SIGKILLed whole never blocks the next one; a lock of
    another host is refused while its holder renews its lease, and taken over once it stops."""
    d = tmp_path / "ck"

    def cmd(run_id, steps=100_000):
        return ["--nproc", 1, "--ft", "--run-id", run_id, "--checkpoint-dir", d, "--checkpoint-every", 10,
                TRAIN, "--steps", steps, "--step-sleep", 0.01, "--print-every", 100_000]

    first = start_ftrun(cmd("first"), files=("stderr",))
    try:
        wait_for(lambda: (d / "step-10").is_dir(), 90, "a first checkpoint", first)
        second = run_ftrun(cmd("second"), timeout=60)
        lines = [line for line in second.stderr.splitlines() if line.strip()]
        assert second.returncode == 2 and len(lines) == 1, second.stderr
        assert lines[0].startswith(f"ftrun: error: --checkpoint-dir {d} is in use by run first (pid {first.pid} on host")
        assert not (ftrun_home / "second").exists(), "the refused run started something"
        _kill_everything(first)
    finally:
        first.kill()
    newest = _complete(d)[-1]
    third = run_ftrun(cmd("third", newest + 5), timeout=120)
    assert third.returncode == 0, third.stderr[-3000:]
    assert f"resumed from checkpoint {d}/step-{newest} at step {newest}" in third.stderr, third.stderr[-3000:]

    lock = d / ".ftrun.lock"
    record = {"run_id": "elsewhere", "host": "another-host", "pid": 4242, "pid_start": 0.0, "since": time.time(),
              "renewed_at": time.time(), "renewals": 0}
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(1.0):
            record["renewals"] += 1
            record["renewed_at"] = time.time()
            lock.write_text(json.dumps(record).ljust(1024))

    lock.write_text(json.dumps(record).ljust(1024))
    renewer = threading.Thread(target=renew, daemon=True)
    renewer.start()
    try:
        live = run_ftrun(cmd("fourth", newest + 5), timeout=60)
    finally:
        stop.set()
        renewer.join()
    assert live.returncode == 2 and "is in use by run elsewhere (pid 4242 on host another-host" in live.stderr, \
        live.stderr
    t0 = time.monotonic()
    dead = run_ftrun(cmd("fifth", newest + 5), timeout=120)
    assert dead.returncode == 0, dead.stderr[-3000:]
    assert "was held by run elsewhere (pid 4242 on host another-host" in dead.stderr and "taking it over" in dead.stderr
    assert time.monotonic() - t0 < 60


# ---------------------------------------------------------------------------- pre-emption

@pytest.mark.extended
def test_sigterm_saves_the_last_step_and_the_next_run_resumes_exactly(ftrun_home, tmp_path):
    """21M parameters with Adam, two replicas, no periodic checkpoint before the signal: SIGTERM
    (how Slurm and Kubernetes pre-empt) writes a checkpoint of the last committed step before
    the workers stop, within --shutdown-timeout, and ftrun exits 143; the same command run
    again resumes from exactly that step and ends bitwise equal to a run never stopped."""
    d = tmp_path / "ck"

    def cmd(run_id, folder, out):
        return ["--nproc", 2, "--ft", "--run-id", run_id, "--checkpoint-dir", folder, "--checkpoint-every", 1000,
                "--shutdown-timeout", 60, TRAIN, *AT_SIZE, "--steps", 24, "--print-every", 1, "--out", out]

    ref = start_ftrun(cmd("ref", tmp_path / "ref-ck", tmp_path / "ref"), env={"FTRUN_HOME": str(tmp_path / "ref-home")},
                      files=("stderr",))
    run = start_ftrun(cmd("pre", d, tmp_path / "out"), files=("stderr",))
    try:
        wait_for(lambda: _printed_step(ftrun_home, "pre") >= 6, 180, "step 6", run)
        t0 = time.monotonic()
        run.send_signal(signal.SIGTERM)
        code = run.wait(timeout=90)
        took = time.monotonic() - t0
    finally:
        run.kill()
    err = err_text(run)
    assert code == 128 + signal.SIGTERM, (code, err[-3000:])
    saved = re.search(rf"ftrun: checkpoint of step (\d+) written to {re.escape(str(d))}/step-(\d+) in", err)
    assert saved and saved.group(1) == saved.group(2), err[-3000:]
    step = int(saved.group(1))
    assert 6 <= step < 24 and _complete(d) == [step], (step, _complete(d))
    assert took < 60, took
    assert "Traceback" not in err
    resumed = run_ftrun(cmd("pre", d, tmp_path / "out"), timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from checkpoint {d}/step-{step} at step {step}" in resumed.stderr, resumed.stderr[-3000:]
    assert ref.wait(timeout=300) == 0, err_text(ref)[-3000:]
    _assert_bitwise(_final_state(tmp_path / "ref", range(2)), _final_state(tmp_path / "out", range(2)))


def test_sigint_mid_save_and_sigterm_at_start(ftrun_home, tmp_path):
    """SIGINT (Ctrl-C) while a periodic checkpoint is still being written: the save before
    stopping waits for it, then writes the last committed step; the console has ftrun's
    lines only (no KeyboardInterrupt traceback from every rank; each rank's log says where
    it stopped, in one line); exit 130; the next run resumes from that step. SIGTERM before
    the replicas have joined: nothing to save, one line, exit 143."""
    d = tmp_path / "ck"

    def cmd(run_id, steps=100_000):
        return ["--nproc", 2, "--ft", "--run-id", run_id, "--checkpoint-dir", d, "--checkpoint-every", 10,
                "--shutdown-timeout", 30, TRAIN, "--steps", steps, "--step-sleep", 0.01, "--print-every", 100_000]

    early = start_ftrun(cmd("early"), files=("stderr",))
    wait_for(lambda: "2 workers of" in err_text(early), 90, "the run's first line", early)  # its workers are starting
    early.send_signal(signal.SIGTERM)
    assert early.wait(timeout=30) == 128 + signal.SIGTERM
    assert "received SIGTERM: stopping all workers" in err_text(early) and "Traceback" not in err_text(early), err_text(early)
    assert _complete(d) == []

    run = start_ftrun(cmd("int"), env={"FTRUN_CHECKPOINT_INJECT_DELAY": "10:3"}, files=("stderr",))
    try:
        wait_for(lambda: "holding checkpoint" in _log(ftrun_home, "int"), 90, "the checkpoint of step 10 held", run)
        run.send_signal(signal.SIGINT)
        code = run.wait(timeout=60)
    finally:
        run.kill()
    err = err_text(run)
    assert code == 128 + signal.SIGINT, (code, err[-3000:])
    assert "received SIGINT: saving a checkpoint of the last committed step" in err, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    saved = re.search(rf"ftrun: checkpoint of step (\d+) written to {re.escape(str(d))}/step-\d+ in", err)
    assert saved, err[-3000:]
    step = int(saved.group(1))
    assert step >= 10 and _complete(d)[-1] == step, (step, _complete(d))
    assert "checkpoint of step 10 written to" in _log(ftrun_home, "int")  # the save held mid-write ended first
    for rank in range(2):
        stopped = [line for line in _log(ftrun_home, "int", rank).splitlines() if "stopped by SIGINT" in line]
        assert len(stopped) == 1 and "train_ft.py line" in stopped[0], stopped
    again = run_ftrun(cmd("int", step + 3), timeout=120)
    assert again.returncode == 0 and f"resumed from checkpoint {d}/step-{step} at step {step}" in again.stderr, \
        again.stderr[-3000:]


# ---------------------------------------------------------------------------- another optimizer, a folder past the end

@pytest.mark.extended
def test_other_optimizer_refused_and_folder_past_the_end(ftrun_home, tmp_path):
    """An AdamW run on an Adam checkpoint (same tensors: the old resume took it silently, and
    with it Adam's settings) ends at once in one line, exit 2. `--steps 20` on a folder at
    step 30 says that the folder is past the end the loop asks for."""
    d = tmp_path / "ck"

    def cmd(optim, steps):
        return ["--nproc", 1, "--ft", "--checkpoint-dir", d, "--checkpoint-every", 10, TRAIN, "--dim", 64,
                "--hidden", 224, "--optim", optim, "--steps", steps, "--print-every", 1000]

    assert run_ftrun(cmd("adam", 30), timeout=120).returncode == 0 and _complete(d) == [20, 30]
    other = run_ftrun(cmd("adamw", 40), timeout=120)
    assert other.returncode == 2, other.stderr[-3000:]
    lines = [line for line in other.stderr.splitlines() if "does not fit this run" in line]
    assert len(lines) == 1 and "it was written with optimizer Adam, this run uses AdamW" in lines[0], other.stderr
    assert "Traceback" not in other.stderr
    past = run_ftrun(cmd("adam", 20), timeout=120)
    assert past.returncode == 0, past.stderr[-3000:]
    assert f"resumed from checkpoint {d}/step-30 at step 30 (written" in past.stderr and \
        "that is past the 20 steps the loop asks for (ft.steps(20))" in past.stderr, past.stderr[-3000:]
    assert "done at step 30" in past.stdout
