"""`ftrun status` piped or in a narrow terminal cuts no value, and steps/s falls while no step comes."""

from __future__ import annotations

import json
import time

import pytest

from conftest import run_ftrun
from test_status import home, make_run, sup  # noqa: F401 - fixtures

pytestmark = pytest.mark.quick


def test_piped_and_narrow_status_cut_no_value(home, sup):  # noqa: F811
    """Piped (a file, `| less`, a CI log) the table keeps every column whole whatever COLUMNS
    says; in a narrow terminal whole columns give way (rss first), never a value ("st…" for a
    state, "104…" for a step)."""
    from rich.console import Console

    from ftrun.status.render import render
    from ftrun.status.view import collect

    make_run("ftrun-narrow", sup, ft=True, n=3)
    piped = run_ftrun(["status"], timeout=30, env={"FTRUN_HOME": str(home), "COLUMNS": "40"})
    assert piped.returncode == 0, piped.stderr
    header = next(line for line in piped.stdout.splitlines() if line.split()[:2] == ["rank", "pid"])
    assert header.split()[:4] == ["rank", "pid", "state", "restarts"] and "…" not in piped.stdout, piped.stdout
    assert "restarting" in piped.stdout and " 102 " in piped.stdout

    console = Console(width=60, record=True)
    console.print(render(collect(), width=60))
    table = console.export_text().split("rank", 1)[1]
    assert "…" not in table.split("killed by")[0], table
    assert all(len(line) <= 60 for line in table.splitlines()), table
    for value in ("restarting", "running", "100", "101", "102"):
        assert value in table, (value, table)
    assert "rss" not in table.splitlines()[0]


def test_steps_per_s_falls_while_no_step_comes(home, sup):  # noqa: F811
    """A replica stuck for 10 s after going at 9.5 steps/s shows at most one step per 10 s."""
    path = make_run("ftrun-stuck", sup, ft=True, n=2)
    data = json.loads(path.read_text())
    now = time.time()
    data["replicas"][0]["last_step_time"] = now - 10
    data["replicas"][1]["last_step_time"] = now - 0.05
    path.write_text(json.dumps(data))
    r = run_ftrun(["status", "--json"], timeout=30, env={"FTRUN_HOME": str(home)})
    [run] = json.loads(r.stdout)
    assert run["replicas"][0]["steps_per_s"] <= 0.1, run["replicas"][0]
    assert run["replicas"][1]["steps_per_s"] == 9.5, run["replicas"][1]
