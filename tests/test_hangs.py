"""The default hang rule (no --step-timeout): a stopped worker, or under --ft a worker its peers
wait for while it uses no CPU, is hung; a worker that computes between steps never is.

The rule's 60 s are shortened to 3 s with FTRUN_HANG_AFTER_S, and --ft's collective timeout to
2 s with FTRUN_FT_TIMEOUT, so a peer gives up on a collective and waits in the vote before the
rule's limit passes, as it does at the real sizes (10 s against 60 s).
"""

from __future__ import annotations

import pytest

import json
import os
import re
import signal
import subprocess

import psutil

from conftest import run_ftrun, start_ftrun, wait_for_line

FAST = {"FTRUN_HANG_AFTER_S": "3", "FTRUN_FT_TIMEOUT": "2"}

FT_WORKER = """\
import os, sys, threading, time
import torch
import ftrun.ft as ft
steps, who, at, mode, seconds = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], float(sys.argv[5])
rank = int(os.environ["RANK"])
first = os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"
if mode == "stuck-restart" and rank == who and os.environ["TORCHELASTIC_RESTART_COUNT"] == "1":
    threading.Event().wait()  # a restarted replica blocked before it asks to rejoin: no CPU, no I/O
torch.manual_seed(0)
model = ft.DistributedDataParallel(torch.nn.Linear(8, 1))
opt = ft.Optimizer(torch.optim.SGD(model.parameters(), lr=0.01))
acted = not first  # a restarted incarnation trains normally
for step in ft.steps(steps):
    if mode == "stuck-restart" and step == at and rank == who and first:
        os.kill(os.getpid(), 9)
    if step == at and rank == who and not acted:  # once: a round voted down yields the same step again
        acted = True
        print(f"[{mode}] rank {rank} at step {step}", flush=True)
        if mode == "busy":          # an evaluation between steps: CPU work, no optimizer step
            end, n = time.monotonic() + seconds, 0
            while time.monotonic() < end:
                n += 1
        elif mode == "deadlock":    # a lock nobody releases: no CPU, no step, heartbeat still beating
            lock = threading.Lock()
            lock.acquire()
            lock.acquire()
        elif mode == "child":       # waits on a tool it runs, reading its output as it trickles in
            import subprocess
            tool = subprocess.Popen([sys.executable, "-c", "import sys, time\\n"
                                     f"for i in range(int({seconds} * 4)): print(i, flush=True); time.sleep(0.25)"],
                                    stdout=subprocess.PIPE, text=True)
            lines = sum(1 for _ in tool.stdout)
            tool.wait()
            print(f"[child] read {lines} lines", flush=True)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()
    time.sleep(0.02)
print(f"[done] rank {rank}", flush=True)
"""

PLAIN_WORKER = """\
import os, time, torch
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
print(f"ready {os.environ['RANK']} {os.environ['TORCHELASTIC_RESTART_COUNT']}", flush=True)
for _ in range(120):
    opt.zero_grad(); model(torch.randn(4, 8)).sum().backward(); opt.step(); time.sleep(0.02)
print("done", flush=True)
"""


def _script(tmp_path, text: str, name: str):
    path = tmp_path / name
    path.write_text(text)
    return path


def _pid_of(run_id: str, rank: int, home) -> int:
    """The worker's pid from `ftrun status`'s state file (it printed its first line: it is there)."""
    state = json.loads((home / run_id / "state.json").read_text())
    pid = next(r["pid"] for r in state["replicas"] if r["rank"] == rank)
    assert pid, state
    return pid


def test_ft_busy_rank_is_never_hung_a_deadlocked_one_is(ftrun_home, tmp_path):
    """--ft, no flag: rank 0 computes for 12 s between steps while ranks 1 and 2 wait for it
    (they give up on the collective after 2 s and wait in the vote): it is not killed. Then
    rank 1 deadlocks (a lock, no CPU): it is named hung, killed, and its replica rejoins."""
    script = _script(tmp_path, FT_WORKER, "ft_hang.py")
    busy = run_ftrun(["--nproc", 3, "--ft", "--log-dir", tmp_path / "busy", script, 60, 0, 10, "busy", 12],
                     env=FAST, timeout=180)
    assert busy.returncode == 0, busy.stderr[-3000:]
    assert "[busy] rank 0 at step 10" in busy.stdout and busy.stdout.count("[done]") == 3, busy.stdout[-2000:]
    assert "is hung" not in busy.stderr and "training again" not in busy.stderr, busy.stderr[-3000:]
    # The peers did wait for it longer than the rule's limit: the rule was in play.
    waits = [float(m) for m in re.findall(r"waited (\d+\.\d) s for the decision",
                                          (tmp_path / "busy" / "rank1" / "stderr.log").read_text())]
    assert waits and max(waits) > 6, waits

    dead = run_ftrun(["--nproc", 3, "--ft", script, 60, 1, 10, "deadlock", 0], env=FAST, timeout=180)
    assert dead.returncode == 0, dead.stderr[-3000:]
    assert "rank 1 (pid" in dead.stderr, dead.stderr[-3000:]
    assert "is hung (its peers waited 3 s for its step while it did nothing: no CPU, no I/O, no child at work)" in dead.stderr, dead.stderr[-3000:]
    assert dead.stderr.count("is hung") == 1, dead.stderr[-3000:]
    assert "rank 1 is training again" in dead.stderr, dead.stderr[-3000:]
    assert dead.stdout.count("[done]") == 3, dead.stdout[-2000:]


@pytest.mark.extended
def test_stopped_worker_is_hung_without_flag_and_not_with_step_timeout_0(ftrun_home, tmp_path):
    """No --ft, no flag: a worker SIGSTOPped for the limit is hung, killed, and the group
    restarts. With --step-timeout 0 the same stop is left alone: SIGCONT and the run ends."""
    script = _script(tmp_path, PLAIN_WORKER, "plain.py")
    proc = start_ftrun(["--nproc", 2, "--max-restarts", 1, "--run-id", "stop", script], env=FAST)
    try:
        wait_for_line(proc, "ready 1 0", timeout=60)
        os.kill(_pid_of("stop", 1, ftrun_home), signal.SIGSTOP)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert "rank 1 (pid" in err and "is hung (its process was stopped for 3 s)" in err, err[-3000:]
    assert out.count("done") >= 2, out  # the second attempt's two workers (the first's rank 0 may end too)

    proc = start_ftrun(["--nproc", 2, "--step-timeout", 0, "--run-id", "off", script], env=FAST)
    try:
        wait_for_line(proc, "ready 1 0", timeout=60)
        victim = psutil.Process(_pid_of("off", 1, ftrun_home))
        victim.suspend()
        try:
            proc.wait(timeout=6)  # twice the limit: the run must not move, nor end
        except subprocess.TimeoutExpired:  # the expected outcome: still running
            pass
        assert proc.poll() is None
        victim.resume()
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert "is hung" not in err and "restarting" not in err, err[-3000:]


def test_ft_rank_waiting_on_a_child_and_its_io_is_not_hung(ftrun_home, tmp_path):
    """--ft, no flag: rank 0 reads a child's output as it trickles in for 9 s (three times the
    limit) between steps, while its peers wait for it. It uses almost no CPU, but its I/O and its
    child's move: it is left alone, as torchrun would leave it."""
    script = _script(tmp_path, FT_WORKER, "ft_child.py")
    proc = run_ftrun(["--nproc", 3, "--ft", script, 40, 0, 10, "child", 9], env=FAST, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[child] read 36 lines" in proc.stdout and proc.stdout.count("[done]") == 3, proc.stdout[-2000:]
    assert "is hung" not in proc.stderr and "restarting" not in proc.stderr, proc.stderr[-3000:]


def test_ft_restarted_replica_stuck_before_rejoining_is_hung(ftrun_home, tmp_path):
    """--ft, no flag: a restarted replica blocks before it asks to rejoin (no CPU, no I/O). Its
    peers never wait for it (it is in no epoch), yet it is named hung after the limit, its stacks
    go to its log folder, and its next incarnation heals."""
    logs = tmp_path / "logs"
    script = _script(tmp_path, FT_WORKER, "ft_stuck.py")
    proc = run_ftrun(["--nproc", 2, "--ft", "--log-dir", logs, script, 500, 1, 10, "stuck-restart", 0],
                     env=FAST, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    hung = [line for line in proc.stderr.splitlines() if "is hung" in line]
    assert len(hung) == 1 and "rank 1 (pid" in hung[0], proc.stderr[-3000:]
    assert "hung (restarted, it did nothing for 3 s before asking to rejoin" in hung[0], hung
    assert str(logs / "rank1" / "stacks.log") in hung[0], hung
    assert "threading.py" in (logs / "rank1" / "stacks.log").read_text()
    assert proc.stdout.count("[done]") == 2, proc.stdout[-2000:]
    assert "rank 1 is training again" in proc.stderr, proc.stderr[-3000:]
