"""One scratch folder for a whole benchmark run, removed when the benchmark ends: `run(main)`.

Every temporary file or folder the benchmark (and each ftrun, torchrun or worker it starts, through
TMPDIR) makes lands under it; it goes on a normal end, an error, Ctrl-C or SIGTERM alike. A
benchmark must never leave its checkpoints and logs behind: one 100M heal writes 3.6 GB.
A benchmark's own worker processes (started with --worker) run without one: they would install
their own SIGTERM handler.
"""
from __future__ import annotations

import contextlib
import multiprocessing.util
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterator


def _as_exit(signum, frame):  # noqa: ARG001
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def scratch(prefix: str) -> Iterator[Path]:
    """A fresh folder under the system's temp folder, the default temp folder until the end."""
    # multiprocessing's own folder (its fork server's socket) is made first, outside: it removes
    # that folder itself at exit, after this one is gone, and would fail on a folder removed here.
    multiprocessing.util.get_temp_dir()
    folder = tempfile.mkdtemp(prefix=prefix)
    before, env_before = tempfile.tempdir, os.environ.get("TMPDIR")
    handler = signal.signal(signal.SIGTERM, _as_exit)
    tempfile.tempdir = folder
    os.environ["TMPDIR"] = folder
    try:
        yield Path(folder)
    finally:
        tempfile.tempdir = before
        if env_before is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = env_before
        signal.signal(signal.SIGTERM, handler)
        shutil.rmtree(folder, ignore_errors=True)


def run(main: Callable[[], None]) -> None:
    """Run a benchmark's `main` in a scratch folder named for its script (as is, for a worker)."""
    if "--worker" in sys.argv:
        main()
        return
    with scratch(f"ftrun-{Path(sys.argv[0]).stem.replace('_', '-')}-"):
        main()
