"""scripts/demo.sh's run (scripts/demo_ft.py): a replica SIGKILLed mid-run restarts alone and heals
from a peer while the others keep training, and all end bitwise identical; no warning is printed."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from conftest import ROOT, SCRIPTS


@pytest.mark.quick
def test_demo_shows_a_replica_die_heal_and_the_others_go_on(ftrun_home):
    proc = subprocess.run([sys.executable, str(SCRIPTS / "demo_ft.py"), "--steps", "300", "--kill-at", "100"],
                          capture_output=True, text=True, timeout=240, cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    verdicts = [line for line in proc.stdout.splitlines() if line.startswith("demo: ok: ") or "NOT SO" in line]
    assert len(verdicts) == 5 and all(v.startswith("demo: ok: ") for v in verdicts), verdicts
    assert re.search(r"demo: SIGKILL to rank 1 \(pid \d+\) at step \d+", out), out[-4000:]
    assert "ftrun: rank 1 is training again, healed from a peer" in out
    assert re.search(r"they never stopped", out)
    assert len(set(re.findall(r"\[rank \d\] parameters sha256 (\w+)", out))) == 1
    assert not [line for line in out.splitlines() if "warning" in line.lower()], out[-4000:]
