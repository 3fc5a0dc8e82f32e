"""Helpers that several test files share, written once: the one-line error of bad input, a run's
state file, the one bounded wait (wait_for, and its forms for a run's state and one replica),
the replicas' reports and the check that they all ended with the same saved state.

A test file never defines its own copy of these (tests/test_house.py checks the names): a copy
drifts, and a weaker one lets a test pass with the feature missing. Fixtures and the plain
runners (run_ftrun, start_ftrun, wait_for_line) are in conftest.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Tuple, TypeVar, Union

import pytest

from conftest import run_ftrun

T = TypeVar("T")
Procs = Union[None, subprocess.Popen, Iterable[subprocess.Popen]]


def needs(*modules: str) -> pytest.MarkDecorator:
    """Skip unless the test-only dependencies `modules` are installed (scripts/test.sh installs
    them), found without importing them: every pytest-xdist worker collects every test file, and
    importing Lightning and transformers there cost each about 15 CPU-s before a test ran."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return pytest.mark.skipif(bool(missing), reason=f"{', '.join(missing)}: a test-only dependency (scripts/test.sh "
                                                    f"installs it, torch unchanged)")


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


def err_text(proc: subprocess.Popen) -> str:
    """What an ftrun started with its stderr in a file wrote there so far."""
    return Path(proc.err_path).read_text()


def _procs(proc: Procs) -> list:
    if proc is None:
        return []
    return [proc] if isinstance(proc, subprocess.Popen) else list(proc)


def _output(procs: list) -> str:
    """The end of what each of `procs` wrote to stderr, for a failure's message: from its file,
    or from its pipe once it has exited (never a read that could block on a live one)."""
    tails = []
    for p in procs:
        if hasattr(p, "err_path"):
            text = err_text(p)
        elif p.poll() is not None and p.stderr is not None and not p.stderr.closed:
            try:
                text = p.communicate(timeout=5)[1] or ""
            except (subprocess.TimeoutExpired, ValueError, OSError):
                text = "(its stderr could not be read)"
        else:
            continue
        tails.append(f"--- stderr of pid {p.pid} (exit {p.returncode}):\n{text[-3000:]}")
    return "\n".join(tails)


def wait_for(pred: Callable[[], T], timeout: float, what: str, proc: Procs = None, poll: float = 0.02,
             show: Optional[Callable[[], str]] = None, before_kill: Optional[Callable[[], str]] = None) -> T:
    """Poll pred() every `poll` s until it returns something truthy, and return that: the suite's
    one bounded wait. Fails, naming `what` (what it waited for), after `timeout` s, or as soon as
    one of `proc` (a process, or several) has exited with pred still false: that one will never
    bring it. The failure shows `show()` (what was last seen), what `before_kill()` found while
    the processes still lived (a timed-out wait) and the processes' stderr; a wait that timed out
    kills them first, so that none outlives a test that has no `finally` for it."""
    procs = _procs(proc)
    deadline = time.monotonic() + timeout
    while True:
        ended = [p for p in procs if p.poll() is not None]  # before pred: what it wrote is seen
        got = pred()
        if got:
            return got
        if ended or time.monotonic() >= deadline:
            if ended:
                why = f"pid {ended[0].pid} exited {ended[0].returncode} before {what}"
            else:
                why = f"not within {timeout:g} s: {what}"
                if before_kill is not None:
                    why += "\n" + before_kill()
                for p in procs:
                    p.kill()
                    p.wait()
            seen = show() if show else (f"last: {got!r}" if got not in (None, False) else "")
            raise AssertionError("\n".join(x for x in (why, seen, _output(procs)) if x))
        time.sleep(poll)


def wait_state(home: Path, folder: str, pred: Callable[[dict], Any], timeout: float, what: str,
               proc: Procs = None, poll: float = 0.02) -> dict:
    """wait_for on run folder `folder`'s state file (see read_state): the state in which
    pred(state) first held. A run that ends first fails at once, with its exit summary."""
    last = [None]

    def check():
        st = read_state(home, folder)
        if not st:
            return None
        last[0] = st
        if st.get("phase") == "ended":
            raise AssertionError(f"the run ended while waiting for {what}: {st.get('exit_summary')}\n"
                                 f"{_output(_procs(proc))}")
        return st if pred(st) else None

    return wait_for(check, timeout, what, proc, poll, show=lambda: f"last state: {last[0]}",
                    before_kill=lambda: worker_stacks(last[0]))


def worker_stacks(state: Optional[dict], wait_s: float = 3.0) -> str:
    """The Python stacks of a run's live workers (from its state), each asked for with ftrun's
    stack-dump signal and read back from its rank's stacks.log: what a stalled run was doing, in
    the failure's message, where a CI log is all there is to read."""
    from ftrun.exits import DUMP_STACKS_SIGNAL

    if not state or not state.get("log_dir"):
        return ""
    asked = {}
    for r in state.get("replicas", []):
        path = Path(state["log_dir"]) / f"rank{r['rank']}" / "stacks.log"
        before = path.stat().st_size if path.exists() else 0
        try:
            os.kill(r["pid"], DUMP_STACKS_SIGNAL)
        except (OSError, TypeError, KeyError):
            continue
        asked[r["rank"]] = (path, before)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and not all(p.exists() and p.stat().st_size > b for p, b in asked.values()):
        time.sleep(0.05)
    time.sleep(0.2)  # the last lines of a dump under way
    parts = []
    for rank, (path, before) in sorted(asked.items()):
        try:
            text = path.read_bytes()[before:].decode(errors="replace")
        except OSError:
            text = ""
        parts.append(f"--- stacks of rank {rank}:\n{text[-2500:] if text else '(none written)'}")
    return "\n".join(parts)


def wait_replica(home: Path, folder: str, rank: int, pred: Callable[[dict, dict], Any], timeout: float = 60.0,
                 proc: Procs = None, what: str = "") -> dict:
    """wait_state until replica `rank` has a process and pred(replica, state) holds; that
    replica's entry (its pid, step, state...)."""
    found = []

    def mine(st):
        found[:] = [r for r in st["replicas"] if r["rank"] == rank and r.get("pid") and pred(r, st)]
        return found

    wait_state(home, folder, mine, timeout, what or f"rank {rank} to reach the awaited state", proc)
    return found[0]


def wait_printed(proc: subprocess.Popen, needle: str, timeout: float = 60.0, stream: str = "stderr",
                 poll: float = 0.05) -> None:
    """wait_for `needle` in what `proc` (started with `stream` in a file: start_ftrun's `files`)
    has written to that stream; a proc that exits first fails at once."""
    path = proc.err_path if stream == "stderr" else proc.out_path
    wait_for(lambda: needle in Path(path).read_text(), timeout, f"{needle!r} on the {stream} of pid {proc.pid}",
             proc, poll)


def replica(st: dict, rank: int) -> dict:
    """Replica `rank`'s entry in a state file (its pid, step, state...)."""
    return next(r for r in st["replicas"] if r["rank"] == rank)


def finish(proc: subprocess.Popen, timeout: float = 120.0, expect: Optional[int] = None) -> Tuple[int, str]:
    """(exit status, stderr) of an ftrun started with its stderr in a file; a run still going after `timeout` s is killed
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


def rank_log(home: Path, folder: str, rank: int) -> str:
    """What rank `rank` of run folder `folder` wrote to its stderr (all incarnations), from the
    run's log folder."""
    st = read_state(home, folder)
    assert st, f"no state for {folder}"
    return (Path(st["log_dir"]) / f"rank{rank}" / "stderr.log").read_text()


def status_record(run_id: str, home: Optional[Path] = None) -> dict:
    """`ftrun status RUN_ID --json`'s record of the run (in runs folder `home`, else FTRUN_HOME's)."""
    r = run_ftrun(["status", run_id, "--json"], timeout=30, env={"FTRUN_HOME": str(home)} if home else None)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)[0]


def load_params(out, world: int) -> list:
    """The parameters each rank of `world` saved to OUT.rankR.pt (the training scripts' --out)."""
    import torch  # here, not at the top: the CLI's tests never load torch in the test process

    return [torch.load(f"{out}.rank{r}.pt", weights_only=True) for r in range(world)]


def read_reports(out, ranks: Union[int, Iterable[int]]) -> dict:
    """{rank: report} of the JSON reports OUT.rankR.json the listed ranks (or ranks 0..N-1) wrote."""
    ranks = range(ranks) if isinstance(ranks, int) else ranks
    return {r: json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in ranks}


def _difference(a, b, where: str) -> Optional[str]:
    """Where two saved states (nested dicts, lists, tensors, numbers) first differ; None if nowhere.
    Tensors must be equal bitwise, in dtype and shape too; keys must be the same on both sides."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        return None if same else where
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return f"{where}: keys {sorted(map(str, a.keys() ^ b.keys()))} on one side only"
        return next((d for k in a if (d := _difference(a[k], b[k], f"{where}.{k}"))), None)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{where}: {len(a)} against {len(b)} items"
        return next((d for i, (x, y) in enumerate(zip(a, b)) if (d := _difference(x, y, f"{where}[{i}]"))), None)
    return None if a == b else f"{where}: {a!r} against {b!r}"


def assert_identical(out, ranks: Union[int, Iterable[int]], optimizer: bool = True,
                     step: bool = True) -> Tuple[dict, dict]:
    """The listed ranks (or ranks 0..N-1) ended with the same whole saved state, bitwise: every
    entry of the model's state dict (parameters and buffers) in OUT.rankR.pt and, with
    `optimizer`, the whole optimizer state dict in OUT.rankR.opt.pt (every moment and counter,
    every param group's settings), and, with `step`, the same "step" in OUT.rankR.json (as
    scripts/train_ft.py writes them). Turn off only what a script does not save. Of one rank, it
    checks that it saved them. Returns the first rank's (parameters, report)."""
    import torch

    ranks = list(range(ranks) if isinstance(ranks, int) else ranks)
    first = ranks[0]
    params = {r: torch.load(f"{out}.rank{r}.pt", weights_only=True) for r in ranks}
    assert params[first], f"rank {first} saved no state"
    opts = {r: torch.load(f"{out}.rank{r}.opt.pt", weights_only=True) for r in ranks} if optimizer else {}
    if optimizer:
        assert opts[first]["state"], f"rank {first} saved no optimizer state"
    for r in ranks[1:]:
        diff = _difference(params[first], params[r], "parameters")
        assert diff is None, f"rank {r} differs from rank {first}: {diff}"
        if optimizer:
            diff = _difference(opts[first], opts[r], "optimizer")
            assert diff is None, f"rank {r} differs from rank {first}: {diff}"
    report = {}
    if step:
        reports = read_reports(out, ranks)
        steps = {r: rep["step"] for r, rep in reports.items()}
        assert len(set(steps.values())) == 1, steps
        report = reports[first]
    return params[first], report


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
