"""Failures that used to be quiet: each one now ends the run promptly, or not at all, and says why."""

from __future__ import annotations

import re
import sys
import subprocess
import time

import psutil
import pytest

from conftest import FTRUN, really_alive, run_ftrun, start_ftrun, wait_for_line

PROGRESS = """\
import sys, time, torch
mode, seconds = sys.argv[1], float(sys.argv[2])
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
def step():
    opt.zero_grad(); model(torch.randn(4, 8)).sum().backward(); opt.step()
for _ in range(3):
    step()
end = time.time() + seconds
if mode == "train":        # optimizer steps all along
    while time.time() < end:
        step(); time.sleep(0.01)
elif mode == "eval":       # a long evaluation: forward passes, no optimizer step
    with torch.no_grad():
        while time.time() < end:
            model(torch.randn(4, 8)); time.sleep(0.01)
elif mode == "hang":       # no progress of any kind
    while time.time() < end:
        time.sleep(0.1)
print("done", flush=True)
"""


@pytest.fixture
def progress_script(tmp_path):
    path = tmp_path / "progress.py"
    path.write_text(PROGRESS)
    return path


def test_heartbeat_survives_store_errors(ftrun_home, progress_script):
    # Writes 4-6 of the heartbeat fail: the reporter used to stop for good, and the
    # healthy worker was killed as hung once --step-timeout passed.
    proc = run_ftrun(["--nproc", 1, "--step-timeout", 1.5, progress_script, "train", 3.5],
                     env={"FTRUN_INJECT_PROGRESS_FAIL": "4:3"}, timeout=90)
    assert "injected store error" in proc.stderr and "retrying" in proc.stderr  # the fault did happen
    assert proc.returncode == 0, proc.stderr
    assert "hung" not in proc.stderr
    assert "done" in proc.stdout


def test_long_evaluation_is_progress_a_real_hang_is_not(ftrun_home, progress_script):
    ok = run_ftrun(["--nproc", 1, "--step-timeout", 1.5, progress_script, "eval", 3.5], timeout=90)
    assert ok.returncode == 0, ok.stderr
    assert "hung" not in ok.stderr
    hung = run_ftrun(["--nproc", 1, "--step-timeout", 1.5, progress_script, "hang", 30], timeout=90)
    assert hung.returncode != 0
    assert "hung (no optimizer step or other progress for 1.5 s)" in hung.stderr
    assert "done" not in hung.stdout


def test_malformed_zygote_message_is_reported_once_and_skipped(ftrun_home, tmp_path):
    script = tmp_path / "hello.py"
    script.write_text("import os\nprint('hello from', os.environ['RANK'], flush=True)\n")
    # The zygote sends garbage before its first exit report: the reader used to die on it,
    # and the supervisor then waited forever for exits it would never hear of.
    proc = run_ftrun(["--nproc", 2, script], env={"FTRUN_INJECT_ZYGOTE_GARBAGE": "1"}, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("ignored a malformed message from the zygote") == 1, proc.stderr
    assert "finished" in proc.stderr


@pytest.mark.alone
def test_sigkill_of_the_zygote_ends_the_run_at_once(ftrun_home, tmp_path):
    script = tmp_path / "wait.py"
    script.write_text("import os, time\nprint('ready', os.environ['RANK'], flush=True)\ntime.sleep(300)\n")
    proc = start_ftrun(["--nproc", 2, script])
    try:
        wait_for_line(proc, "ready")
        wait_for_line(proc, "ready")
        zygotes = [p for p in psutil.Process(proc.pid).children() if "ftrun zygote" in " ".join(p.cmdline())]
        assert len(zygotes) == 1
        workers = zygotes[0].children()
        assert len(workers) == 2
        t0 = time.time()
        zygotes[0].kill()
        rc = proc.wait(30)
        took = time.time() - t0
        err = proc.stderr.read()
        assert rc == 1, err
        assert took < 5, (took, err)
        assert f"the zygote (pid {zygotes[0].pid}) was killed by SIGKILL; workers lost with it: rank 0, 1" in err
        assert not really_alive(workers, 2.0)
    finally:
        proc.kill()
        proc.wait()


LEAVER = """\
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import os, signal, sys, time; os.setsid(); "
                          "signal.signal(signal.SIGTERM, signal.SIG_IGN); print('set', flush=True); time.sleep(600)"],
                         stdout=subprocess.PIPE, text=True)
assert child.stdout.readline().strip() == "set"
print("grandchild", child.pid, flush=True)
"""


@pytest.mark.parametrize("how", ["zygote", "no-python"])
def test_a_grandchild_that_escapes_its_session_is_killed_at_the_end(ftrun_home, tmp_path, how):
    script = tmp_path / "leaver.py"
    script.write_text(LEAVER)
    args = ["--nproc", 1, script] if how == "zygote" else ["--nproc", 1, "--no-python", sys.executable, script]
    proc = run_ftrun(args, timeout=60)
    assert proc.returncode == 0, proc.stderr
    pid = int(next(l for l in proc.stdout.splitlines() if "grandchild" in l).split()[-1])
    try:
        p = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return  # killed and reaped
    alive = really_alive([p], 5.0)
    for q in alive:
        q.kill()  # no test run may leave it behind either
    assert not alive, f"pid {pid} outlived the run"


EARLY = """\
import datetime, os, torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
t = torch.ones(4)
dist.all_reduce(t)
if dist.get_rank() == 1:
    raise SystemExit(0)   # a rank that leaves while its peers still need it
dist.all_reduce(t)        # rank 0: fails once rank 1 is gone
"""


@pytest.mark.alone  # which exit the supervisor sees first is a race another test beside it can tip
def test_report_names_the_rank_that_left_early(ftrun_home, tmp_path):
    script = tmp_path / "early.py"
    script.write_text(EARLY)
    proc = run_ftrun(["--nproc", 2, script], timeout=90)
    assert proc.returncode != 0
    report = proc.stderr[proc.stderr.index("run failed:"):]
    assert re.search(r"run failed: rank 1 \(pid \d+\) exited 0 at [\d:.]+ while its peers were still running; "
                     r"the failure that followed is rank 0 \(pid \d+\) at [\d:.]+: exited 1", report), report


def test_report_is_the_last_thing_printed_after_buffered_output(ftrun_home, tmp_path):
    script = tmp_path / "chatty.py"
    script.write_text("for i in range(20000):\n    print('line', i)\nraise RuntimeError('boom')\n")
    out = tmp_path / "slurm.out"
    with open(out, "w") as f:  # as under Slurm: stdout and stderr into one file
        rc = subprocess.run(FTRUN + ["--nproc", "1", str(script)], stdout=f, stderr=subprocess.STDOUT,
                            timeout=120).returncode
    assert rc == 1
    lines = out.read_text().splitlines()
    assert lines.count("[rank 0] line 19999") == 1
    headline = next(i for i, l in enumerate(lines) if "run failed:" in l)
    assert not [l for l in lines[headline:] if l.startswith("[rank 0] line")], "worker lines after the report"
    assert "RuntimeError: boom" in lines[headline - 1] or "RuntimeError: boom" in "\n".join(lines[headline:])
    assert lines[-1].startswith("ftrun: full log:")
