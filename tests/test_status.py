"""`ftrun status`: hand-written state files under a temp FTRUN_HOME (view, --json, --watch,
--clean, dead supervisors, file modes, no torch), and a live 4-worker run with a SIGKILL."""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import STEP_LOOP, run_ftrun, start_ftrun, wait_for_line
from helpers import wait_for

from ftrun.errors import ConfigError
from ftrun.status.state import ReplicaStatus, RunStatus, read_states, run_dir, runs_root, write_state
from ftrun.supervisor.accounting.report import exit_reason
from ftrun.supervisor.policy.restart import GroupRestartPolicy, ReplicaRestartPolicy
from ftrun.supervisor.workers.worker import WorkerState

# What the supervisor really writes into a state file (not look-alikes a view could match by luck).
FT_POLICY, GROUP_POLICY = ReplicaRestartPolicy(1, 1).name, GroupRestartPolicy(1).name
SIGKILLED = exit_reason(None, signal.SIGKILL, [])

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def home(tmp_path, monkeypatch):
    root = tmp_path / "ftrun-home"
    monkeypatch.setenv("FTRUN_HOME", str(root))
    return root


@pytest.fixture
def sup():
    """A live process standing in for a supervisor (it started before the fake run did)."""
    p = subprocess.Popen(["sleep", "120"])
    yield p.pid
    p.kill()
    p.wait()


def ftrun(*args: str, home: Path, timeout: float = 30, **kw) -> subprocess.CompletedProcess:
    return run_ftrun(args, timeout=timeout, env={"FTRUN_HOME": str(home), "COLUMNS": "200"}, cwd=kw.get("cwd", REPO))


def make_run(run_id: str, pid: int, *, started_ago: float = 0.5, phase: str = "running", n: int = 4,
             ft: bool = False, **kw) -> Path:
    now = time.time()
    st = RunStatus(run_id=run_id, script="train.py", argv=["ftrun", "--nproc", str(n), "train.py", "--lr", "0.1"],
                   started=now - started_ago, pid=pid, hook="powersgd rank=1", max_restarts=1, nproc=n,
                   policy=FT_POLICY if ft else GROUP_POLICY, phase=phase, **kw)
    for i in range(n):
        st.replicas.append(ReplicaStatus(
            rank=i, local_rank=i, pid=50000 + i, state=(WorkerState.RUNNING if i else WorkerState.RESTARTING).value,
            restarts=0 if i else 1, step=100 + i, steps_per_s=9.5, last_heartbeat=now - 0.3, cpu_percent=97.0,
            rss_bytes=300 << 20, last_failure=None if i else SIGKILLED,
            in_quorum=(i != 0) if ft else None, healing=(i == 0) if ft else None, last_heal_s=0.25 if ft else None))
    if ft:
        st.quorum_id, st.quorum_size, st.steps_committed, st.steps_discarded = 5, 3, 120, 1
    path = run_dir(run_id) / "state.json"
    write_state(path, st)
    return path


def status_json(*args: str, home: Path) -> list:
    r = ftrun("status", *args, "--json", home=home)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


# ---------------------------------------------------------------------------
# Views of hand-written state


def test_no_runs(home):
    r = ftrun("status", home=home)
    assert r.returncode == 0 and "no ftrun run is alive" in r.stdout
    assert status_json(home=home) == []


@pytest.mark.quick
def test_live_run_table_and_json(home, sup):
    make_run("ftrun-live1", sup, ft=True)
    r = ftrun("status", home=home)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for text in ("ftrun-live1", "train.py --lr 0.1", "running", "powersgd rank=1", f"policy {FT_POLICY},",
                 "restarting", "killed by SIGKILL (signal 9", "300.0 MiB", "97.0", "healing", "quorum 5: 3 replicas",
                 "committed 120", "discarded 1", "1 run alive"):
        assert text in out, (text, out)
    [run] = status_json(home=home)
    assert run["run_id"] == "ftrun-live1" and run["phase"] == "running" and not run["supervisor_gone"]
    assert [r["rank"] for r in run["replicas"]] == [0, 1, 2, 3]
    assert run["replicas"][0]["state"] == "restarting" and run["replicas"][0]["restarts"] == 1
    assert 0 <= run["replicas"][1]["heartbeat_age_s"] < 30 and 0.4 < run["uptime_s"] < 30


def test_multinode_run_shows_node_column(home, sup):
    from ftrun.status.render import render
    from ftrun.status.view import collect
    from rich.console import Console

    path = make_run("ftrun-2nodes", sup, n=4, nnodes=2)
    data = json.loads(path.read_text())
    for i, r in enumerate(data["replicas"]):
        r["node_rank"] = i // 2
    path.write_text(json.dumps(data))
    console = Console(width=200, record=True)
    console.print(render(collect()))
    lines = console.export_text().splitlines()
    header = next(line for line in lines if line.split()[:2] == ["node", "rank"])
    start = lines.index(header) + 1
    rows = [line.split()[:2] for line in lines[start:start + 4]]
    assert rows == [["0", "0"], ["0", "1"], ["1", "2"], ["1", "3"]]


def test_dead_supervisor_is_ended_supervisor_gone(home):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    make_run("ftrun-gone", dead.pid)
    # Our own pid, but the run claims to have started long before this process did: a recycled pid.
    make_run("ftrun-reused", os.getpid(), started_ago=10 * 86400)
    assert runs_root().is_dir()
    runs = {r["run_id"]: r for r in status_json(home=home)}
    for rid in ("ftrun-gone", "ftrun-reused"):
        assert runs[rid]["phase"] == "ended" and runs[rid]["supervisor_gone"], runs[rid]
        assert runs[rid]["recorded_phase"] == "running" and runs[rid]["shown_phase"] == "ended (supervisor gone)"
    r = ftrun("status", home=home)
    assert r.stdout.count("ended (supervisor gone)") == 2 and "no ftrun run is alive" in r.stdout


def test_ended_run_shows_exit_summary(home):
    make_run("ftrun-ended", 0, phase="ended", exit_code=1, exit_summary="rank 0 exited 1: ValueError: boom",
             started_ago=30, ended=time.time() - 5)
    r = ftrun("status", "ftrun-ended", home=home)
    assert r.returncode == 0 and "ended" in r.stdout and "exit 1: rank 0 exited 1: ValueError: boom" in r.stdout
    [run] = status_json("ftrun-ended", home=home)
    assert run["exit_code"] == 1 and not run["supervisor_gone"] and 24 < run["uptime_s"] < 26


def test_one_run_by_id_and_unknown_id(home, sup):
    make_run("ftrun-aaaa1111", sup)
    make_run("ftrun-bbbb2222", sup)
    assert [r["run_id"] for r in status_json("ftrun-bbbb2222", home=home)] == ["ftrun-bbbb2222"]
    assert [r["run_id"] for r in status_json("ftrun-aaaa", home=home)] == ["ftrun-aaaa1111"]  # unique prefix
    for argv in (["status", "ftrun-cccc"], ["status", "ftrun-cccc", "--json"]):
        r = ftrun(*argv, home=home)
        assert r.returncode == 2 and r.stdout == "" and len(r.stderr.strip().splitlines()) == 1, r
        assert "no run 'ftrun-cccc'" in r.stderr


def test_unreadable_and_newer_state_files(home):
    make_run("ftrun-ok", os.getpid())
    bad = run_dir("ftrun-torn") / "state.json"
    bad.write_text('{"run_id": "ftrun-torn", ')  # a half-written file never breaks the view
    newer = json.loads((run_dir("ftrun-ok") / "state.json").read_text())
    newer["run_id"] = "ftrun-newer"
    newer["future_field"] = 1
    newer["replicas"][0]["future_replica_field"] = 2
    (run_dir("ftrun-newer") / "state.json").write_text(json.dumps(newer))
    assert sorted(s.run_id for s in read_states()) == ["ftrun-newer", "ftrun-ok"]


def test_watch_until_ctrl_c(home, sup):
    make_run("ftrun-watched", sup)
    env = dict(os.environ, FTRUN_HOME=str(home), COLUMNS="200")
    # On a terminal (a pty), so the live view draws frames: Ctrl-C comes once the first one is on screen.
    master, slave = pty.openpty()
    p = subprocess.Popen([sys.executable, "-m", "ftrun", "status", "--watch"], env=env,
                         stdout=slave, stderr=subprocess.PIPE, text=True)
    os.close(slave)
    screen, deadline = b"", time.time() + 30
    try:
        while b"ftrun-watched" not in screen and select.select([master], [], [], max(0.0, deadline - time.time()))[0]:
            screen += os.read(master, 65536)
        assert b"ftrun-watched" in screen, screen[-2000:]
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=10)
    finally:
        p.kill()
        os.close(master)
    assert p.returncode == 0, err
    assert "Traceback" not in err
    # --watch --json streams one JSON document per line and refresh.
    p = subprocess.Popen([sys.executable, "-m", "ftrun", "status", "--watch", "--json"], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first, second = wait_for_line(p, "ftrun-watched", 30), wait_for_line(p, "ftrun-watched", 30)
    p.send_signal(signal.SIGINT)
    p.communicate(timeout=10)
    assert p.returncode == 0
    assert [r["run_id"] for r in json.loads(first)] == [r["run_id"] for r in json.loads(second)] == ["ftrun-watched"]


def test_clean_removes_ended_runs_only(home, sup):
    from ftrun.status.command import status_main

    make_run("ftrun-alive", sup)
    make_run("ftrun-done", 0, phase="ended", exit_code=0, exit_summary="all workers finished", ended=time.time())
    logs = run_dir("ftrun-done-logs") / "logs"
    logs.mkdir()
    (logs / "rank0.log").write_text("keep me\n")
    make_run("ftrun-done-logs", 0, phase="ended", exit_code=1, ended=time.time())
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    make_run("ftrun-gone", dead.pid)

    with pytest.raises(ConfigError, match="still running"):
        status_main(run_id="ftrun-alive", clean_ended=True)
    assert status_main(clean_ended=True) == 0
    assert [s.run_id for s in read_states()] == ["ftrun-alive"]
    assert not (runs_root() / "ftrun-done").exists() and not (runs_root() / "ftrun-gone").exists()
    assert (logs / "rank0.log").read_text() == "keep me\n"  # logs are never cleaned away
    assert status_main(clean_ended=True) == 0  # nothing left to clean is fine


def test_files_are_private(home, tmp_path):
    home.mkdir(mode=0o755)
    os.chmod(home, 0o755)  # a root made by someone with a loose umask gets tightened
    old = os.umask(0)  # even with no umask protection at all
    try:
        path = make_run("ftrun-private", os.getpid())
        leftover = path.with_name(path.name + f".{os.getpid()}.tmp")
        leftover.write_text("{}")
        os.chmod(leftover, 0o666)  # a stale tmp of a recycled pid must not keep its loose mode
        path = make_run("ftrun-private", os.getpid())
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(home).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert not leftover.exists()


def test_status_path_never_imports_torch(home, sup):
    make_run("ftrun-notorch", sup, ft=True)
    code = ("import sys, io, contextlib\n"
            "from ftrun.cli import main\n"
            "for argv in (['status'], ['status', '--json'], ['status', 'ftrun-notorch']):\n"
            "    with contextlib.redirect_stdout(io.StringIO()):\n"
            "        try:\n"
            "            main(argv)\n"
            "        except SystemExit as e:\n"
            "            assert e.code == 0, e.code\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy')))\n")
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, FTRUN_HOME=str(home)),
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[]"


# ---------------------------------------------------------------------------
# A live run through the real CLI (needs the supervisor)




def _live_run():
    """The runs folder's run, as `ftrun status` collects it; None while there is none."""
    from ftrun.status.view import collect

    try:
        runs = collect()
    except ConfigError:
        return None
    return runs[0] if runs else None


def test_live_run_and_sigkill_of_a_worker(home, tmp_path):
    script = tmp_path / "loop.py"
    script.write_text(STEP_LOOP)
    stop = tmp_path / "stop"
    env = dict(os.environ, FTRUN_HOME=str(home))
    sup = subprocess.Popen([sys.executable, "-m", "ftrun", "--nproc", "4", "--max-restarts", "1", "--run-id",
                            "ftrun-live4", "--quiet", str(script), str(stop)],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    try:
        wait_for(lambda: (r := _live_run()) and all(x["state"] == "running" and x["step"] > 0 for x in r["replicas"]),
                 90, "4 running replicas with steps", sup)
        [run] = status_json(home=home)  # through the real CLI
        assert run["run_id"] == "ftrun-live4" and run["phase"] == "running" and run["pid"] == sup.pid
        assert len(run["replicas"]) == 4 and all(r["pid"] and r["restarts"] == 0 for r in run["replicas"])
        assert all(r["heartbeat_age_s"] is not None and r["heartbeat_age_s"] < 5 for r in run["replicas"])
        assert all(r["rss_bytes"] for r in run["replicas"])
        assert run["policy"] == GROUP_POLICY and run["max_restarts"] == 1

        victim = run["replicas"][2]["pid"]
        t0 = time.time()
        os.kill(victim, signal.SIGKILL)
        # Not running any more (restarting/starting), then running again as a new process, restarts up.
        wait_for(lambda: (r := _live_run()) and (r["replicas"][2]["state"] != "running"
                                                 or r["replicas"][2]["pid"] != victim),
                 5, "rank 2 to leave 'running'", sup, poll=0.005)
        back = wait_for(lambda: (r := _live_run()) and r["replicas"][2]["state"] == "running"
                        and r["replicas"][2]["pid"] != victim and r["replicas"][2]["restarts"] >= 1 and r,
                        30, "rank 2 running again", sup)
        elapsed = time.time() - t0
        assert elapsed < 10, elapsed  # ~0.5 s when the machine is quiet
        assert "SIGKILL" in (back["replicas"][2]["last_failure"] or "")
        [run] = status_json("ftrun-live4", home=home)
        assert run["replicas"][2]["restarts"] >= 1 and run["replicas"][2]["pid"] != victim
        r = ftrun("status", home=home)
        assert r.returncode == 0 and "ftrun-live4" in r.stdout and "SIGKILL" in r.stdout

        stop.write_text("")
        sup.wait(timeout=60)
        assert sup.returncode == 0, sup.stdout.read()
        [run] = status_json(home=home)
        assert run["phase"] == "ended" and run["exit_code"] == 0 and not run["supervisor_gone"]
        state = Path(run["state_file"])
        assert stat.S_IMODE(state.stat().st_mode) == 0o600 and stat.S_IMODE(state.parent.stat().st_mode) == 0o700
    finally:
        if sup.poll() is None:
            sup.kill()
            sup.wait()


def test_fast_status_matches_the_cli(home, sup, capsys):
    """fast_status (the typer-free route for `ftrun status`) gives what the CLI gives, or defers to it."""
    from ftrun.status.command import fast_status

    make_run("ftrun-fast", sup)
    for argv in (["--help"], ["-h"], ["--jsn"], ["a", "b"], ["--watch=1"]):
        assert fast_status(argv) is None, argv  # help and mistakes: left to the full CLI
    assert fast_status(["--json", "ftrun-fast"]) == 0
    fast = json.loads(capsys.readouterr().out)
    slow = status_json("ftrun-fast", home=home)
    drop = ("uptime_s", "updated_age_s", "heartbeat_age_s")
    strip = lambda runs: [{k: v for k, v in r.items() if k not in drop and k != "replicas"} for r in runs]
    assert strip(fast) == strip(slow) and fast[0]["replicas"][0]["pid"] == slow[0]["replicas"][0]["pid"]
    with pytest.raises(ConfigError, match="no run 'nope'"):
        fast_status(["nope"])



# Counts its own committed steps: one line "global step, wall time" per commit, written as it
# happens, and nothing after the loop, so the process exits right after its last step.
FT_COUNT = """\
import os, sys, time, torch
import ftrun.ft as ft
model = ft.DistributedDataParallel(torch.nn.Linear(8, 1))
opt = ft.Optimizer(torch.optim.SGD(model.parameters(), lr=0.01))
log = open(sys.argv[2] + "." + os.environ["RANK"], "w", buffering=1)
for step in ft.steps(int(sys.argv[1])):
    opt.zero_grad()
    model(torch.ones(4, 8)).sum().backward()
    if opt.step():
        log.write(f"{ft.global_step()} {time.time():.6f}\\n")
"""


@pytest.mark.extended
def test_ft_figures_follow_the_scripts_own_count(home, tmp_path):
    """`ftrun status` of a real --ft run, during and after it: steps committed and each replica's
    step are what the script itself counted (its committed steps, with their times), discarded
    is 0 in a run with no failure, and the ended run shows every replica at the last step."""
    # Steps every few ms, so a replica whose last report were a beat (0.25 s) old would end
    # dozens of steps short of the end.
    steps, counts = 1500, tmp_path / "count"
    script = tmp_path / "count.py"
    script.write_text(FT_COUNT)
    env = dict(os.environ, FTRUN_HOME=str(home))
    sup = subprocess.Popen([sys.executable, "-m", "ftrun", "--nproc", "3", "--ft", "--run-id", "ftrun-figures",
                            "--quiet", str(script), str(steps), str(counts)],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    try:
        wait_for(lambda: (r := _live_run()) and min(x["step"] for x in r["replicas"]) >= 600, 90,
                 "every replica past step 600", sup)
        [live] = status_json("ftrun-figures", home=home)  # through the real CLI, while the run trains
        assert sup.wait(timeout=120) == 0, sup.stdout.read()
    finally:
        if sup.poll() is None:
            sup.kill()
            sup.wait()
    assert live["phase"] == "running", live
    commits = [(int(a), float(b)) for a, b in (line.split() for line in Path(f"{counts}.0").read_text().splitlines())]

    def committed_by(t: float) -> int:
        return max((s for s, when in commits if when <= t), default=0)

    # The state is a snapshot taken at `updated`, of reports at most a few beats old.
    at = live["updated"]
    low, high = committed_by(at - 1.5), committed_by(at + 0.05)
    assert low >= 50, (low, at, commits[:3])  # the run was well under way: a 0 cannot pass
    assert low <= live["steps_committed"] <= high, (live["steps_committed"], low, high)
    assert all(low <= r["step"] <= high for r in live["replicas"]), ([r["step"] for r in live["replicas"]], low, high)
    assert live["steps_discarded"] == 0 and live["quorum_size"] == 3, live
    [ended] = status_json("ftrun-figures", home=home)
    assert ended["phase"] == "ended" and ended["exit_code"] == 0, ended
    assert [s for s, _ in commits] == list(range(1, steps + 1))  # the script's own count: every step, once
    assert ended["steps_committed"] == steps and ended["steps_discarded"] == 0, ended
    assert [r["step"] for r in ended["replicas"]] == [steps] * 3, ended["replicas"]
    r = ftrun("status", "ftrun-figures", home=home)
    assert r.returncode == 0 and f"steps committed {steps}, discarded 0" in r.stdout, r.stdout


LAG_WORKER = """\
import os, sys, time, torch, ftrun.ft as ft
m = ft.DistributedDataParallel(torch.nn.Linear(32, 1))
opt = ft.Optimizer(torch.optim.SGD(m.parameters(), lr=0.01))
log = open(sys.argv[1] + "." + os.environ["RANK"], "w", buffering=1)
for step in ft.steps(int(sys.argv[2])):
    opt.zero_grad(); m(torch.randn(8, 32)).sum().backward()
    if opt.step():
        log.write(f"{time.time():.4f} {ft.global_step()}\\n")
    time.sleep(0.004)
"""


@pytest.mark.alone
def test_status_shows_the_current_step(ftrun_home, tmp_path):
    """--ft at about 100 steps/s: the step `ftrun status --json` shows is at most a fraction of a
    second behind the one each replica has committed (median under 0.3 s; it was 0.5 s)."""
    import bisect
    import statistics

    script = tmp_path / "lag.py"
    script.write_text(LAG_WORKER)
    steps = tmp_path / "steps"
    proc = start_ftrun(["--nproc", 2, "--ft", "--run-id", "lag", script, steps, 100000])
    samples = []
    try:
        deadline = time.time() + 120
        while not (steps.with_suffix(".0").exists() and len(steps.with_suffix(".0").read_text()) > 2000):
            assert time.time() < deadline and proc.poll() is None, proc.stderr.read() if proc.poll() else "slow"
            time.sleep(0.1)
        end = time.time() + 8
        while time.time() < end:
            out = run_ftrun(["status", "--json", "lag"], timeout=30)
            now = time.time()
            run = json.loads(out.stdout)[0]
            samples += [(now, r["rank"], r["step"]) for r in run["replicas"]]
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
    lags = []
    for rank in (0, 1):
        rows = [line.split() for line in Path(f"{steps}.{rank}").read_text().splitlines() if line.strip()]
        times, done = [float(t) for t, _ in rows], [int(s) for _, s in rows]
        rate = (done[-1] - done[0]) / (times[-1] - times[0])
        for now, r, shown in samples:
            i = bisect.bisect_right(times, now) - 1
            if r == rank and i >= 0 and shown > 0:
                lags.append((done[i] - shown) / rate)
    assert len(lags) >= 20, lags
    assert statistics.median(lags) < 0.3, sorted(lags)


SLOW_DDP = """\
import sys, time
from pathlib import Path
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo")
model = DDP(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
stop = Path(sys.argv[1])
while not stop.exists():
    opt.zero_grad()
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    time.sleep(0.02)
dist.destroy_process_group()
"""


@pytest.mark.parametrize("hook,every,first", [(["--hook", "diloco", "--period", "10"], 10, 0),
                                              (["--hook", "localsgd", "--period", "10", "--start-iter", "30"], 10, 30)])
def test_status_shows_each_replicas_next_sync(ftrun_home, tmp_path, hook, every, first):
    """--hook diloco and localsgd sync every --period steps: `ftrun status --json` shows each
    replica's next sync, a step past its own and at most a period ahead (localsgd: not before its
    --start-iter), and the table's hook line the nearest of them."""
    script = tmp_path / "slow.py"
    script.write_text(SLOW_DDP)
    stop = tmp_path / "stop"
    proc = start_ftrun(["--nproc", 2, "--run-id", "syncs", *hook, script, stop])
    try:
        def shown():
            out = run_ftrun(["status", "--json", "syncs"], timeout=30)
            runs = json.loads(out.stdout) if out.returncode == 0 and out.stdout.strip() else []
            reps = runs[0]["replicas"] if runs else []
            return reps if len(reps) == 2 and all(r["step"] > 12 and r.get("next_sync") for r in reps) else None

        reps = wait_for(shown, 90, "two replicas past step 12 with a next sync", proc)
        for r in reps:
            # At most a period past its step (localsgd: past its --start-iter); its report may be a beat old.
            assert r["step"] < r["next_sync"] <= max(r["step"], first) + every + 2, r
            assert r["next_sync"] % every == (1 if "localsgd" in hook else 0), r
            assert r["next_sync"] > first, r
        table = run_ftrun(["status", "syncs"], timeout=30).stdout
        assert "(next sync at step " in table, table
    finally:
        stop.write_text("")
        proc.communicate(timeout=60)
    assert proc.returncode == 0
