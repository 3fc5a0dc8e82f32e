"""Bad input: one line naming the problem and the fix, exit 2, nothing started; no torch on the CLI path."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from conftest import ROOT, SCRIPTS, run_ftrun

TRAIN = SCRIPTS / "train_ddp.py"


def _assert_bad(proc, *needles):
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("ftrun: error:"), lines[0]
    assert "Traceback" not in proc.stderr
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.mark.parametrize("args,needles", [
    (["missing_script.py"], ["missing_script.py", "not found"]),
    (["--nproc", "0", str(TRAIN)], ["--nproc", "at least 1"]),
    (["--nproc", "-3", str(TRAIN)], ["--nproc"]),
    (["--nproc", "four", str(TRAIN)], ["--nproc", "whole number"]),
    (["--frobnicate", str(TRAIN)], ["No such option: --frobnicate"]),
    (["--shutdown-timeout", "-1", str(TRAIN)], ["--shutdown-timeout", ">= 0"]),
    (["--step-timeout", "-5", str(TRAIN)], ["--step-timeout", ">= 0"]),
    (["-m", "no_such_module_xyz"], ["no_such_module_xyz", "no module"]),
    (["--max-restarts", "-1", str(TRAIN)], ["--max-restarts"]),
    (["--ranks", "0,9", "--nproc", "2", str(TRAIN)], ["--ranks", "0..1"]),
    (["--nproc", "2"], ["no training script"]),
])
def test_bad_input_exits_2_with_one_line(ftrun_home, args, needles):
    proc = run_ftrun(args, timeout=30)
    _assert_bad(proc, *needles)
    assert not ftrun_home.exists() or not any(ftrun_home.iterdir()), "a run was started"


def test_port_in_use(ftrun_home):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        proc = run_ftrun(["--master-port", port, TRAIN], timeout=30)
    _assert_bad(proc, f"--master-port {port}", "in use")


def test_help_and_version_do_not_import_torch():
    code = ("import sys\nfrom ftrun.cli import main\n"
            "for argv in (['--help'], ['run', '--help'], ['--version'], ['status'], ['recipes']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "--nproc" in proc.stdout and "--max-restarts" in proc.stdout


def test_python_dash_m_ftrun_works():
    proc = subprocess.run([sys.executable, "-m", "ftrun", "--version"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0 and proc.stdout.startswith("ftrun ")
