"""Exit statuses and what a run reports: ftrun's exit status is the run's (0 only when every
worker's work succeeded), its console lines reach the end, and it stops only its own processes.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from conftest import FTRUN, ROOT

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
