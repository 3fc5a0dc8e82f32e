"""The launcher's own output path (issue 40, items 1, 2 and 5): a full disk under the logs or
ftrun's state folder never stops training; a worker's output is handled in linear time, a
progress bar ('\\r') shows as a terminal shows it, a worker waiting on its full pipe counts as
such in the goodput; torch's internals do not reach the console during a heal."""

from __future__ import annotations

import json
import shlex
import subprocess
import time

import pytest

from conftest import FTRUN, ROOT, SCRIPTS, run_ftrun, start_ftrun, wait_for_line
from helpers import small_tmpfs, status_record

TRAIN = SCRIPTS / "train_ft.py"


CHATTY = """\
import sys, time
import torch
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(40):
    loss = model(torch.randn(8, 4)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    for i in range(200):
        print(f"step {step} line {i} " + "x" * 100)
    print(f"to stderr {step}", file=sys.stderr, flush=True)
    time.sleep(0.02)
print("done", flush=True)
"""


def _no_traceback(err: str) -> None:
    assert "Exception in thread" not in err and "Traceback" not in err, err[-3000:]
    assert "BrokenPipeError" not in err, err[-3000:]


def test_a_full_log_folder_never_stops_training(ftrun_home, tmp_path):
    script = tmp_path / "chatty.py"
    script.write_text(CHATTY)
    with small_tmpfs(tmp_path / "full", fill=True) as full:
        proc = run_ftrun(["--run-id", "fulllogs", "--nproc", 2, "--log-dir", full / "logs", script], timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _no_traceback(proc.stderr)
    said = [line for line in proc.stderr.splitlines() if line.startswith("ftrun: cannot write")]
    assert len(said) == 1, proc.stderr[-3000:]
    assert f"the workers' logs in {full / 'logs'} (No space left on device)" in said[0], said
    assert "--log-dir" in said[0] and "free space" in said[0], said
    # the console still has every line of the workers
    out = proc.stdout.splitlines()
    for r in range(2):
        assert f"[rank {r}] done" in out and f"[rank {r}] step 39 line 199 " + "x" * 100 in out, proc.stdout[-2000:]
    rec = status_record("fulllogs")
    lost = rec["not_written"]["logs"]
    assert lost["folder"] == str(full / "logs") and lost["bytes_lost"] > 1_000_000, rec["not_written"]
    shown = run_ftrun(["status", "fulllogs"], timeout=30)
    assert f"not written: logs in {full / 'logs'} (No space left on device)" in shown.stdout, shown.stdout


def test_a_full_ftrun_home_never_stops_an_ft_run(tmp_path):
    with small_tmpfs(tmp_path / "full", fill=True) as full:
        proc = run_ftrun(["--run-id", "fullhome", "--nproc", 2, "--ft", TRAIN, "--steps", 120, "--print-every", 20],
                         env={"FTRUN_HOME": str(full / "home")}, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _no_traceback(proc.stderr)
    said = [line for line in proc.stderr.splitlines() if line.startswith("ftrun: cannot write")]
    # the state file (and timeline) and the logs, under it by default: one line each
    assert len(said) == 2, proc.stderr[-3000:]
    assert any("the run's state in " in line and "FTRUN_HOME" in line for line in said), said
    assert any("the workers' logs in " in line and "--log-dir" in line for line in said), said
    for r in range(2):
        assert f"[rank {r}] done at step 120" in proc.stdout.splitlines(), proc.stdout[-2000:]


def test_a_reader_that_goes_away_stops_neither_the_workers_nor_a_good_exit(ftrun_home, tmp_path):
    """`ftrun ... | head -2`: the console's reader leaves after two lines. The workers train on
    (their output goes on into the logs), ftrun's own lines still reach stderr, and the run exits
    0; rich's own answer to a closed pipe (SystemExit from the pump's thread) killed the pump,
    then the worker at its next print (BrokenPipeError), and the run exited 1."""
    script = tmp_path / "chatty.py"
    script.write_text(CHATTY)
    proc = subprocess.run(["bash", "-c", f"{shlex.join(str(a) for a in FTRUN)} --run-id gone --nproc 2 {script} "
                           f"| head -2; echo \"ftrun exited ${{PIPESTATUS[0]}}\""],
                          capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert proc.stdout.splitlines()[-1] == "ftrun exited 0", proc.stdout[-2000:] + proc.stderr[-3000:]
    assert len(proc.stdout.splitlines()) == 3, proc.stdout[-2000:]
    _no_traceback(proc.stderr)
    assert "ftrun: run gone finished" in proc.stderr, proc.stderr[-3000:]
    for r in range(2):
        logs = ftrun_home / "gone" / "logs" / f"rank{r}"
        assert (logs / "stdout.log").read_text().splitlines()[-1] == "done", r
        assert "BrokenPipeError" not in (logs / "stderr.log").read_text(), r


LONG_LINE = """\
import json, sys, time
times = []
for step in range(12):
    t = time.monotonic()
    time.sleep(0.1)
    if step == 6:
        sys.stdout.write("y" * 20_000_000)
        sys.stdout.flush()
    times.append(time.monotonic() - t)
sys.stdout.write("\\nend\\n")
sys.stdout.flush()
with open(sys.argv[1], "w") as f:
    json.dump(times, f)
"""


@pytest.mark.alone
def test_a_20_mb_line_without_newline_does_not_stall_its_step(ftrun_home, tmp_path):
    script, times = tmp_path / "long.py", tmp_path / "times.json"
    script.write_text(LONG_LINE)
    logs = tmp_path / "logs"
    proc = run_ftrun(["--nproc", 1, "--log-dir", logs, script, times], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    t = json.loads(times.read_text())
    others = sorted(t[:6] + t[7:])
    usual = others[len(others) // 2]
    # quadratic today: about 16 s for this step; linear, well under a second on a busy machine
    assert t[6] < 30 * usual, (t[6], usual, t)
    # the console has the line in bounded pieces, every byte of it; the log has it whole
    pieces = [line for line in proc.stdout.splitlines() if line.startswith("[rank 0] y")]
    assert max(len(p) for p in pieces) <= 65536 + len("[rank 0] "), max(len(p) for p in pieces)
    assert sum(p.count("y") for p in pieces) == 20_000_000
    assert "[rank 0] end" in proc.stdout.splitlines()
    assert ("y" * 20_000_000 + "\nend\n") in (logs / "rank0" / "stdout.log").read_text()


# A real tqdm bar on stderr (as most training scripts print one), redrawn at every update.
BAR = """\
import json, os, sys, time
from tqdm import tqdm
times, total, per = [], 100, 20
seen = sys.argv[2]
bar = tqdm(total=total * per, desc="training", file=sys.stderr, mininterval=0, miniters=1, ncols=400)
for step in range(total):
    t = time.monotonic()
    time.sleep(0.03)
    for k in range(per):
        bar.update(1)
    times.append(time.monotonic() - t)
    if step == total // 2:  # the test says when it saw the bar on the console (60 s at most)
        deadline = time.monotonic() + 60
        while not os.path.exists(seen) and time.monotonic() < deadline:
            time.sleep(0.05)
bar.close()
print("trained", flush=True)
with open(sys.argv[1], "w") as f:
    json.dump(times, f)
"""


@pytest.mark.alone
def test_a_progress_bar_shows_during_the_run_and_does_not_slow_steps(ftrun_home, tmp_path):
    script, times, seen = tmp_path / "bar.py", tmp_path / "times.json", tmp_path / "seen"
    script.write_text(BAR)
    proc = start_ftrun(["--nproc", 1, script, times, seen])
    try:
        line = wait_for_line(proc, "[rank 0] training: ", timeout=60, stream="stderr")
        assert proc.poll() is None, "the run ended before the bar was shown"
        seen.touch()
        assert "\r" not in line and len(line) < 600, line
        rest, out = proc.stderr.read(), proc.stdout.read()
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, rest[-3000:]
    assert "[rank 0] trained" in out, out
    bars = [b for b in (line + rest).splitlines() if b.startswith("[rank 0] training: ")]
    assert all(len(b) < 600 for b in bars), max(len(b) for b in bars)
    # the bar's final state shows; a fast bar does not flood the console (a few lines a second)
    assert bars[-1].startswith("[rank 0] training: 100%|") and "| 2000/2000 [" in bars[-1], bars[-1]
    assert len(bars) < 40, len(bars)
    t = json.loads(times.read_text())
    first, last = sum(t[1:11]) / 10, sum(t[-10:]) / 10
    assert last < 3 * first, (first, last)


CHATTY_STEPS = """\
import sys, time
import torch
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(30):
    loss = model(torch.randn(8, 4)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    time.sleep(0.05)
    if step == 10:
        for i in range(30000):
            print(f"line {i} " + "z" * 100)
        sys.stdout.flush()
print("done", flush=True)
"""


@pytest.mark.alone  # it times where a slow reader's seconds go: another test beside it moves them
def test_a_worker_waiting_on_its_output_counts_as_output_in_the_goodput(ftrun_home, tmp_path):
    """ftrun's own stdout taken slowly (`ftrun ... | slow-reader`): the worker waits on its full
    pipe, and that time is lost to output, not counted as training or as waiting."""
    script = tmp_path / "chatty.py"
    script.write_text(CHATTY_STEPS)
    proc = start_ftrun(["--run-id", "slowout", "--nproc", 1, script])
    try:
        wait_for_line(proc, "[rank 0] line 0 ", timeout=60)
        time.sleep(4.0)  # the slow reader: nothing taken from ftrun's stdout meanwhile
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    assert "[rank 0] done" in out
    lost = status_record("slowout")["lost_s"]
    assert lost["output"] >= 2.0, lost
    assert lost["waiting"] < 1.0, lost


# A script with its own default group (as minGPT-ddp has) whose rank 1 dies in the first round,
# a layout round: its peer is averaging gradients when the connection closes.
DIES_IN_LAYOUT_ROUND = """\
import os, signal, sys, time
import torch
import torch.distributed as dist
import torch.nn as nn
import ftrun.ft as ft

dist.init_process_group("gloo")
torch.manual_seed(0)
ddp = ft.DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
opt = ft.Optimizer(torch.optim.SGD(ddp.parameters(), lr=0.01))
first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
for step in ft.steps(40):
    loss = ddp(torch.randn(8, 16)).pow(2).mean()
    if first and os.environ["RANK"] == "1" and step == int(sys.argv[1]):
        os.kill(os.getpid(), signal.SIGKILL)
    loss.backward()
    opt.step()
    time.sleep(0.01 if ft.num_replicas() == 2 else 0.1)  # slower while rank 1 is away: it is back before the end
print(f"done at step {ft.global_step()}", flush=True)
"""
TORCH_INTERNALS = ("is not initialized in the world group map", "waitForInput", "ProcessGroup object at 0x",
                   "ddp_comm_hooks", "[rank 0] At:")


@pytest.mark.parametrize("hook,step", [(None, 0), ("powersgd", 5)], ids=["layout-round", "powersgd-hook"])
def test_a_heal_keeps_torchs_internals_off_the_console(ftrun_home, tmp_path, monkeypatch, hook, step):
    """Rank 1 dies in the first round (a layout round: its peer averages with dist's functions), or
    under torch's PowerSGD hook, whose error comes with its "At:" frames on lines of their own."""
    monkeypatch.delenv("FTRUN_VERBOSE", raising=False)
    script, logs = tmp_path / "dies.py", tmp_path / "logs"
    script.write_text(DIES_IN_LAYOUT_ROUND)
    proc = run_ftrun(["--nproc", 2, "--ft", "--log-dir", logs] + (["--hook", hook] if hook else []) + [script, step],
                     timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 1 is training again, healed from a peer" in proc.stderr, proc.stderr[-3000:]
    for text in TORCH_INTERNALS:
        assert text not in proc.stderr and text not in proc.stdout, proc.stderr[-3000:]
    for r in range(2):
        assert f"[rank {r}] done at step 40" in proc.stdout.splitlines(), proc.stdout
    # the survivor's log says why its round failed: the peer's connection closed
    assert "a peer left mid-collective" in (logs / "rank0" / "stderr.log").read_text()


@pytest.mark.quick
def test_torchs_store_timeout_warnings_stay_in_the_log():
    from ftrun.supervisor.workers.logs import chatter

    for line in ("[W1127 23:53:02.756119425 socket.cpp:494] [c10d] waitForInput: socket SocketImpl(fd=15, "
                 "addr=[::ffff:127.0.0.1]:60500, remote=[::ffff:127.0.0.1]:40087) timed out after 10000ms",
                 "[W1127 23:53:03.758340643 socket.cpp:469] [c10d] waitForInput: poll for socket SocketImpl(fd=15) "
                 "returned 0, likely a timeout",
                 # with a default group (FSDP's replicas), torch names the rank first
                 "[rank1]:[W1203 13:35:48.075777082 socket.cpp:469] [c10d] waitForInput: poll for socket "
                 "SocketImpl(fd=11, addr=[::ffff:127.0.0.1]:45450, remote=[::ffff:127.0.0.1]:45121) returned 0, likely a timeout"):
        assert chatter(line, speaker=True), line
    assert not chatter("DistStoreError: wait timeout after 10000ms, keys: /x/0/1", speaker=True)
