"""Helpers that several test files share, written once: the one-line error of bad input, a run's
state file, and ftrun started with its stderr in a file (so a failing test can show it).

Fixtures and the plain runners (run_ftrun, start_ftrun, wait_for_line) are in conftest.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Optional, Tuple

import pytest

from conftest import FTRUN, ROOT, run_ftrun


def assert_bad(proc: subprocess.CompletedProcess, *needles: str) -> None:
    """Bad input: exit 2, one line on stderr, `ftrun: error: ...` naming each needle, no traceback."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("ftrun: error:") and "Traceback" not in proc.stderr, proc.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])


def read_state(home: Path, folder: str) -> Optional[dict]:
    """The state file of run folder `folder` (a run id, or `ID.nodeK`) under `home`; None while it
    is missing or half-written."""
    try:
        return json.loads((home / folder / "state.json").read_text())
    except (OSError, ValueError):
        return None


def start_logged(args, env=None, cwd=ROOT) -> subprocess.Popen:
    """ftrun with `args`, its stdout discarded and its stderr in a file (`err_text`)."""
    err = tempfile.NamedTemporaryFile("w+", prefix="ftrun-err-", suffix=".log", delete=False)
    proc = subprocess.Popen(FTRUN + [str(a) for a in args], stdout=subprocess.DEVNULL, stderr=err, text=True,
                            env={**os.environ, **(env or {})}, cwd=cwd)
    proc.err_path = err.name
    return proc


def err_text(proc: subprocess.Popen) -> str:
    """What a start_logged ftrun wrote to stderr so far."""
    return Path(proc.err_path).read_text()


def finish(proc: subprocess.Popen, timeout: float = 120.0, expect: Optional[int] = None) -> Tuple[int, str]:
    """(exit status, stderr) of a start_logged ftrun; a run still going after `timeout` s is killed
    and fails the test with its stderr, as does an exit status other than `expect` (when given)."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"ftrun did not finish in {timeout:g} s\n{err_text(proc)[-4000:]}") from None
    err = err_text(proc)
    if expect is not None:
        assert proc.returncode == expect, err[-4000:]
    return proc.returncode, err


def status_record(run_id: str, home: Optional[Path] = None) -> dict:
    """`ftrun status RUN_ID --json`'s record of the run (in runs folder `home`, else FTRUN_HOME's)."""
    r = run_ftrun(["status", run_id, "--json"], timeout=30, env={"FTRUN_HOME": str(home)} if home else None)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)[0]


def load_params(out, world: int) -> list:
    """The parameters each rank of `world` saved to OUT.rankR.pt (the training scripts' --out)."""
    import torch  # here, not at the top: the CLI's tests never load torch in the test process

    return [torch.load(f"{out}.rank{r}.pt", weights_only=True) for r in range(world)]


@contextmanager
def small_tmpfs(where: Path, size: str = "4m", fill: bool = False):
    """A tmpfs of `size` mounted at `where` (a disk that fills up), filled to its last byte when
    `fill`; unmounted at the end. Skips the test where it cannot be mounted (it needs root)."""
    if os.geteuid() != 0:
        pytest.skip("a small disk is a tmpfs, which only root can mount")
    where.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        if fill:
            fill_disk(where)
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def fill_disk(disk: Path, name: str = "filler") -> Path:
    """Take every free byte of `disk` with one file, and return it."""
    filler = disk / name
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    return filler


def restarts_of_kills(err: str, kills: int) -> list:
    """The console's 'restarting it alone' lines of a --ft run killed `kills` times, after checking
    that each kill restarted its replica alone and that any other restart is a survivor's by its
    peers' decision, named as such (where it cannot take the state again in place: see
    tests/test_survivors.py); never a restart for another reason."""
    restarts = [line for line in err.splitlines() if "restarting it alone" in line]
    killed = [line for line in restarts if "killed by SIGKILL" in line]
    assert len(killed) == kills and all("committed state again after" in line for line in restarts
                                        if line not in killed), err[-3000:]
    return restarts


def own_steps(trained, batch, window=1):
    """A process's training steps of `batch` samples, in order: less a redone step's again (a
    step is a window of `window` batches, all trained again) and what stood in for a batch of no
    samples (a filler, one sample at zero weight: this replica's share was done)."""
    out = []
    for b in trained:
        if len(b) == batch and b not in out[-window:]:
            out.append(b)
    return out
