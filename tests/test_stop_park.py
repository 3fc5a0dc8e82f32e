"""A member parked by a stop under --ft (its step saved, waiting to be stopped) dies of the stop's
signal quietly, whatever the script installed: a SIGTERM handler that only sets a flag (as
Lightning's does) and a DataLoader whose workers share the worker's process group. Real CLI, real
signal; the loader's workers die of the same signal, and torch's SIGCHLD handler used to raise
"DataLoader worker ... is killed by signal" in the park, a traceback per rank on a clean stop.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

from conftest import start_ftrun
from helpers import err_text

SCRIPT = """\
import signal, sys, time
import torch
import ftrun.ft as ft

flagged = []
signal.signal(signal.SIGTERM, lambda *_: flagged.append(1))  # as Lightning's handler: a flag only


class Batches(torch.utils.data.IterableDataset):
    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        while True:
            yield torch.randn(4, generator=g)


loader = iter(torch.utils.data.DataLoader(Batches(), batch_size=8, num_workers=1))
model = torch.nn.Linear(4, 1)
ddp = ft.DistributedDataParallel(model)
opt = ft.Optimizer(torch.optim.SGD(ddp.parameters(), lr=0.01))
for step in ft.steps(int(sys.argv[1])):
    opt.zero_grad()
    ddp(next(loader)).sum().backward()
    opt.step()
    print(f"step {step}", flush=True)
    time.sleep(0.05)
print("loop done", flush=True)
"""


def _log(home: Path, run_id: str, rank: int, name: str) -> str:
    path = home / run_id / "logs" / f"rank{rank}" / name
    return path.read_text(errors="replace") if path.exists() else ""


def test_a_parked_member_dies_of_the_stop_quietly_with_loader_workers(ftrun_home, tmp_path):
    script = tmp_path / "loader_flag.py"
    script.write_text(SCRIPT)
    run = start_ftrun(["--nproc", 2, "--ft", "--run-id", "park", "--checkpoint-dir", tmp_path / "ck",
                       "--shutdown-timeout", 30, script, 100000], files=("stderr",))
    try:
        deadline = time.monotonic() + 180
        while not all("step 5\n" in _log(ftrun_home, "park", r, "stdout.log") for r in range(2)):
            assert run.poll() is None, err_text(run)[-3000:]
            assert time.monotonic() < deadline, "never saw both replicas train\n" + err_text(run)[-3000:]
            time.sleep(0.05)
        run.send_signal(signal.SIGTERM)
        code = run.wait(timeout=120)
    finally:
        run.kill()
    err = err_text(run)
    logs = "".join(_log(ftrun_home, "park", r, "stderr.log") for r in range(2))
    assert code == 128 + signal.SIGTERM, (code, err[-3000:])
    assert "saved" in err or list((tmp_path / "ck").glob("step-*")), err[-3000:]
    for text in (err, logs):
        assert "Traceback" not in text and "DataLoader worker" not in text, text[-3000:]
    assert "loop done" not in _log(ftrun_home, "park", 0, "stdout.log")
