"""Comm hooks end to end through the real CLI: 2 CPU workers, gloo, an unmodified DDP script.

Each run checks that DDP itself names ftrun's hook, that ranks end with identical
parameters (except noop, which never syncs), that the loss goes down, and that
the per-rank traffic figures match what the hook sends.
"""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from conftest import ROOT, SCRIPTS, run_ftrun
from helpers import load_params, needs, read_reports
from ftrun.hookspec import parse_hook

CHECK = SCRIPTS / "train_hooks_check.py"
STEPS = 17  # localsgd --period 4 --start-iter 4 averages at step 16, the last one


def _train_with_hooks(tmp_path, hook_args, script_args=()):
    """scripts/train_hooks_check.py on 2 ranks with ftrun's `hook_args`: (its run, the ranks'
    reports, the ranks' parameters)."""
    out = tmp_path / "r"
    proc = run_ftrun(["--nproc", 2, "--log-dir", tmp_path / "logs"] + list(hook_args)
                     + [CHECK, "--steps", STEPS, "--out", out] + list(script_args), timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, list(read_reports(out, 2).values()), load_params(out, 2)


def _spec(args):
    raw = {}
    it = iter(args)
    for a in it:
        key = a.lstrip("-").replace("-", "_")
        raw["name" if key == "hook" else key] = next(it)
    for k in ("rank", "start_iter", "period"):
        if k in raw:
            raw[k] = int(raw[k])
    return parse_hook(raw)


CASES = [
    (["--hook", "allreduce"], ()),
    (["--hook", "fp16"], ()),
    (["--hook", "bf16"], ()),
    (["--hook", "noop"], ()),
    (["--hook", "batched-powersgd", "--rank", "2", "--start-iter", "2", "--wrap", "bf16"], ()),
    (["--hook", "localsgd", "--period", "4", "--start-iter", "4"], ()),
    # before and after start_iter, several buckets, find_unused_parameters=True (the gloo race), state export
    (["--hook", "powersgd", "--rank", "1", "--start-iter", "5", "--wrap", "fp16"],
     ("--find-unused", "--bucket-cap-mb", "0.005", "--hook-state")),
]


# The last case (PowerSGD before and after start_iter, with everything) is in the quick tier. The
# compression hooks on their own are the extended tier's: the PowerSGD cases wrap both of them.
EXTENDED_HOOKS = ("fp16", "bf16", "noop")


def _hook_tier(case):
    if case is CASES[-1]:
        return pytest.mark.quick
    return pytest.mark.extended if case[0][1] in EXTENDED_HOOKS else ()
@pytest.mark.parametrize("hook_args,script_args", [
    pytest.param(*c, id=" ".join(c[0][1:]), marks=_hook_tier(c)) for c in CASES])
def test_hook_trains_two_workers(ftrun_home, tmp_path, hook_args, script_args):
    from ftrun.worker.hooks import comm_hook_name

    spec = _spec(hook_args)
    proc, reports, params = _train_with_hooks(tmp_path, hook_args, script_args)
    r0 = reports[0]
    # DDP's own logging data names ftrun's hook
    log = proc.stdout + proc.stderr  # shown with any failure below
    assert r0["comm_hook"] == comm_hook_name(spec) == reports[1]["comm_hook"], log
    assert spec.label in r0["comm_hook"]
    # each rank said once, in its log, which hook it registered, and gave figures at exit;
    # the console has rank 0's lines only (rank 1's say the same)
    for r in (0, 1):
        rank_log = (tmp_path / "logs" / f"rank{r}" / "stderr.log").read_text()
        assert rank_log.count(f"ftrun: rank {r}: registered DDP comm hook {spec.describe()}") == 1, rank_log
        assert re.search(rf"ftrun: rank {r}: hook {re.escape(spec.label)} step {STEPS}: .* \(at exit\)", rank_log), \
            rank_log
    ours = [line for line in proc.stderr.splitlines() if line.startswith("[rank") and "ftrun: rank" in line]
    assert len(ours) == 2, log
    assert ours[0].startswith(f"[rank 0] ftrun: rank 0: registered DDP comm hook {spec.describe()}"), log
    assert ours[1].startswith(f"[rank 0] ftrun: rank 0: hook {spec.label} step {STEPS}: "), log
    assert ours[1].endswith("(at exit)"), log
    # loss goes down
    losses = r0["losses"]
    assert sum(losses[-3:]) < 0.7 * sum(losses[:3]), (losses, log)
    same = all(torch.equal(params[0][k], params[1][k]) for k in params[0])
    assert same == (spec.name != "noop"), log
    # traffic figures
    st = r0["ftrun"]
    assert st["hook"] == spec.label and st["steps"] == STEPS and not st["overridden"]
    dense = st["dense_bytes_per_step"]
    m = st["models"][0]
    if spec.name == "allreduce":
        assert st["bytes_per_step"] == dense
    elif spec.name in ("fp16", "bf16"):
        assert st["bytes_per_step"] == dense / 2
    elif spec.name == "noop":
        assert st["bytes_per_step"] == 0
    elif spec.name == "localsgd":
        # 4 steps of allreduce, then no gradients at all; parameters averaged at steps 4, 8, 12, 16
        assert m["localsgd"]["averaging_bytes"] == 4 * dense
        assert st["bytes_sent"] == 4 * dense + 4 * dense
    else:
        ps = m["powersgd"]
        assert ps["iter"] == STEPS and ps["compression_rate"] > 3 and ps["numel_before"] > 0
        half = dense / 2  # --wrap fp16/bf16
        assert m["last_step_bytes"] < half / 3  # compressing now
        if spec.name == "powersgd":
            assert st["bytes_sent"] > 5 * half  # the first 5 steps were plain (fp16) allreduce
            assert r0["reloaded_equal"] is True
            assert r0["after_reset"]["error"] == r0["after_reset"]["p"] == 0
            state = torch.load(tmp_path / "r.rank0.hook.pt", weights_only=True)
            assert state["iter"] == STEPS and state["error"] and state["p"] and state["q"]


def test_script_that_registers_its_own_hook_keeps_it(ftrun_home, tmp_path):
    proc, reports, params = _train_with_hooks(tmp_path, ["--hook", "powersgd", "--start-iter", "2"], ["--own-hook"])
    assert all(r["comm_hook"] == "fp16_compress_hook" for r in reports)
    for r in (0, 1):
        warn = [l for l in proc.stderr.splitlines() if l.startswith(f"[rank {r}]") and "warning" in l]
        assert len(warn) == 1 and "fp16_compress_hook" in warn[0] and "powersgd" in warn[0], warn
    assert "registered DDP comm hook" not in proc.stderr
    assert reports[0]["ftrun"]["overridden"][0]["script_hook"] == "fp16_compress_hook"
    assert all(torch.equal(params[0][k], params[1][k]) for k in params[0])


def test_no_hook_means_no_patch(monkeypatch):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ftrun.worker import inject

    before = DDP.__init__
    for value in (None, "", "  "):
        if value is None:
            monkeypatch.delenv("FTRUN_HOOK", raising=False)
        else:
            monkeypatch.setenv("FTRUN_HOOK", value)
        assert inject.install_from_env() is None
    assert DDP.__init__ is before


LIGHTNING_SCRIPT = SCRIPTS / "train_lightning_check.py"


@needs("lightning")
def test_lightning_ddp_strategy_gets_the_hook(ftrun_home, tmp_path):
    out = tmp_path / "l"
    proc = run_ftrun(["--nproc", 2, "--hook", "fp16", LIGHTNING_SCRIPT, "--out", out], timeout=180,
                     env={"PL_DISABLE_FORK": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    reports = [json.loads(open(f"{out}.rank{r}.json").read()) for r in (0, 1)]
    assert all(r["comm_hook"] == "ftrun.fp16(fp16_compress_hook)" for r in reports), reports
    assert reports[0]["checksum"] == reports[1]["checksum"]
    assert reports[0]["last_loss"] < reports[0]["first_loss"]
    assert reports[0]["ftrun"]["bytes_per_step"] == reports[0]["ftrun"]["dense_bytes_per_step"] / 2


def _reference_diloco(steps: int, period: int, outer_lr: float, outer_momentum: float, world: int = 2,
                      fragments: int = 1, delay: int = 0) -> list:
    """DiLoCo written out in one process, as the papers give it, on train_hooks_check.py's model and
    data: each replica steps its own SGD; every `period` steps the average of (global - local) is the
    outer optimizer's gradient (SGD, Nesterov momentum) and every replica takes the new global model.
    Streaming (`fragments`, `delay`): fragment f's average is taken at the steps where
    steps % period == f * period // fragments and applied `delay` steps later, when every replica
    takes the fragment's new global tensors. Each replica's state_dict at the end."""
    import importlib.util

    from ftrun.worker.diloco import split_fragments

    spec = importlib.util.spec_from_file_location("train_hooks_check", CHECK)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    torch.manual_seed(0)
    base = mod.Net(32, 64, False)
    models = [mod.Net(32, 64, False) for _ in range(world)]
    for m in models:
        m.load_state_dict(base.state_dict())
    inner = [torch.optim.SGD(m.parameters(), lr=0.02, momentum=0.9) for m in models]
    anchor = [p.detach().clone() for p in base.parameters()]
    outer = torch.optim.SGD(anchor, lr=outer_lr, momentum=outer_momentum, nesterov=outer_momentum > 0)
    frags = split_fragments([a.numel() for a in anchor], fragments)
    assert sorted(i for f in frags for i in f) == list(range(len(anchor)))
    offsets = [f * period // fragments for f in range(fragments)]
    true_w = torch.randn(32, 1, generator=torch.Generator().manual_seed(1))
    pending = []  # (due, fragment, averages)

    def apply(f, means):
        with torch.no_grad():
            for i in frags[f]:
                anchor[i].grad = means[i]
            outer.step()
            for i in frags[f]:
                anchor[i].grad = None
                for m in models:
                    list(m.parameters())[i].copy_(anchor[i])

    for step in range(steps):
        for rank, (m, opt) in enumerate(zip(models, inner)):
            g = torch.Generator().manual_seed(step * world + rank)
            x = torch.randn(32, 32, generator=g)
            loss = torch.nn.functional.mse_loss(m(x), torch.tanh(x @ true_w))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        count = step + 1
        for due, f, means in [p for p in pending if p[0] <= count]:
            pending.remove((due, f, means))
            apply(f, means)
        for f, off in enumerate(offsets):
            if count % period == off:
                with torch.no_grad():
                    means = {i: sum(anchor[i] - list(m.parameters())[i] for m in models) / world for i in frags[f]}
                if delay:
                    pending.append((count + delay, f, means))
                else:
                    apply(f, means)
    return [{k: v.detach() for k, v in m.state_dict().items()} for m in models]


# Periodic averaging (outer lr 1, no momentum) is DiLoCo's simplest case: the extended tier's.
@pytest.mark.parametrize("outer", [pytest.param(("0.7", "0.9"), id="nesterov"),
                                   pytest.param(("1", "0"), id="plain-averaging", marks=pytest.mark.extended)])
def test_diloco_sends_only_at_syncs_and_trains_what_diloco_trains(ftrun_home, tmp_path, outer):
    """--hook diloco --period 4 on an unmodified DDP script, 2 workers, 16 steps: no byte crosses
    between syncs (4 syncs of the whole model, nothing else), the replicas end bitwise identical, the
    parameters are those of DiLoCo written out in one process (tests' reference), the outer state
    round-trips through hook_state_dict, and --outer-lr 1 --outer-momentum 0 is periodic averaging."""
    lr, mom = outer
    out = tmp_path / "r"
    proc = run_ftrun(["--nproc", 2, "--log-dir", tmp_path / "logs", "--hook", "diloco", "--period", 4,
                      "--outer-lr", lr, "--outer-momentum", mom, CHECK, "--steps", 16, "--out", out, "--hook-state"],
                     timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    reports = [json.loads((tmp_path / f"r.rank{r}.json").read_text()) for r in (0, 1)]
    params = [torch.load(tmp_path / f"r.rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert all(torch.equal(params[0][k], params[1][k]) for k in params[0])
    ref = _reference_diloco(16, 4, float(lr), float(mom))[0]
    for k in ref:
        assert torch.allclose(params[0][k], ref[k], rtol=1e-5, atol=1e-6), (k, (params[0][k] - ref[k]).abs().max())
    st = reports[0]["ftrun"]
    m = st["models"][0]
    dense = st["dense_bytes_per_step"]
    assert m["diloco"] == {"steps": 16, "syncs": 4, "period": 4, "next_sync": 20, "sync_bytes": 4 * dense}
    assert st["bytes_sent"] == 4 * dense  # the four syncs, and not one byte in the 16 backward passes
    assert reports[0]["reloaded_equal"] is True
    assert "DiLoCo: 4 syncs of" in proc.stderr and "the next at step 20" in proc.stderr
    losses = reports[0]["losses"]
    assert sum(losses[-3:]) < 0.7 * sum(losses[:3]), losses


def test_streaming_diloco_syncs_one_fragment_at_a_time_and_trains_what_streaming_diloco_trains(ftrun_home, tmp_path):
    """--fragments 2 --sync-delay 1 --period 4, 17 steps: the two fragments (this model's first layer,
    and the other two) each sync every 4 steps at their own offsets (2, 6, 10, 14 and 4, 8, 12,
    16), each average applied a step after it was started; nothing else crosses; each replica's
    parameters are those of streaming DiLoCo written out in one process, and the fragment applied
    last (at step 17) is bitwise the same on both replicas."""
    proc, reports, params = _train_with_hooks(tmp_path, ["--hook", "diloco", "--period", 4, "--fragments", 2,
                                                         "--sync-delay", 1])
    refs = _reference_diloco(STEPS, 4, 0.7, 0.9, fragments=2, delay=1)
    for rank in (0, 1):
        for k in refs[rank]:
            assert torch.allclose(params[rank][k], refs[rank][k], rtol=1e-5, atol=1e-6), (rank, k)
    assert all(torch.equal(params[0][k], params[1][k]) for k in ("a.weight", "a.bias"))
    assert not torch.equal(params[0]["b.weight"], params[1]["b.weight"])  # its last average landed at 15
    st = reports[0]["ftrun"]
    d = st["models"][0]["diloco"]
    assert d == {"steps": 17, "syncs": 8, "period": 4, "next_sync": 18, "fragments": 2, "sync_delay": 1,
                 "in_flight": 0, "sync_bytes": 4 * st["dense_bytes_per_step"]}
    assert st["bytes_sent"] == d["sync_bytes"]  # each fragment four times, and not a byte in a backward pass


def test_int8_streaming_diloco_sends_a_quarter_and_resumes_bitwise_with_a_sync_in_flight(ftrun_home, tmp_path):
    """--wrap int8 with --fragments 2 --sync-delay 1: a sync sends the fragment's pseudo-gradient as
    int8 with a scale per replica's chunk (a quarter of fp32's bytes, and the scales), the replicas
    end close to fp32 streaming DiLoCo and bitwise the same on the fragment applied last. Saved
    after step 10, while fragment 1's sync is in flight (its chunks exchanged, the gather of the
    averages not started), by a script whose rank 0 reads the hook state alone first, and resumed in
    new processes: each replica ends bitwise where the uninterrupted run does (the global model, the
    outer momentum, each replica's int8 error feedback and the sync in flight are in the state)."""
    hook = ["--hook", "diloco", "--period", 4, "--fragments", 2, "--sync-delay", 1, "--wrap", "int8"]
    (tmp_path / "full").mkdir()
    proc, reports, full = _train_with_hooks(tmp_path / "full", hook)
    st = reports[0]["ftrun"]
    numel = st["dense_bytes_per_step"] // 4
    # 8 syncs, 4 of each fragment (2112 and 4225 tensors' elements), padded to 2 chunks, 2 fp32 scales each
    assert st["models"][0]["diloco"]["sync_bytes"] == 4 * (2112 + 4226) + 8 * 2 * 4
    assert st["models"][0]["diloco"]["sync_bytes"] < 0.26 * 4 * st["dense_bytes_per_step"]
    assert numel == 6337
    assert all(torch.equal(full[0][k], full[1][k]) for k in ("a.weight", "a.bias"))
    ref = _reference_diloco(STEPS, 4, 0.7, 0.9, fragments=2, delay=1)
    for rank in (0, 1):
        for k in ref[rank]:
            assert torch.allclose(full[rank][k], ref[rank][k], rtol=0, atol=2e-3), (rank, k)
    ck = tmp_path / "ck"
    args = ["--nproc", 2, "--log-dir", tmp_path / "logs2"] + hook + [CHECK, "--steps", STEPS, "--ckpt", ck]
    saved = run_ftrun(args + ["--save-at", 10], timeout=120)
    assert saved.returncode == 0, saved.stdout + saved.stderr
    state = torch.load(f"{ck}.rank0.pt", weights_only=True)["hook"]
    assert [(p["fragment"], p["due"], [x["stage"] for x in p["exchanges"]]) for p in state["pending"]] == \
        [(1, 11, ["gather"])]
    assert set(state["error"]) == {"0.0", "1.0"}
    resumed = run_ftrun(args + ["--resume", ck, "--out", tmp_path / "res"], timeout=120)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    again = load_params(tmp_path / "res", 2)
    for rank in (0, 1):
        assert all(torch.equal(full[rank][k], again[rank][k]) for k in full[rank]), rank


@pytest.mark.quick
def test_a_diloco_state_saved_with_other_fragments_or_wrap_is_refused_in_one_line():
    """Its fed-back errors and syncs in flight belong to tensors cut otherwise: loading it would
    break mid-training (a shape mismatch at the next sync), or worse, fit and be wrong."""
    from ftrun.worker.diloco import Outer

    params = [torch.nn.Parameter(torch.randn(4, 4)) for _ in range(4)]
    saved = Outer(params, 8, 0.7, 0.9, None, "int8", fragments=2).state_dict()
    Outer(params, 8, 0.7, 0.9, None, "int8", fragments=2).load_state_dict(saved)  # the same options: taken
    for wrap, fragments in (("int8", 4), (None, 2)):
        with pytest.raises(ValueError) as e:
            Outer(params, 8, 0.7, 0.9, None, wrap, fragments=fragments).load_state_dict(saved)
        msg = str(e.value)
        assert "\n" not in msg and "saved with --fragments 2 --wrap int8" in msg and "resume with the options" in msg


def test_more_fragments_than_the_model_has_tensors_is_one_line_on_each_rank(ftrun_home, tmp_path):
    """The launcher cannot know the model: its first forward says so, in one line per rank, no traceback."""
    proc = run_ftrun(["--nproc", 2, "--log-dir", tmp_path / "logs", "--hook", "diloco", "--period", 8,
                      "--fragments", 7, CHECK, "--steps", 2], timeout=120)
    assert proc.returncode != 0
    for rank in (0, 1):
        assert f"[rank {rank}] ftrun: error: --fragments 7: this model has 6 trained tensors" in proc.stderr, proc.stderr
    assert "use --fragments 6 or fewer" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("hook", ["diloco", "localsgd"])
def test_diloco_and_localsgd_under_ft_are_one_line(ftrun_home, hook):
    """Both sync parameters after the script's optimizer step, outside the --ft round (localsgd
    under --ft crashed at start: its per-node subgroup needs a default process group)."""
    from helpers import assert_bad

    proc = run_ftrun(["--nproc", 2, "--ft", "--hook", hook, "--period", 4, CHECK], timeout=60)
    assert_bad(proc, f"--hook {hook}", "--ft")
