"""The launcher core through the real CLI: training, restarts, failure reports, signals, hangs."""

from __future__ import annotations

import json
import os
import signal
import time

import psutil
import pytest
import torch

from conftest import SCRIPTS, really_alive, run_ftrun, start_ftrun, wait_for_line
from helpers import load_params

TRAIN = SCRIPTS / "train_ddp.py"


def test_two_workers_train_to_identical_parameters(ftrun_home, tmp_path):
    out = tmp_path / "p"
    proc = run_ftrun(["--nproc", 2, TRAIN, "--steps", 30, "--out", out])
    assert proc.returncode == 0, proc.stderr
    p0, p1 = load_params(out, 2)
    for k in p0:
        assert torch.equal(p0[k], p1[k]), k
    # every console line of a worker carries its rank
    worker_lines = [l for l in proc.stdout.splitlines() if "loss" in l]
    assert worker_lines and all(l.startswith(("[rank 0]", "[rank 1]")) for l in worker_lines)
    assert any(l.startswith("[rank 1]") for l in worker_lines)
    # the loss went down
    last = json.loads(open(f"{out}.rank0.json").read())["loss"]
    first = float(worker_lines[0].split()[-1])
    assert last < first / 4


def test_per_rank_logs_and_rank_filter(ftrun_home, tmp_path):
    logs = tmp_path / "logs"
    proc = run_ftrun(["--nproc", 2, "--ranks", "1", "--log-dir", logs, TRAIN, "--steps", 5, "--print-every", 1])
    assert proc.returncode == 0, proc.stderr
    assert "[rank 0]" not in proc.stdout and "[rank 1] step 4" in proc.stdout
    for r in (0, 1):
        assert f"step 4" in (logs / f"rank{r}" / "stdout.log").read_text()
    quiet = run_ftrun(["--nproc", 2, "--quiet", TRAIN, "--steps", 3])
    assert quiet.returncode == 0 and "[rank" not in quiet.stdout + quiet.stderr
    assert "ftrun:" in quiet.stderr


@pytest.mark.quick
def test_failure_restarts_group_and_script_resumes(ftrun_home, tmp_path):
    ckpt = tmp_path / "ckpt.pt"
    out = tmp_path / "p"
    proc = run_ftrun(["--nproc", 2, "--max-restarts", 2, TRAIN, "--steps", 20, "--ckpt", ckpt,
                      "--fail-rank", 1, "--fail-step", 12, "--out", out])
    assert proc.returncode == 0, proc.stderr
    assert "restarting all 2 workers (restart 1 of 2)" in proc.stderr
    assert "injected failure at step 12" in proc.stderr
    assert "resumed from step 10" in proc.stdout
    p0, p1 = load_params(out, 2)
    assert all(torch.equal(p0[k], p1[k]) for k in p0)


def test_budget_spent_exits_with_worker_code_and_reports(ftrun_home, tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(
        "import atexit, os, sys, time\n"
        "atexit.register(lambda: print('ftrun: rank 1: a line written at exit', file=sys.stderr))\n"
        "if os.environ['RANK'] == '1':\n"
        "    raise ValueError('bad batch shape')\n"
        "time.sleep(30)\n")
    proc = run_ftrun(["--nproc", 2, "--max-restarts", 1, "--shutdown-timeout", 2, script], timeout=60)
    assert proc.returncode == 1, proc.stderr
    err = proc.stderr
    assert "restart 1 of 1" in err
    assert "rank 1" in err and "failed first" in err
    # the exception is named, not a line the process wrote after it (ftrun's figures at exit)
    assert "exited 1 with a traceback: ValueError: bad batch shape" in err
    assert "full log:" in err
    # exit code of the script is passed through
    script.write_text("import os, sys\nsys.exit(7 if os.environ['RANK'] == '0' else 0)\n")
    proc = run_ftrun(["--nproc", 2, script], timeout=60)
    assert proc.returncode == 7 and "exited with code 7" in proc.stderr


def test_signal_death_is_named(ftrun_home, tmp_path):
    script = tmp_path / "segv.py"
    script.write_text("import os, signal\nif os.environ['RANK'] == '0':\n    os.kill(os.getpid(), signal.SIGKILL)\n")
    proc = run_ftrun(["--nproc", 2, script], timeout=60)
    assert proc.returncode == 128 + 9
    # a SIGKILL ftrun did not send is not put on the out-of-memory killer without evidence
    assert "killed by SIGKILL (signal 9; sent from outside ftrun)" in proc.stderr, proc.stderr
    assert "out-of-memory" not in proc.stderr


def test_a_worker_that_never_reported_does_not_stall_the_loop(ftrun_home, tmp_path):
    """No worker writes a progress report (every write fails by injection) and rank 0 exits 3
    after a second: the failure is seen at once. A read of a progress key before ftrun seeded it
    waits out the store's 60 s timeout, with the supervisor's loop stopped behind it: the run
    would last over 60 s; on a loaded machine the start alone took 36 s once, hence 55."""
    script = tmp_path / "late.py"
    script.write_text("import os, sys, time\ntime.sleep(1)\nsys.exit(3 if os.environ['RANK'] == '0' else 0)\n")
    start = time.time()
    proc = run_ftrun(["--nproc", 2, script], timeout=120, env={"FTRUN_INJECT_PROGRESS_FAIL": "1:1000"})
    assert proc.returncode == 3, proc.stderr
    assert time.time() - start < 55, proc.stderr
    failure = json.loads((ftrun_home / os.listdir(ftrun_home)[0] / "state.json").read_text())["failures"][0]
    assert failure["detect_s"] < 5, failure


def _worker_pids(sup_pid: int, n: int, timeout: float = 30.0):
    """Pids of the processes running the workers (children of the supervisor's zygote)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        procs = [p for p in psutil.Process(sup_pid).children(recursive=True) if p.ppid() != sup_pid]
        if len(procs) >= n:
            return procs
        time.sleep(0.05)
    raise AssertionError("workers did not start")


def test_sigkill_of_supervisor_leaves_no_worker(ftrun_home):
    proc = start_ftrun(["--nproc", 2, TRAIN, "--steps", 100000, "--print-every", 50])
    try:
        wait_for_line(proc, "step 50")
        workers = _worker_pids(proc.pid, 2)
        everything = psutil.Process(proc.pid).children(recursive=True)
        assert len(workers) >= 2
        proc.send_signal(signal.SIGKILL)
        proc.wait(5)
        alive = really_alive(everything, 1.0)
        assert not alive, f"still alive after 1 s: {[p.pid for p in alive]}"
    finally:
        proc.kill()


@pytest.mark.alone
def test_sigint_stops_workers_and_exits_130(ftrun_home, tmp_path):
    proc = start_ftrun(["--nproc", 2, "--shutdown-timeout", 3, TRAIN, "--steps", 100000, "--print-every", 50])
    try:
        wait_for_line(proc, "step 50")
        everything = psutil.Process(proc.pid).children(recursive=True)
        t0 = time.time()
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(10)
        took = time.time() - t0
        assert rc == 130
        assert took < 3 + 1.5, took
        assert not really_alive(everything, 1.0)
    finally:
        proc.kill()


def test_sigterm_ignored_by_worker_is_killed_after_grace(ftrun_home, tmp_path):
    script = tmp_path / "stubborn.py"
    script.write_text("import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                      "print('ready', flush=True)\ntime.sleep(300)\n")
    proc = start_ftrun(["--nproc", 1, "--shutdown-timeout", 1, script])
    try:
        wait_for_line(proc, "ready")
        t0 = time.time()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 128 + signal.SIGTERM
        assert 0.9 < time.time() - t0 < 4
    finally:
        proc.kill()


def test_hung_worker_is_detected_dumped_and_restarted(ftrun_home, tmp_path):
    logs = tmp_path / "logs"
    proc = run_ftrun(["--nproc", 2, "--max-restarts", 1, "--step-timeout", 2, "--log-dir", logs,
                      TRAIN, "--steps", 40, "--hang-rank", 1, "--hang-step", 5, "--step-sleep", 0.02], timeout=90)
    assert proc.returncode == 0, proc.stderr
    assert "hung (no optimizer step or other progress for 2 s)" in proc.stderr
    assert "restarting all 2 workers" in proc.stderr
    stacks = logs / "rank1" / "stacks.log"
    assert f"its Python stacks go to {stacks}" in proc.stderr, proc.stderr
    dump = stacks.read_text()
    assert "Thread" in dump and "train_ddp.py" in dump  # faulthandler's stack dump names the script
    # The dump is for the log folder: the console gets the one line naming the file.
    assert "Thread 0x" not in proc.stderr and "File " not in proc.stderr, proc.stderr


# Every rank says which stopping signal it got and carries on (only SIGKILL ends it), except
# with "fail": then rank 1 of the first attempt fails once rank 0 is ready. A later attempt
# writes when it started and exits 0.
STUBBORN = """\
import os, signal, sys, time
mode, mark = sys.argv[1], sys.argv[2]
rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
if attempt:
    with open(os.path.join(mark, f"attempt{attempt}.rank{rank}"), "w") as f:
        f.write(repr(time.time()))
    sys.exit(0)
if mode == "fail" and rank == 1:
    deadline = time.time() + 60
    while not os.path.exists(os.path.join(mark, "ready0")) and time.time() < deadline:
        time.sleep(0.01)
    with open(os.path.join(mark, "failed"), "w") as f:
        f.write(repr(time.time()))
    sys.exit(3)
for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, lambda s, _f: print(f"got {signal.Signals(s).name}", flush=True))
open(os.path.join(mark, f"ready{rank}"), "w").close()
print("ready", flush=True)
time.sleep(300)
"""


def test_group_restart_kills_a_worker_that_ignores_sigterm_after_the_grace(ftrun_home, tmp_path):
    """The group's stop is a state of the agent's loop: the grace ends in SIGKILL, then the restart goes on."""
    script = tmp_path / "stubborn.py"
    script.write_text(STUBBORN)
    grace = 1.5
    proc = run_ftrun(["--nproc", 2, "--max-restarts", 1, "--shutdown-timeout", grace, script, "fail", tmp_path],
                     timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "restarting all 2 workers (restart 1 of 1)" in proc.stderr
    assert "[rank 0] got SIGTERM" in proc.stdout
    failed = float((tmp_path / "failed").read_text())
    restarted = min(float((tmp_path / f"attempt1.rank{r}").read_text()) for r in (0, 1))
    assert grace <= restarted - failed < grace + 8, restarted - failed


@pytest.mark.parametrize("mode", ["stop", "fail"])
def test_a_signal_during_the_grace_kills_at_once(ftrun_home, tmp_path, mode):
    """A second SIGINT while the workers stop (mode "stop"), or a SIGINT while the group stops to
    restart (mode "fail"), SIGKILLs them now instead of after the grace; no attempt follows."""
    script = tmp_path / "stubborn.py"
    script.write_text(STUBBORN)
    proc = start_ftrun(["--nproc", 2, "--max-restarts", 1, "--shutdown-timeout", 60, script, mode, tmp_path])
    try:
        if mode == "stop":
            wait_for_line(proc, "ready")
            wait_for_line(proc, "ready")
            proc.send_signal(signal.SIGINT)
            wait_for_line(proc, "got SIGINT")  # the stop has begun: its grace is 60 s
        else:
            wait_for_line(proc, "got SIGTERM")  # rank 1 failed, the group is stopping to restart
        everything = psutil.Process(proc.pid).children(recursive=True)
        t0 = time.time()
        proc.send_signal(signal.SIGINT)
        err = proc.communicate(timeout=30)[1]
        assert proc.returncode == 130, err
        assert time.time() - t0 < 10
        assert not really_alive(everything, 1.0)
        assert not list(tmp_path.glob("attempt1.*"))
        assert "received SIGINT: no more grace, killing the workers now" in err or mode == "fail", err
        assert "received SIGINT: no restart; no more grace" in err or mode == "stop", err
    finally:
        proc.kill()
