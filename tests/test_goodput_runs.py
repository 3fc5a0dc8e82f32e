"""Goodput of real runs through the real CLI: what ftrun says failures cost, checked
against what the training scripts themselves measured (their committed steps' wall
times, the kill times, the steps they resumed from).
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import time
from pathlib import Path

import pytest

from conftest import FTRUN, ROOT, SCRIPTS, start_ftrun
from helpers import finish, read_reports, read_state, replica, small_tmpfs, wait_replica

TRAIN_FT = SCRIPTS / "train_ft.py"
TRAIN_DDP = SCRIPTS / "train_ddp.py"
# 10.5M parameters with Adam (126 MB of model and optimizer state per replica): heals at size.
BIG = ["--dim", 1024, "--hidden", 2048, "--depth", 3, "--optim", "adam", "--lr", 0.001]


def _start(args, home: Path) -> subprocess.Popen:
    return start_ftrun(args, {"FTRUN_HOME": str(home)}, files=("stderr",))


def _stalls(times, median, a, b):
    """Seconds a replica's commits stood still between `a` and `b`, beyond its usual step."""
    lost = 0.0
    for t0, t1 in zip(times, times[1:]):
        if t1 > a and t0 < b and t1 - t0 > 2 * median:
            lost += (t1 - t0) - median
    return lost


@pytest.mark.extended
@pytest.mark.alone
def test_ft_two_kills_cost_what_the_replicas_measured(tmp_path):
    """3 replicas at size; two SIGKILLs (replica 2, then replica 0 once 2 is back). The failures'
    cost ftrun reports, each failure's time until back, and the goodput agree within 30% with
    what the scripts measured: kill -> that replica's first committed step again, plus the
    survivors' stalls around each failure (from their committed steps' wall times)."""
    home, out, run_id = tmp_path / "home", tmp_path / "p", "gp-kills"
    t_start = time.time()
    proc = _start(["--nproc", 3, "--ft", "--run-id", run_id, TRAIN_FT, *BIG, "--steps", 90, "--out", out], home)
    try:
        pid = wait_replica(home, run_id, 2, lambda r, st: r["step"] >= 15 and r["state"] == "running", 120, proc)["pid"]
        kills = [time.time()]
        os.kill(pid, signal.SIGKILL)
        back = wait_replica(home, run_id, 2, lambda r, st: r["restarts"] == 1 and r["state"] == "running" and r["step"],
                            120, proc)["step"]
        pid = wait_replica(home, run_id, 0, lambda r, st: (st["steps_committed"] or 0) >= back + 8, 120, proc)["pid"]
        kill_step_2 = read_state(home, run_id)["steps_committed"]
        kills.append(time.time())
        os.kill(pid, signal.SIGKILL)
        err = finish(proc, 240, expect=0)[1]
    finally:
        proc.kill()
    wall = time.time() - t_start
    st = read_state(home, run_id)
    commits = {r: rep["commits"] for r, rep in read_reports(out, 3).items()}
    times = {r: [t for _, t in commits[r]] for r in range(3)}
    median = statistics.median(b - a for a, b in zip(times[1], times[1][1:]))
    # The victims' time away: kill -> first committed step of the new incarnation.
    away = [times[2][0] - kills[0], times[0][0] - kills[1]]
    back_s = [f["back_s"] for f in st["failures"]]
    assert [f["rank"] for f in st["failures"]] == [2, 0], st["failures"]
    assert all(f["kind"] == "signal" and f["detect_s"] < 0.5 for f in st["failures"]), st["failures"]
    assert sum(back_s) == pytest.approx(sum(away), rel=0.3), (back_s, away)
    # The survivors' stalls around each failure (replica 0's first incarnation is gone with its
    # kill: during the first failure it stood still as replica 1 did).
    first = (kills[0] - 1.0, times[2][0] + 2.0)
    second = (kills[1] - 1.0, times[0][0] + 2.0)
    stall_1 = _stalls(times[1], median, *first)
    survivors = 2 * stall_1 + _stalls(times[1], median, *second) + _stalls(times[2], median, *second)
    measured = sum(away) + survivors
    reported = st["lost_s"]["failures"]
    # Within 30%, or 1.5 s: on a loaded machine the survivors' slower steps around a heal (the
    # source sending 23M parameters' state) are stalls to the books and only in part to _stalls.
    assert reported == pytest.approx(measured, rel=0.3, abs=1.5), (reported, measured, away, survivors,
                                                                  st["lost_s"])
    # Goodput: the replicas' committed steps at the run's pace over the replica-time of the run.
    first_commit = min(times[1])
    steps_1 = len(times[1])
    steps_2 = (len(times[2]) + 15)  # at least 15 before its kill; its first incarnation's steps are gone
    steps_0 = len(times[0]) + kill_step_2
    productive = (steps_0 + steps_1 + min(steps_2, steps_1)) * median
    measured_goodput = productive / (3 * wall)
    lost, lost_measured = 1 - st["goodput"], 1 - measured_goodput
    assert lost == pytest.approx(lost_measured, rel=0.3), (st["goodput"], measured_goodput, st["lost_s"])
    assert first_commit - t_start > 0
    # the summary at the end names the goodput and both failures
    assert re.search(r"goodput \d+\.\d%", err), err[-2000:]
    assert "2 failures: rank 2 killed by SIGKILL" in err, err[-2000:]


@pytest.mark.extended
@pytest.mark.alone
def test_failure_free_goodput_is_at_least_95_percent_after_startup(tmp_path):
    """Failure-free, at size: once start-up is over, at least 95% of replica-time went to
    committed steps; the start-up ftrun counts is what the scripts measured to their first step."""
    home, run_id = tmp_path / "home", "gp-free"
    t_start = time.time()
    proc = _start(["--nproc", 2, "--ft", "--run-id", run_id, TRAIN_FT, *BIG, "--steps", 80, "--announce"], home)
    finish(proc, 240, expect=0)
    st = read_state(home, run_id)
    after_startup = (st["replica_s"] * st["goodput"]) / (st["replica_s"] - st["lost_s"]["startup"])
    assert after_startup >= 0.95, json.dumps([st["goodput"], st["lost_s"], st["replica_s"]])
    logs = [(Path(st["log_dir"]) / f"rank{r}" / "stdout.log").read_text() for r in range(2)]
    firsts = [float(re.search(r"\[announce\] .* t ([\d.]+)", log).group(1)) for log in logs]
    measured = sum(f - t_start for f in firsts)
    assert st["lost_s"]["startup"] == pytest.approx(measured, rel=0.3, abs=0.5), (st["lost_s"], measured)
    assert st["failures"] == [] and st["lost_s"]["failures"] == 0


def test_group_restart_counts_the_steps_lost_since_the_scripts_checkpoint(tmp_path):
    """Without --ft: a SIGKILL of rank 1 restarts the group; the steps since the script's own
    checkpoint (torch.save every 10 steps) are lost and counted, as many as it redid. Rank 1
    sleeps after its step 36 until it is killed, and rank 0 waits for it in step 37's all-reduce,
    so the kill lands 7 steps after the checkpoint of step 30 however late the test sees them."""
    home, run_id = tmp_path / "home", "gp-group"
    ckpt = tmp_path / "ck.pt"
    proc = _start(["--nproc", 2, "--max-restarts", 1, "--run-id", run_id, TRAIN_DDP, "--steps", 50,
                   "--step-sleep", 0.1, "--print-every", 1, "--ckpt", ckpt, "--ckpt-every", 10,
                   "--hang-rank", 1, "--hang-step", 36], home)
    try:
        # Both ranks' reports at the 37 steps they took: the count below is then exact.
        pid = wait_replica(home, run_id, 1, lambda r, st: all(replica(st, x)["step"] >= 37 for x in (0, 1)), 120,
                           proc)["pid"]
        os.kill(pid, signal.SIGKILL)
        finish(proc, 240, expect=0)
    finally:
        proc.kill()
    st = read_state(home, run_id)
    log = (Path(st["log_dir"]) / "rank0" / "stdout.log").read_text()
    first, second = log.split("incarnation 1", 1)
    done = max(int(s) for s in re.findall(r"^step (\d+) ", first, re.M)) + 1
    resumed = int(re.search(r"resumed from step (\d+)", second).group(1))
    assert (done, resumed) == (37, 30), (done, resumed)
    assert st["steps_lost"] == done - resumed, (st["steps_lost"], done, resumed)
    (f,) = st["failures"]
    assert f["rank"] == 1 and f["kind"] == "signal" and f["lost_steps"] == st["steps_lost"]
    assert f["back_s"] is not None and f["back_s"] > 0
    assert st["lost_s"]["failures"] > 2 * f["back_s"] * 0.7, st["lost_s"]


@pytest.mark.extended
def test_group_restart_on_two_nodes_counts_the_lost_steps_on_both(tmp_path):
    """Two nodes (one rank each): rank 0 saves the script's checkpoint; node 1's rank is killed.
    Node 1 never saw a save of its own, yet counts the steps since rank 0's, as node 0 does."""
    from conftest import free_port

    home, run_id, port = tmp_path / "home", "gp-nodes", free_port()
    ckpt = tmp_path / "ck.pt"
    procs = [_start(["--nnodes", 2, "--node-rank", k, "--master-port", port, "--nproc", 1, "--max-restarts", 1,
                     "--run-id", run_id, TRAIN_DDP, "--steps", 70, "--step-sleep", 0.1, "--print-every", 1,
                     "--ckpt", ckpt, "--ckpt-every", 10], home) for k in (0, 1)]
    try:
        pid = wait_replica(home, f"{run_id}.node1", 1, lambda r, st: r["step"] >= 35, 120, procs[1])["pid"]
        os.kill(pid, signal.SIGKILL)
        for p in procs:
            finish(p, 240, expect=0)
    finally:
        for p in procs:
            p.kill()
    st0, st1 = read_state(home, f"{run_id}.node0"), read_state(home, f"{run_id}.node1")
    log = (Path(st0["log_dir"]) / "rank0" / "stdout.log").read_text()
    first, second = log.split("incarnation 1", 1)
    done = max(int(s) for s in re.findall(r"^step (\d+) ", first, re.M)) + 1
    resumed = int(re.search(r"resumed from step (\d+)", second).group(1))
    # killed at a reported step of 35 or more, 30 saved; rank 0 prints a step after its sleep, so
    # its last printed step may be one behind the step it was taking
    assert 3 <= done - resumed < 10, (done, resumed)
    for st in (st0, st1):
        assert done - resumed - 3 <= st["steps_lost"] <= done - resumed + 1, (st["node_rank"], st["steps_lost"],
                                                                              done, resumed)
    # node 0 hears of it from node 1, or sees its own rank fail first (its collective broke)
    assert st1["failures"][0]["rank"] == 1 and st0["failures"][0]["kind"] in ("remote", "exit")


def test_a_full_disk_leaves_the_run_and_its_summary_alone(tmp_path):
    """The runs folder on a full tmpfs: the timeline cannot be written, the run still finishes
    with its summary, and no half-written timeline is left behind."""
    with small_tmpfs(tmp_path / "full", size="256k") as mnt:
        home = mnt / "home"
        (home / "gp-full").mkdir(parents=True, mode=0o700)
        home.chmod(0o700)
        with open(mnt / "fill", "wb") as f:  # leave room for the state file, not for the timeline
            f.write(b"\0" * (240 * 1024))
        env = dict(os.environ, FTRUN_HOME=str(home))
        r = subprocess.run(FTRUN + ["--nproc", "2", "--ft", "--run-id", "gp-full", "--log-dir", str(tmp_path / "logs"),
                                    str(TRAIN_FT), "--steps", "100"], capture_output=True, text=True, env=env,
                           cwd=ROOT, timeout=180)
        assert r.returncode == 0, r.stderr[-3000:]
        assert re.search(r"ftrun: goodput [\d.]+%", r.stderr), r.stderr[-2000:]
        assert not list((home / "gp-full").glob("timeline.json.*.tmp"))
