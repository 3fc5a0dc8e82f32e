"""The stop's writer under --ft with --checkpoint-dir, through the real CLI: a stop signal after the
training loop ended (the workers run the script's code after it) names no replica that left the
loop as the writer of a save it will never make: the workers are stopped at once.
(The simulator pins the race behind it: tests/test_simulate.py's STOP_WRITER_FINISHED.)
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

from conftest import start_ftrun
from helpers import err_text

AFTER_LOOP_S = 60.0  # the script's code after the loop: far longer than a stop may take

SCRIPT = """\
import sys, time
import torch
import ftrun.ft as ft

model = torch.nn.Linear(4, 1)
ddp = ft.DistributedDataParallel(model)
opt = ft.Optimizer(torch.optim.SGD(ddp.parameters(), lr=0.01))
for step in ft.steps(int(sys.argv[1])):
    opt.zero_grad()
    ddp(torch.randn(8, 4)).sum().backward()
    opt.step()
print("loop done", flush=True)
time.sleep(float(sys.argv[2]))
print("after the sleep", flush=True)
"""


def _stdout(home: Path, run_id: str, rank: int) -> str:
    path = home / run_id / "logs" / f"rank{rank}" / "stdout.log"
    return path.read_text(errors="replace") if path.exists() else ""


def test_a_stop_after_the_loop_waits_for_no_writer(ftrun_home, tmp_path):
    """Both replicas left the loop (its last step saved at its end) and sleep in the script's code
    after it; SIGTERM: before the fix the keeper named replica 0 the writer of a stop quorum it never
    reads, and ftrun waited for its word until --shutdown-timeout. Now it stops the workers at once."""
    script = tmp_path / "after_loop.py"
    script.write_text(SCRIPT)
    grace = 30
    run = start_ftrun(["--nproc", 2, "--ft", "--run-id", "after", "--checkpoint-dir", tmp_path / "ck",
                       "--shutdown-timeout", grace, script, 6, AFTER_LOOP_S], files=("stderr",))
    try:
        deadline = time.monotonic() + 180
        while not all("loop done" in _stdout(ftrun_home, "after", r) for r in range(2)):
            assert run.poll() is None, err_text(run)[-3000:]
            assert time.monotonic() < deadline, "never saw both replicas leave the loop\n" + err_text(run)[-3000:]
            time.sleep(0.05)
        t0 = time.monotonic()
        run.send_signal(signal.SIGTERM)
        code = run.wait(timeout=grace + AFTER_LOOP_S + 30)
        took = time.monotonic() - t0
    finally:
        run.kill()
    err = err_text(run)
    assert code == 128 + signal.SIGTERM, (code, err[-3000:])
    assert "failed before stopping" not in err and "no checkpoint was written" not in err, err[-3000:]
    assert took < grace / 2, (took, err[-3000:])
    assert "Traceback" not in err
    assert not any("after the sleep" in _stdout(ftrun_home, "after", r) for r in range(2))
