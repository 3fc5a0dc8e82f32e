"""Exit statuses and what a run reports: ftrun's exit status is the run's (0 only when every
worker's work succeeded), its console lines reach the end, and it stops only its own processes.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time

from conftest import FTRUN, ROOT, run_ftrun, start_ftrun

HELLO = "import os\nprint('hello from rank', os.environ['RANK'], flush=True)\n"


def test_process_substitution_keeps_its_reader_and_exit_0(tmp_path, ftrun_home):
    """`ftrun ... > >(tee out)`: bash starts the tee as a child of the process that becomes ftrun.
    The tee is not ftrun's to stop: it gets every line, the last ones included, and ftrun exits 0."""
    script = tmp_path / "hello.py"
    script.write_text(HELLO)
    out = tmp_path / "out.txt"
    ftrun = " ".join(shlex.quote(a) for a in FTRUN)
    line = f"{ftrun} --nproc 1 {shlex.quote(str(script))} > >(tee {shlex.quote(str(out))} >/dev/null) 2>&1; " \
           f"echo rc=$?; wait"
    r = subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert "rc=0" in r.stdout, (r.stdout, r.stderr, out.read_text() if out.exists() else "")
    # The tee outlives ftrun (it is nobody's to wait for): it writes the last lines once it reads
    # the end of the pipe, soon after ftrun exits.
    deadline = time.monotonic() + 30
    while "goodput" not in out.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    text = out.read_text()
    assert "hello from rank 0" in text and "finished in" in text, text
    assert "goodput" in text, text


# A small ftrun.ft script: DIM inputs, the torch.optim class OPTIM, and with "iter" an
# plain DataLoader given to ft.DataLoader in place of a dataset (which it refuses: no position).
FT_SMALL = """\
import sys
import torch
import ftrun.ft as ft
dim, optim, data = int(sys.argv[1]), sys.argv[2], sys.argv[3]
torch.manual_seed(0)
model = ft.DistributedDataParallel(torch.nn.Linear(dim, 1))
opt = ft.Optimizer(getattr(torch.optim, optim)(model.parameters(), lr=0.01))
if data == "iter":
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(torch.ones(100, dim))
    ft.DataLoader(torch.utils.data.DataLoader(Stream(), batch_size=4))
for step in ft.steps(4):
    opt.zero_grad()
    model(torch.ones(2, dim)).sum().backward()
    opt.step()
"""


def _refusal(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in proc.stderr.splitlines() if "stopping the run (exit 2)" in line]
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return lines[0]


def test_refusal_lines_reach_the_console_whole(tmp_path, ftrun_home):
    """A refusal's fix is at the end of its line: a line cut at 200 characters lost it."""
    script = tmp_path / "small_ft.py"
    script.write_text(FT_SMALL)
    ck = tmp_path / "a-checkpoint-folder-with-a-long-name-as-real-ones-have" / "ck"
    base = ["--nproc", 1, "--ft", "--checkpoint-dir", ck]
    first = run_ftrun(base + ["--checkpoint-every", 2, script, 4, "Adam", "none"], timeout=180)
    assert first.returncode == 0, first.stderr[-3000:]
    shape = _refusal(run_ftrun(base + [script, 8, "Adam", "none"], timeout=180))
    assert "is [1, 4] in the checkpoint, [1, 8] in this run" in shape, shape
    assert shape.endswith("give this run its own --checkpoint-dir; stopping the run (exit 2)"), shape
    other = _refusal(run_ftrun(base + [script, 4, "AdamW", "none"], timeout=180))
    assert "written with optimizer Adam, this run uses AdamW" in other, other
    assert other.endswith("give this run its own --checkpoint-dir; stopping the run (exit 2)"), other
    stream = _refusal(run_ftrun(["--nproc", 1, "--ft", script, 4, "SGD", "iter"], timeout=180))
    assert stream.endswith("or a StatefulDataLoader; stopping the run (exit 2)"), stream
    assert max(len(shape), len(other), len(stream)) > 200  # what used to be cut


def test_a_line_of_megabytes_is_cut_at_a_word():
    """Only a line no person reads (a dump) is bounded, at a space, saying how long it was."""
    from ftrun.wire import LINE_LIMIT, WorkerError, first_line

    assert first_line("  \n" + "word " * 50 + "end\nsecond line") == ("word " * 50 + "end")
    cut = first_line("word " * 1_000_000 + "end")
    assert len(cut) < LINE_LIMIT + 60 and cut.endswith("(5000003 characters in all)")
    assert cut.split(" ...")[0].endswith("word")
    raw = WorkerError("RuntimeError: " + "x" * 300 + " fix it").encode()
    assert WorkerError.decode(raw).message.endswith("fix it")


# An ftrun.ft script whose code after the training loop (an evaluation, a final save) raises on
# the ranks listed in its first argument ("all", or comma-separated ranks); with "exit3" those
# ranks exit 3 at the start instead, every time.
AFTER_LOOP = """\
import os, sys
import torch
import ftrun.ft as ft
rank, which = os.environ["RANK"], sys.argv[1].split(":")
failing = which[1] in ("all", rank) if len(which) > 1 else False
if which[0] == "exit3" and failing:
    sys.exit(3)
model = ft.DistributedDataParallel(torch.nn.Linear(4, 1))
opt = ft.Optimizer(torch.optim.SGD(model.parameters(), lr=0.01))
for step in ft.steps(int(sys.argv[2])):
    opt.zero_grad()
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
print(f"rank {rank} left the loop at step {ft.global_step()}", flush=True)
if which[0] == "raise" and failing:
    raise RuntimeError(f"the final evaluation failed on rank {rank}: fix the evaluation")
"""


def _after_loop_run(tmp_path, which: str, *extra) -> subprocess.CompletedProcess:
    script = tmp_path / "after_loop.py"
    script.write_text(AFTER_LOOP)
    return run_ftrun(["--nproc", 2, "--ft", *extra, script, which, 20], timeout=240)


def test_a_failure_after_the_loop_on_every_rank_fails_the_run(tmp_path, ftrun_home):
    """Code after the loop raises on every rank: the run failed (exit 1, as torchrun), says which
    rank failed after the loop and why, and restarts nothing into a finished run."""
    r = _after_loop_run(tmp_path, "raise:all")
    err = r.stderr
    assert r.returncode == 1, err[-3000:]
    assert "starting again" not in err and "restarting it alone" not in err, err[-3000:]
    assert "after the training loop" in err, err[-3000:]
    assert "RuntimeError: the final evaluation failed on rank" in err, err[-3000:]
    assert "finished in" not in err, err[-3000:]


def test_a_failure_after_the_loop_on_one_rank_fails_the_run(tmp_path, ftrun_home):
    r = _after_loop_run(tmp_path, "raise:1", "--checkpoint-dir", tmp_path / "ck", "--checkpoint-every", 10)
    err = r.stderr
    assert r.returncode == 1, err[-3000:]
    assert "starting again" not in err and "resuming from the newest" not in err, err[-3000:]
    assert "restarting it alone" not in err, err[-3000:]
    line = next((l for l in err.splitlines() if "after the training loop" in l), "")
    assert "rank 1" in line and "the final evaluation failed on rank 1" in line, err[-3000:]
    assert "rank 0 left the loop at step 20" in r.stdout and "rank 1 left the loop at step 20" in r.stdout


def test_a_replica_given_up_after_its_budget_fails_the_run(tmp_path, ftrun_home):
    """0 only when every worker exited 0: the others finish, then the given-up worker's status."""
    r = _after_loop_run(tmp_path, "exit3:1", "--max-restarts", 1)
    err = r.stderr
    assert r.returncode == 3, err[-3000:]
    assert "finished with 1 of 2 replicas" in err and "rank 1 was given up" in err, err[-3000:]
    assert "rank 0 left the loop at step 20" in r.stdout


# A plain DDP script (no ftrun.ft): its own default group, a few hundred small steps, and each
# process's rank and incarnation on stdout (the test kills one by its pid).
PLAIN_DDP = """\
import os, time
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(300):
    opt.zero_grad()
    model(torch.ones(4, 8)).sum().backward()
    opt.step()
    time.sleep(0.01)
print(f"rank {rank} of {dist.get_world_size()} done, incarnation {os.environ['TORCHELASTIC_RESTART_COUNT']}",
      flush=True)
dist.destroy_process_group()
"""


def test_ft_on_a_script_without_ftrun_ft_gets_group_restarts(tmp_path, ftrun_home):
    """--ft on a script that never joins a quorum: a failure restarts every worker, as without
    --ft (each with its default group), said once; an outside SIGKILL is not blamed on memory."""
    import json

    from helpers import read_state, finish

    script = tmp_path / "plain_ddp.py"
    script.write_text(PLAIN_DDP)
    proc = start_ftrun(["--nproc", 3, "--ft", "--max-restarts", 3, "--run-id", "plain", script], files=("stderr",))
    try:
        deadline = time.monotonic() + 120
        victim = None
        while victim is None and time.monotonic() < deadline:
            st = read_state(ftrun_home, "plain")
            r1 = next((r for r in (st or {}).get("replicas", []) if r["rank"] == 1), None)
            if r1 and r1.get("pid") and r1.get("step", 0) >= 20:
                victim = r1["pid"]
            time.sleep(0.05)
        assert victim, f"rank 1 never stepped\n{json.dumps(read_state(ftrun_home, 'plain'))[-2000:]}"
        os.kill(victim, signal.SIGKILL)
        rc, err = finish(proc, timeout=180)
    finally:
        proc.kill()
    assert rc == 0, err[-4000:]
    assert err.count("trains without ftrun.ft") == 1, err[-4000:]
    assert "restarting all 3 workers" in err, err[-4000:]
    # The restarted workers have their default group; a survivor's collective that failed as its
    # peer died prints no traceback (it is in the rank's log): the peer's death is ftrun's line.
    assert "Default process group has not been initialized" not in err and "skipped the script's" not in err, \
        err[-4000:]
    assert "Traceback" not in err and "reset by peer" not in err and "closed by peer" not in err, err[-4000:]
    assert "out-of-memory" not in err and "internal error" not in err, err[-4000:]
    assert "killed by SIGKILL" in err and "from outside ftrun" in err, err[-4000:]
    logs = [(ftrun_home / "plain" / "logs" / f"rank{r}" / "stdout.log").read_text() for r in range(3)]
    for r, text in enumerate(logs):
        assert f"rank {r} of 3 done, incarnation 1" in text, text[-2000:]


def test_a_sigkill_is_put_on_the_memory_killer_only_on_evidence():
    """The kernel log naming the process (not in it here: a live pid no OOM killer touched), or
    the worker's memory near the limit at its last sample; else "sent from outside ftrun"."""
    from ftrun.supervisor.accounting.report import exit_reason, memory_limit

    limit = memory_limit()
    assert limit and limit > 0
    assert exit_reason(None, 9, [], os.getpid(), 10 << 20) == "killed by SIGKILL (signal 9; sent from outside ftrun)"
    near = exit_reason(None, 9, [], os.getpid(), int(limit * 0.9))
    assert "likely the out-of-memory killer: it used" in near and "limit at its last sample" in near, near
    assert exit_reason(None, 11, []) == "killed by SIGSEGV (signal 11; segmentation fault)"
