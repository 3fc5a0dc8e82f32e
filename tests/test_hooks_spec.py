"""HookSpec: parsing, JSON round trip and every bad input, caught in the launcher (exit 2, nothing started)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import ROOT, SCRIPTS, run_ftrun
from ftrun.errors import ConfigError
from ftrun.hookspec import HOOK_NAMES, HOOK_PARAMS, HookSpec, parse_hook

TRAIN = SCRIPTS / "train_hooks_check.py"


@pytest.mark.quick
def test_every_hook_round_trips_through_json():
    for name in HOOK_NAMES:
        raw = {"name": name, "period": 4} if name in ("localsgd", "diloco") else {"name": name}
        spec = parse_hook(raw)
        assert HookSpec.from_json(spec.to_json()) == spec
    spec = parse_hook({"name": "powersgd", "rank": 2, "start_iter": 10, "error_feedback": False, "warm_start": False,
                       "min_compression_rate": 1.5, "orthogonalization_epsilon": 1e-8, "seed": 3,
                       "batch_same_shape": True, "wrap": "fp16"})
    assert HookSpec.from_json(spec.to_json()) == spec
    eff = spec.effective_params()
    assert set(eff) == set(HOOK_PARAMS["powersgd"]) and eff["rank"] == 2 and eff["warm_start"] is False
    assert parse_hook({"name": "powersgd"}).effective_params()["start_iter"] == 1000


@pytest.mark.parametrize("raw,needles", [
    ({"name": "gossip"}, ["unknown hook 'gossip'", "powersgd", "localsgd"]),
    ({"name": "fp16", "rank": 2}, ["--rank", "'fp16'", "no parameters"]),
    ({"name": "localsgd", "period": 2, "rank": 1}, ["--rank", "--period"]),
    ({"name": "batched-powersgd", "min_compression_rate": 2}, ["--min-compression-rate", "batched-powersgd"]),
    ({"name": "powersgd", "rank": 0}, ["--rank 0", ">= 1"]),
    ({"name": "powersgd", "rank": -2}, ["--rank -2", ">= 1"]),
    ({"name": "powersgd", "start_iter": -1}, ["--start-iter -1", ">= 0"]),
    ({"name": "powersgd", "start_iter": 1}, ["--start-iter 1", "error feedback", "--no-error-feedback --no-warm-start"]),
    ({"name": "batched-powersgd", "start_iter": 0, "error_feedback": False}, ["--start-iter 0", "warm start"]),
    ({"name": "noop", "wrap": "fp16"}, ["--wrap fp16", "noop"]),
    ({"name": "fp16", "wrap": "bf16"}, ["--wrap bf16", "'fp16'"]),
    ({"name": "powersgd", "wrap": "int8"}, ["--wrap int8", "DiLoCo", "--wrap fp16 or bf16"]),
    ({"name": "allreduce", "wrap": "fp8"}, ["--wrap 'fp8'", "fp16, bf16, int8"]),
    ({"name": "diloco", "period": 4, "fragments": 5}, ["--fragments 5", "--period 4", "--fragments 4 or fewer"]),
    ({"name": "diloco", "period": 4, "fragments": 0}, ["--fragments 0", ">= 1"]),
    ({"name": "diloco", "period": 8, "fragments": 4, "sync_delay": 2}, ["--sync-delay 2", "--sync-delay 1 or less"]),
    ({"name": "diloco", "period": 4, "sync_delay": -1}, ["--sync-delay -1", ">= 0"]),
    ({"name": "localsgd", "period": 4, "fragments": 2}, ["--fragments", "'localsgd'"]),
    ({"name": "localsgd"}, ["--period", "localsgd"]),
    ({"name": "localsgd", "period": 0}, ["--period 0", ">= 1"]),
    ({"name": "diloco"}, ["--period", "diloco"]),
    ({"name": "diloco", "period": 4, "outer_momentum": 1.0}, ["--outer-momentum 1", "below 1"]),
    ({"name": "diloco", "period": 4, "outer_lr": -0.1}, ["--outer-lr -0.1", ">= 0"]),
    ({"name": "localsgd", "period": 4, "outer_lr": 0.5}, ["--outer-lr", "'localsgd'"]),
    ({"name": "powersgd", "rank": 1.5}, ["--rank", "whole number"]),
    ({"name": "powersgd", "frobs": 1}, ["unknown hook parameter 'frobs'"]),
])
@pytest.mark.quick
def test_bad_hook_input_is_one_line(raw, needles):
    with pytest.raises(ConfigError) as e:
        parse_hook(raw)
    msg = str(e.value)
    assert "\n" not in msg
    for n in needles:
        assert n in msg, msg


def test_start_iter_1_is_fine_without_error_feedback_and_warm_start():
    spec = parse_hook({"name": "powersgd", "start_iter": 0, "error_feedback": False, "warm_start": False})
    assert spec.effective_params()["start_iter"] == 0


@pytest.mark.parametrize("args,needle", [
    (["--hook", "gossip"], "unknown hook 'gossip'"),
    (["--hook", "fp16", "--rank", "2"], "--rank does not apply to hook 'fp16'"),
    (["--hook", "powersgd", "--rank", "0"], "--rank 0"),
    (["--hook", "powersgd", "--start-iter", "-3"], "--start-iter -3"),
    (["--hook", "powersgd", "--start-iter", "1"], "--start-iter 1 is too small"),
    (["--hook", "noop", "--wrap", "bf16"], "--wrap bf16 cannot wrap hook 'noop'"),
    (["--hook", "allreduce", "--wrap", "fp8"], "--wrap 'fp8'"),
    (["--hook", "localsgd"], "needs --period"),
    (["--hook", "diloco", "--period", "4", "--sync-delay", "4"], "--sync-delay 4 is out of range"),
    (["--hook", "powersgd", "--wrap", "int8"], "--wrap int8 quantizes DiLoCo's pseudo-gradients only"),
])
def test_cli_exits_2_before_starting_anything(ftrun_home, args, needle):
    proc = run_ftrun(["--nproc", "2"] + args + [TRAIN], timeout=30)
    assert proc.returncode == 2, proc.stderr
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("ftrun: error:") and needle in lines[0], proc.stderr
    assert "[rank" not in proc.stdout + proc.stderr  # no worker started


def test_hookspec_never_imports_torch():
    code = "import sys, ftrun.hookspec, ftrun.config; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
