"""Shared helpers: run the real `ftrun` CLI in a subprocess, isolated per test."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"
FTRUN = [sys.executable, "-m", "ftrun"]


@pytest.fixture
def ftrun_home(tmp_path, monkeypatch):
    """A private runs folder per test, so tests never see each other's runs."""
    home = tmp_path / "ftrun-home"
    monkeypatch.setenv("FTRUN_HOME", str(home))
    return home


def run_ftrun(args, timeout=120, env=None, cwd=None, check=False) -> subprocess.CompletedProcess:
    """Run `ftrun ARGS` to completion and return its CompletedProcess (text)."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    proc = subprocess.run(FTRUN + [str(a) for a in args], capture_output=True, text=True, timeout=timeout,
                          env=full_env, cwd=cwd or ROOT)
    if check and proc.returncode != 0:
        raise AssertionError(f"ftrun {args} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


def start_ftrun(args, env=None, cwd=None, **kw) -> subprocess.Popen:
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.Popen(FTRUN + [str(a) for a in args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=full_env, cwd=cwd or ROOT, **kw)
