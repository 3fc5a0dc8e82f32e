"""What reaches the console by default: the script's lines and ftrun's few lines about the run;
ftrun's per-rank chatter from inside the workers goes to the rank's log file (issue 18, item 2)."""

from __future__ import annotations

import re

import pytest

from conftest import SCRIPTS, run_ftrun

TRAIN = SCRIPTS / "train_ft.py"
AT_EXIT = r"\[rank 0\] ftrun: rank 0: hook allreduce step 250: sent \d+ B/step \(plain allreduce: \d+ B/step\) \(at exit\)"


@pytest.mark.quick
def test_a_failure_free_ft_run_prints_only_what_matters(ftrun_home, tmp_path, monkeypatch):
    monkeypatch.delenv("FTRUN_VERBOSE", raising=False)
    logs = tmp_path / "logs"
    proc = run_ftrun(["--nproc", 3, "--ft", "--log-dir", logs, TRAIN, "--steps", 250, "--print-every", 100])
    assert proc.returncode == 0, proc.stderr
    err = proc.stderr.splitlines()
    # ftrun's own lines: the start, the quorum, the end and the goodput summary (two lines)
    ours = [line for line in err if line.startswith("ftrun: ")]
    assert len(ours) == 5, err
    assert ours[0].startswith("ftrun: run ") and "3 workers of" in ours[0], ours
    assert ours[1] == "ftrun: quorum 1: 3 replicas (first replicas joined)", ours
    assert re.fullmatch(r"ftrun: run \S+ finished in [\d.]+ s", ours[2]), ours
    assert re.match(r"ftrun: goodput [\d.]+%: ", ours[3]) and ours[4].startswith("ftrun: lost: start-up "), ours
    # from the workers' stderr: the traffic figures once, at the end, from one rank
    from_workers = [line for line in err if line.startswith("[rank")]
    assert len(from_workers) == 1 and re.fullmatch(AT_EXIT, from_workers[0]), from_workers
    # the script's own lines, every one of them
    for r in range(3):
        assert f"[rank {r}] done at step 250" in proc.stdout.splitlines(), proc.stdout
        assert f"[rank {r}] step 200 loss" in proc.stdout, proc.stdout
    # the per-rank lines are in each rank's log
    for r in range(3):
        log = (logs / f"rank{r}" / "stderr.log").read_text()
        assert f"ftrun.ft: detail: rank {r} (incarnation 0) joined quorum 1 at step 0" in log, log
        assert f"ftrun: rank {r}: hook allreduce step 100: sent" in log, log
        assert re.search(rf"ftrun: rank {r}: hook allreduce step 250: .* \(at exit\)", log), log
        if r:
            assert re.search(rf"ftrun\.ft: detail: rank {r}: received [\d.]+ MB of state from rank 0", log), log


def test_verbose_brings_the_per_rank_lines_back(ftrun_home, tmp_path):
    proc = run_ftrun(["--nproc", 2, "--ft", TRAIN, "--steps", 120, "--print-every", 100],
                     env={"FTRUN_VERBOSE": "1"})
    assert proc.returncode == 0, proc.stderr
    for r in range(2):
        assert f"[rank {r}] ftrun.ft: detail: rank {r} (incarnation 0) joined quorum 1" in proc.stderr, proc.stderr
        assert f"[rank {r}] ftrun: rank {r}: hook allreduce step 100: sent" in proc.stderr, proc.stderr
        assert re.search(rf"\[rank {r}\] ftrun: rank {r}: hook allreduce step 120: .* \(at exit\)", proc.stderr)
    assert "[rank 1] ftrun.ft: detail: rank 1: received" in proc.stderr, proc.stderr


USER = """\
import sys
print("ftrun: rank 0: a line of the script's own", file=sys.stderr, flush=True)
print("ftrun.ft rank 0: the script's too", file=sys.stderr, flush=True)
print("rank 0: hook allreduce step 100: sent nothing", file=sys.stderr, flush=True)
print("to stdout", flush=True)
"""


@pytest.mark.quick
def test_the_scripts_own_lines_are_never_held_back(ftrun_home, tmp_path, monkeypatch):
    monkeypatch.delenv("FTRUN_VERBOSE", raising=False)
    script = tmp_path / "user.py"
    script.write_text(USER)
    proc = run_ftrun(["--nproc", 1, script])
    assert proc.returncode == 0, proc.stderr
    for line in USER.splitlines()[1:4]:
        said = line.split('"')[1]
        assert f"[rank 0] {said}" in proc.stderr.splitlines(), proc.stderr
    assert "[rank 0] to stdout" in proc.stdout.splitlines()
