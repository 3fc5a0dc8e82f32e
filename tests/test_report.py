"""`ftrun report`: the page of a real run (a kill, checkpoints), rendered in headless
Chromium (Debian's package, scripts/setup_system.sh): its script draws a lane per
replica, the failure marked on its replica's lane with its cause, the steps-per-second
line, the checkpoints and the breakdown; the page needs no network; the command never
imports torch, and a bad run id is one line.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import FTRUN, ROOT, SCRIPTS, run_ftrun


def _chromium():
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("chromium is not installed (scripts/setup_system.sh installs Debian's package as root)")


def _headless(browser, *args, timeout=90):
    # --no-sandbox: the suite runs as root in CI, where Chromium's sandbox refuses to start.
    return subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                           "--user-data-dir=" + str(Path(args[-1].replace("file://", "")).parent / "chrome-profile"),
                           *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory):
    """A --ft run of 3 replicas with checkpoints, replica 1 killed once it has stepped a while."""
    d = tmp_path_factory.mktemp("report")
    home, run_id = d / "home", "report-run"
    env = dict(os.environ, FTRUN_HOME=str(home))
    args = ["--nproc", 3, "--ft", "--run-id", run_id, "--checkpoint-dir", d / "ck", "--checkpoint-every", 40,
            SCRIPTS / "train_ft.py", "--steps", 260, "--step-sleep", 0.01]
    proc = subprocess.Popen(FTRUN + [str(a) for a in args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=ROOT)
    try:
        deadline = time.time() + 120
        victim = None
        while time.time() < deadline and victim is None:
            try:
                st = json.loads((home / run_id / "state.json").read_text())
            except (OSError, ValueError):
                st = None
            if st:
                r = next(r for r in st["replicas"] if r["rank"] == 1)
                if r["step"] >= 60 and r["state"] == "running":
                    victim = r["pid"]
            time.sleep(0.05)
        assert victim, "replica 1 never reached step 60"
        os.kill(victim, signal.SIGKILL)
        _, err = proc.communicate(timeout=180)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    return d, home, run_id


def test_report_renders_in_chromium(killed_run):
    browser = _chromium()
    d, home, run_id = killed_run
    out = d / "page.html"
    # the command, in a process that must never load torch
    code = ("import sys\nfrom ftrun.cli import main\n"
            f"try:\n    main(['report', {run_id[:8]!r}, '-o', {str(out)!r}])\nexcept SystemExit as e:\n"
            "    assert e.code == 0, e.code\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, FTRUN_HOME=str(home)), capture_output=True,
                       text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert f"report of run {run_id} written to {out}" in r.stdout
    page = out.read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page), "the page fetches something"

    dom = _headless(browser, "--dump-dom", f"file://{out}")
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout
    assert 'data-drawn="1"' in html, html[-2000:]
    lanes = re.findall(r'<g class="lane" data-replica="(\d+)"', html)
    assert sorted(lanes) == ["0", "1", "2"], lanes
    states = set(re.findall(r'class="seg" data-state="(\w+)"', html))
    assert {"starting", "training", "away", "healing", "done"} <= states, states
    marks = re.findall(r'class="failure-mark" data-rank="(\d+)" data-kind="(\w+)"', html)
    # the kill; a survivor may also restart by the protocol's rule (exit 75: a round it cannot take back)
    assert marks[0] == ("1", "signal") and all(kind == "exit" for _, kind in marks[1:]), marks
    assert "killed by SIGKILL" in html
    assert re.search(r'<path id="rate-line" d="M[\d.]+ [\d.]+ L', html), "no steps/s line"
    assert len(re.findall(r'class="checkpoint-mark"', html)) >= 3
    causes = re.findall(r'class="cause" data-cause="(\w+)"', html)
    assert causes == ["productive", "startup", "failures", "hangs", "checkpoints", "waiting", "output", "end"], causes
    # The page's goodput is the state file's (rounded there to 4 places: 0.5315 of 0.53154 would
    # print 53.1 where the page, from the timeline's unrounded seconds, rightly prints 53.2).
    gp = json.loads((home / run_id / "state.json").read_text())["goodput"]
    shown = float(re.search(r'id="goodput">([\d.]+)%', html).group(1))
    assert abs(shown - 100 * gp) <= 0.051, (shown, gp)

    shot = d / "page.png"
    pic = _headless(browser, "--hide-scrollbars", "--window-size=1200,1400", f"--screenshot={shot}", f"file://{out}")
    assert pic.returncode == 0 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20000


@pytest.mark.quick
def test_report_of_no_such_run_is_one_line(tmp_path):
    r = run_ftrun(["report", "nope"], env={"FTRUN_HOME": str(tmp_path / "h")})
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "no run 'nope'" in r.stderr, r.stderr


@pytest.mark.quick
@pytest.mark.parametrize("damage, problem", [
    (None, None),
    (lambda t: t.update(lanes=5), "is not a run's timeline"),
    (lambda t: t["lanes"][0]["segments"].append([1.0, "x", "training"]), "holds a segment that is not"),
    (lambda t: t.update(steps=[[1.0]]), "'steps' holds an entry"),
    (lambda t: t["failures"].append({"time": None}), "'failures' holds an entry"),
])
def test_a_damaged_timeline_is_one_line(tmp_path, damage, problem):
    from ftrun.status.state import RunStatus, write_state
    from ftrun.supervisor.accounting.timeline import write_timeline

    home = tmp_path / "home"
    folder = home / "made"
    folder.mkdir(parents=True)
    write_state(folder / "state.json", RunStatus(run_id="made", script="t.py", argv=["t.py"], started=100.0, pid=1,
                                                 hook=None, policy="group restart", max_restarts=0, nproc=1,
                                                 phase="ended", ended=110.0))
    timeline = {"started": 100.0, "lanes": [{"replica": 0, "ranks": [0], "segments": [[100.0, 110.0, "training"]]}],
                "steps": [[101.0, 0], [110.0, 50]], "failures": [], "checkpoints": [], "replica_s": 10.0,
                "productive_s": 9.0, "lost_s": {"startup": 1.0}}
    if damage is not None:
        damage(timeline)
    write_timeline(folder, timeline)
    r = run_ftrun(["report", "made", "-o", tmp_path / "page.html"], env={"FTRUN_HOME": str(home)})
    if problem is None:
        assert r.returncode == 0, r.stderr
        assert '"productive_s":9.0' in (tmp_path / "page.html").read_text()
    else:
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and problem in r.stderr, r.stderr
