"""The shared test helpers (tests/helpers.py) catch what the tests rely on them to catch: a wait
fails naming what it waited for, at once when the process it watches has exited; the replicas'
comparison fails on any difference of their saved state, never on parameters alone. No ftrun
is started."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import assert_identical, read_reports, wait_for, wait_replica, wait_state


@pytest.mark.quick
def test_wait_for_returns_the_value_and_fails_naming_what_it_waited_for(tmp_path):
    calls = []
    assert wait_for(lambda: calls.append(1) or (len(calls) >= 3 and "ready"), 5, "three polls", poll=0.001) == "ready"
    with pytest.raises(AssertionError, match=r"not within 0.05 s: the moon"):
        wait_for(lambda: None, 0.05, "the moon", poll=0.01)
    err = tmp_path / "err.log"
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit('it went wrong')"], stderr=err.open("w"))
    proc.err_path = str(err)
    with pytest.raises(AssertionError, match=r"(?s)exited 1 before the run's end.*it went wrong"):
        wait_for(lambda: False, 60, "the run's end", proc)  # at once, not in 60 s


def test_wait_replica_returns_the_replica_that_has_a_process_and_holds_pred(tmp_path):
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "state.json").write_text(json.dumps({"phase": "running", "replicas": [
        {"rank": 0, "pid": 11, "step": 5}, {"rank": 1, "pid": None, "step": 9}, {"rank": 1, "pid": 12, "step": 7}]}))
    assert wait_replica(tmp_path, "r", 1, lambda r, st: r["step"] >= 7, 5) == {"rank": 1, "pid": 12, "step": 7}
    with pytest.raises(AssertionError, match=r"(?s)not within 0.1 s: rank 0 at step 6.*last state: "):
        wait_replica(tmp_path, "r", 0, lambda r, st: r["step"] >= 6, 0.1, what="rank 0 at step 6")


@pytest.mark.quick
def test_wait_state_fails_at_once_when_the_run_ended(tmp_path):
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "state.json").write_text(json.dumps({"phase": "ended", "exit_summary": "rank 1 failed",
                                                           "replicas": []}))
    with pytest.raises(AssertionError, match="the run ended while waiting for rank 1 back: rank 1 failed"):
        wait_state(tmp_path, "r", lambda st: False, 60, "rank 1 back")


def _save(out, rank: int, step: int = 10, **change) -> None:
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    torch.manual_seed(0)
    for p in model.parameters():
        torch.nn.init.normal_(p)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(4, 3)).sum().backward()
    opt.step()
    state, opt_state = model.state_dict(), opt.state_dict()
    if "buffer" in change:
        state["1.running_mean"] += change["buffer"]
    if "moment" in change:
        opt_state["state"][0]["momentum_buffer"][0, 0] += change["moment"]
    if "lr" in change:
        opt_state["param_groups"][0]["lr"] = change["lr"]
    torch.save(state, f"{out}.rank{rank}.pt")
    torch.save(opt_state, f"{out}.rank{rank}.opt.pt")
    Path(f"{out}.rank{rank}.json").write_text(json.dumps({"step": step}))


@pytest.mark.parametrize("change, needle", [({"buffer": 1e-6}, "parameters.1.running_mean"),
                                            ({"moment": 1e-6}, "optimizer.state.0.momentum_buffer"),
                                            ({"lr": 0.2}, "optimizer.param_groups[0].lr"),
                                            ({"step": 11}, "{0: 10, 1: 11}")])
def test_assert_identical_fails_on_any_difference_of_the_saved_state(tmp_path, change, needle):
    out = tmp_path / "p"
    _save(out, 0)
    _save(out, 1, **change)
    with pytest.raises(AssertionError) as e:
        assert_identical(out, 2)
    assert needle in str(e.value), str(e.value)


def test_assert_identical_passes_on_the_same_state_and_returns_the_first_ranks(tmp_path):
    out = tmp_path / "p"
    for r in (0, 2):
        _save(out, r)
    params, report = assert_identical(out, [0, 2])
    assert report == {"step": 10} and "0.weight" in params
    assert read_reports(out, (0, 2)) == {0: {"step": 10}, 2: {"step": 10}}
