"""The zygote is forked from the supervisor after one torch import (spawn.start_zygote_early):
the store and the workers share that import, and the workers still load torch under their own
environment, as each would as a program of its own under torchrun.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys

from conftest import FTRUN, ROOT
from helpers import needs

# A worker that reports what torch read as it loaded (its thread count from OMP_NUM_THREADS) and
# provokes one of c10d's C++ warnings (a client retrying a closed port), as a script's own store would.
PROBE = """\
import datetime, os, sys, torch, torch.distributed as dist
print(f"threads {torch.get_num_threads()} rank {os.environ['RANK']}", flush=True)
if os.environ["RANK"] == "0":
    try:
        dist.TCPStore("127.0.0.1", 1, None, False, datetime.timedelta(seconds=1))
    except Exception:
        pass
"""


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _cpu_of(cmd, env) -> float:
    before = _children_cpu()
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _children_cpu() - before


def test_one_torch_import_serves_the_store_and_the_zygote(tmp_path):
    """A one-worker run of a script that does nothing costs the CPU of about one torch import,
    not two (the supervisor's for its store and the zygote's): CPU seconds, which load moves far
    less than wall time, against a bare `import torch` measured in turn."""
    script = tmp_path / "noop.py"
    script.write_text("pass\n")
    env = dict(os.environ, FTRUN_HOME=str(tmp_path / "home"))
    ratios = []
    for _ in range(3):
        bare = _cpu_of([sys.executable, "-c", "import torch, torch.distributed"], env)
        run = _cpu_of(FTRUN + ["--nproc", "1", str(script)], env)
        ratios.append(run / bare)
    ratios.sort()
    # Measured on 2 cores under load: 1.66-1.82x with two imports, 0.96-1.02x with one.
    assert ratios[1] < 1.35, ratios


def test_workers_load_torch_under_their_own_environment(tmp_path):
    """Two workers and no OMP_NUM_THREADS: each has one thread, as torchrun's rule gives it at
    the import; and a worker's C++ warnings show, while the supervisor quiets its own."""
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "TORCH_CPP_LOG_LEVEL")}
    env["FTRUN_HOME"] = str(tmp_path / "home")
    proc = subprocess.run(FTRUN + ["--nproc", "2", "--log-dir", str(tmp_path / "logs"), str(script)], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "threads 1 rank 0" in proc.stdout and "threads 1 rank 1" in proc.stdout, proc.stdout
    worker_err = (tmp_path / "logs" / "rank0" / "stderr.log").read_text()
    assert "[W" in worker_err and "TCP client failed to connect" in worker_err, worker_err[-2000:]


@needs("lightning")
def test_an_ft_script_that_imports_lightning_finds_it_imported_at_its_start(tmp_path):
    """--ft and a script whose file imports Lightning: the zygote imported it before its first
    fork, so a restarted replica does not pay that import again (1.3-1.6 s back after a kill,
    against 2.0-2.7 s, measured on the counter model of tests/lightning_counter.py). Without --ft,
    or for a script that does not import it, nothing more is imported."""
    script = tmp_path / "uses_lightning.py"
    script.write_text("import sys\nprint('preloaded', 'lightning' in sys.modules, flush=True)\n"
                      "if False:\n    import lightning.pytorch\n")
    plain = tmp_path / "plain.py"
    plain.write_text("import sys\nprint('preloaded', 'lightning' in sys.modules, flush=True)\n")
    env = dict(os.environ, FTRUN_HOME=str(tmp_path / "home"))

    def preloaded(*args) -> str:
        proc = subprocess.run(FTRUN + ["--nproc", "1", *map(str, args)], env=env, cwd=ROOT, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout.strip()

    assert preloaded("--ft", script) == "[rank 0] preloaded True"
    assert preloaded(script) == "[rank 0] preloaded False"
    assert preloaded("--ft", plain) == "[rank 0] preloaded False"


@needs("transformers")
def test_an_ft_script_that_imports_transformers_finds_the_trainer_imported(tmp_path):
    """The same for the Trainer: `import transformers` alone loads little, so the zygote imports
    transformers.trainer, which a Trainer script's `from transformers import Trainer` loads."""
    script = tmp_path / "uses_trainer.py"
    script.write_text("import sys\nprint('preloaded', 'transformers.trainer' in sys.modules, flush=True)\n"
                      "if False:\n    from transformers import Trainer\n")
    env = dict(os.environ, FTRUN_HOME=str(tmp_path / "home"), HF_HUB_OFFLINE="1")
    proc = subprocess.run(FTRUN + ["--nproc", "1", "--ft", str(script)], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[rank 0] preloaded True", proc.stdout
