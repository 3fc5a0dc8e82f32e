"""A failed worker's error comes from TORCHELASTIC_ERROR_FILE (ftrun.wire.WorkerError), written by
ftrun's bootstrap as torch's @record would (or by the script's own @record), not from the words of
the last traceback in its stderr."""

from __future__ import annotations

import json

import pytest

from conftest import run_ftrun

FAIL = (
    "{record_import}"
    "import atexit, os, time\n"
    "def cleanup():\n"
    "    raise OSError('cleanup failed')  # a cleanup of its own fails at exit, after the real error\n"
    "atexit.register(cleanup)\n"
    "{decorator}"
    "def main():\n"
    "    if os.environ['RANK'] == '1':\n"
    "        raise ValueError('bad batch shape')\n"
    "    time.sleep(30)\n"
    "main()\n")


@pytest.mark.parametrize("record", [False, True], ids=["bootstrap", "torch-record"])
def test_the_failure_is_read_from_the_error_file_not_the_last_traceback(ftrun_home, tmp_path, record):
    script = tmp_path / "fail.py"
    script.write_text(FAIL.format(
        record_import="from torch.distributed.elastic.multiprocessing.errors import record\n" if record else "",
        decorator="@record\n" if record else ""))
    proc = run_ftrun(["--nproc", 2, "--shutdown-timeout", 2, script], timeout=90)
    assert proc.returncode == 1, proc.stderr
    # The cleanup's traceback is the last one in the log; the cause is the error file's.
    assert "OSError: cleanup failed" in proc.stderr
    assert "exited 1 with a traceback: ValueError: bad batch shape" in proc.stderr, proc.stderr
    assert "with a traceback: OSError" not in proc.stderr
    files = list(ftrun_home.rglob("rank1/error.json"))
    assert len(files) == 1 and not list(ftrun_home.rglob("rank0/error.json"))
    data = json.loads(files[0].read_text())  # torch elastic's format, whoever wrote it
    assert data["message"]["message"] == "ValueError: bad batch shape"
    assert "fail.py" in data["message"]["extraInfo"]["py_callstack"]
    assert int(data["message"]["extraInfo"]["timestamp"]) > 0
