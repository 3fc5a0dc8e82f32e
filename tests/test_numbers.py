"""Numbers a person reads must mean what they seem to (issue 40, item 9): the hook's figures at
exit name the run's step, not what a restarted process counted itself; the goodput line of
`ftrun status` says which failures its times are for, and a replica that never came back is
said in words, in the status, the run's last lines and `ftrun report`'s page alike; the save of
the loop's last step is tried as often as the docs say, its lines say what happens next, and
`ftrun status` counts failed saves, not attempts.
"""

from __future__ import annotations

import re

import pytest

from conftest import run_ftrun
from helpers import fill_disk, small_tmpfs, status_record

# A --ft loop of STEPS steps; replica 0's first process dies at step 20, and replica 1, alone,
# waits for it to come back, so the restarted process takes part of the run, not all of it.
FT_CRASH = """\
import os, sys, time
import torch
import ftrun.ft as ft

steps = int(sys.argv[1])
torch.manual_seed(0)
ddp = ft.DistributedDataParallel(torch.nn.Linear(8, 1))
opt = ft.Optimizer(torch.optim.SGD(ddp.parameters(), lr=0.01))
first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
for step in ft.steps(steps):
    if first and os.environ["RANK"] == "0" and step == 20:
        os._exit(1)
    if step >= 20 and ft.num_replicas() < 2:
        time.sleep(0.2)  # replica 1 alone: wait for the restarted replica 0
    opt.zero_grad()
    ddp(torch.randn(4, 8)).sum().backward()
    opt.step()
    time.sleep(0.02)
print(f"done at step {ft.global_step()}", flush=True)
"""


def test_hook_figures_at_exit_name_the_runs_step(ftrun_home, tmp_path):
    script = tmp_path / "crash.py"
    script.write_text(FT_CRASH)
    proc = run_ftrun(["--nproc", 2, "--ft", "--max-restarts", 2, script, 80], timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[rank 0] done at step 80" in proc.stdout, proc.stdout
    # the console shows rank 0's line: its restarted process took only part of the 80 steps
    line = next((ln for ln in proc.stderr.splitlines() if ln.startswith("[rank 0] ") and "(at exit)" in ln), "")
    m = re.search(r"hook allreduce step (\d+) \((\d+) of them in this process\): sent", line)
    assert m and int(m[1]) == 80 and 0 < int(m[2]) < 80, line or proc.stderr[-3000:]


# Every process of the one worker steps, then fails: three restarts, four failures, and the
# last one is not restarted (its replica never comes back).
ALWAYS_FAILS = """\
import sys, time
import torch

model = torch.nn.Linear(2, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    opt.zero_grad()
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
time.sleep(0.5)  # its steps reach ftrun before it fails
sys.exit(3)
"""


def _chromium_page(home, run_id, out) -> str:
    """`ftrun report`'s page of the run, as headless Chromium draws it ('' without Chromium)."""
    from test_report import _chromium, _headless

    r = run_ftrun(["report", run_id, "-o", out], env={"FTRUN_HOME": str(home)})
    assert r.returncode == 0, r.stderr
    try:
        browser = _chromium()
    except pytest.skip.Exception:
        return ""
    dom = _headless(browser, "--dump-dom", f"file://{out}")
    assert dom.returncode == 0, dom.stderr[-2000:]
    return re.sub(r"<script>.*?</script>", "", dom.stdout, flags=re.S)  # what it drew, not its code


def test_failures_say_which_times_are_shown_and_never_back_in_words(ftrun_home, tmp_path):
    script = tmp_path / "fails.py"
    script.write_text(ALWAYS_FAILS)
    proc = run_ftrun(["--nproc", 1, "--max-restarts", 3, "--run-id", "fails4", script], timeout=180)
    assert proc.returncode == 3, proc.stderr[-3000:]
    # the run's last lines: the replica given up is "never back"
    summary = next((ln for ln in proc.stderr.splitlines() if ln.startswith("ftrun: 4 failures")), "")
    assert summary.count("back in") == 3 and summary.endswith("never back"), proc.stderr[-3000:]
    # ftrun status: four failures, the times of the last three, the last one in words
    st = run_ftrun(["status", "fails4"], timeout=30)
    assert st.returncode == 0, st.stderr
    text = " ".join(st.stdout.split())
    assert re.search(r"4 failures, the last 3: back in [\d.]+m?s, back in [\d.]+m?s, never back", text), text
    assert "not back" not in text, text
    assert len(status_record("fails4")["failures"]) == 4
    # the report's page: the table's cell and the mark's title say it alike
    html = _chromium_page(ftrun_home, "fails4", tmp_path / "page.html")
    if html:
        assert html.count('<td class="num">never back</td>') == 1, html[-3000:]
        assert len(re.findall(r"<title>rank 0 exited with code 3 at [^<]*; never back; cost", html)) == 1, html[-3000:]
        assert "not back" not in html and "back in never" not in html, html[-3000:]


# An ft.epochs() loop over an ft.DataLoader: 2 epochs of 10 steps, a save every 10 steps. The
# loop learns that step 20 was its last only after the round top that saved it.
EPOCHS = """\
import time
import torch
import ftrun.ft as ft

torch.manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(40, 64), torch.randn(40, 1))
loader = ft.DataLoader(data, batch_size=4)
model = torch.nn.Sequential(torch.nn.Linear(64, 224), torch.nn.ReLU(), torch.nn.Linear(224, 1))
ddp = ft.DistributedDataParallel(model)
opt = ft.Optimizer(torch.optim.Adam(ddp.parameters(), lr=1e-3))
for epoch in ft.epochs(2):
    for x, y in loader:
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    time.sleep(0.5)  # an evaluation: the save of the round top before it has failed by now
print(f"done at step {ft.global_step()}", flush=True)
"""


@pytest.fixture
def full_disk(tmp_path):
    """A checkpoint folder on a 4 MiB tmpfs with no room left."""
    with small_tmpfs(tmp_path / "small") as mnt:
        (mnt / "ck").mkdir()
        fill_disk(mnt)
        yield mnt / "ck"


def test_last_save_is_tried_three_times_and_failed_saves_count_saves(ftrun_home, tmp_path, full_disk):
    script = tmp_path / "epochs.py"
    script.write_text(EPOCHS)
    proc = run_ftrun(["--nproc", 1, "--ft", "--run-id", "lastsave", "--checkpoint-dir", full_disk,
                      "--checkpoint-every", 10, script], timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[rank 0] done at step 20" in proc.stdout, proc.stdout
    failed = [ln for ln in proc.stderr.splitlines() if "not written" in ln]
    ten = [ln for ln in failed if "checkpoint of step 10 not written" in ln]
    last = [ln for ln in failed if "checkpoint of step 20 not written" in ln]
    assert len(ten) == 1 and "training goes on and the next save tries again" in ten[0], failed
    # the docs' three tries, each line saying what comes next; none says that training goes on
    assert len(last) == 3, failed
    assert "this was the loop's last step: trying again in 1 s (try 2 of 3)" in last[0], last
    assert "this was the loop's last step: trying again in 2 s (try 3 of 3)" in last[1], last
    assert "this was the loop's last step, and its last try (3 of 3)" in last[2], last
    assert "failed 3 times" in proc.stderr, proc.stderr[-3000:]
    # two saves failed (of steps 10 and 20), whatever the tries
    assert "ftrun: 2 checkpoint saves failed in this run; no checkpoint was written" in proc.stderr, \
        proc.stderr[-3000:]
    ck = status_record("lastsave")["checkpoint"]
    assert ck["failed_total"] == 2 and ck["failed_since"] == 2 and ck["last_failure"]["final"], ck
    st = run_ftrun(["status", "lastsave"], timeout=30)
    assert "checkpoint saves failed: 2 since the last good one, 2 in all" in " ".join(st.stdout.split()), st.stdout
