"""--ft for an unmodified Hugging Face Trainer script: only the killed replica restarts, its train()
goes on mid-epoch with the Trainer's whole state from a peer, and every sample is trained once an
epoch (the counter model of tests/hf_counter.py). Real CLI, real SIGKILL, CPU gloo, no download."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import ROOT, start_ftrun
from helpers import finish, needs, own_steps, read_reports
from test_ft_data import _kill_at

pytestmark = needs("transformers", "accelerate")

WORKER = ROOT / "tests" / "hf_counter.py"
os.environ["HF_HUB_OFFLINE"] = "1"  # nothing comes from a hub: models from configs, data synthetic


def _strengths(report, epochs, accumulate=1):
    """Each (epoch, sample) weight is -1/n for the n replicas of the one committed step that
    trained it (-1/(k n) with gradient_accumulation_steps=k): once, at full or reduced strength."""
    strengths = {}
    for e in range(epochs):
        for i, w in enumerate(report["weights"][e]):
            n = next((n for n in (3, 2, 1) if abs(w + 1 / (accumulate * n)) < 1e-5), None)
            assert n is not None, (e, i, w)
            strengths.setdefault(e, set()).add(n)
    return strengths


def test_unmodified_trainer_script_heals_mid_epoch(ftrun_home, tmp_path):
    """Three replicas, 2 epochs of 15 steps of 2 accumulated batches (epoch 1 slower, for the
    restarted replicas to come back in it), a loader with 2 workers (prefetching batches planned
    for a membership that changes); replica 1 killed early in epoch 1, then replica 2: the run
    finishes, each restarted replica's train() went on where the run was (not from step 0), every
    sample was trained once an epoch (every weight is -1/(2n): a redone step trained both its
    batches again, not only the last, and never twice), and the replicas end identical. With
    bf16=True: every training forward ran under bf16 autocast, the restarted replicas' (healed,
    redone steps) too. A stateful callback's count of steps (ExportableState) ends at the global
    step on every replica: the restarted ones received it from a peer. With ddp_backend="gloo"
    (what the HF docs give for CPU: the backend of a group of all workers, which --ft does not
    form), as with none; the replicas' whole state (model, optimizer, schedule, TrainerState)
    ends the same."""
    out, size, epochs, steps = tmp_path / "o", 180, 2, 15
    proc = start_ftrun(["--nproc", 3, "--ft", "--max-restarts", 4, "--run-id", "hf", WORKER, epochs, out,
                        "--size", size, "--batch", 2, "--sleep", 0.08, "--sleep-late", 0.4,
                        "--workers", 2, "--accumulate", 2, "--bf16", "--ddp-backend", "gloo"], files=("stderr",))
    try:
        _kill_at(ftrun_home, "hf", proc, [(1, steps + 1), (2, steps + 4)])
        rc, err = finish(proc, 300)
    finally:
        proc.kill()
    assert rc == 0, err[-3000:]
    assert err.count("restarting it alone") == 2, err[-3000:]
    assert "cannot heal" not in err, err[-3000:]
    reports = read_reports(out, 3)
    assert all(rep["step"] == epochs * steps for rep in reports.values()), {r: rep["step"] for r, rep in reports.items()}
    assert reports[0]["weights"] == reports[1]["weights"] == reports[2]["weights"]
    assert reports[0]["state"] == reports[1]["state"] == reports[2]["state"], [rep["state"] for rep in reports.values()]
    autocast = {r: rep["autocast"] for r, rep in reports.items()}
    assert all(a == ["torch.bfloat16"] for a in autocast.values()), autocast
    counts = {r: rep["callback_steps"] for r, rep in reports.items()}
    assert set(counts.values()) == {epochs * steps}, counts
    strengths = _strengths(reports[0], epochs, accumulate=2)
    assert strengths[0] == {3}, strengths  # nothing failed in epoch 0
    # (No step need run with a replica away: forked from a zygote that has imported the Trainer, a
    # restarted replica is often back before its peers commit a step without it.)
    for r in (1, 2):
        starts = [json.loads(line) for line in Path(f"{out}.rank{r}.starts").read_text().splitlines()]
        assert len(starts) == 2 and starts[0] == {**starts[0], "epoch": 0, "step": 0}, starts
        # Went on where the run was, in epoch 1, not from step 0:
        assert steps + 1 <= starts[1]["step"] < epochs * steps and starts[1]["epoch"] == 1, starts


def _shares(size, batch, replicas, passes):
    """Each replica's share of the stream, as Accelerate's DDP dispatches it under torchrun: the
    loader's batches r, r + R, ... of each pass (pass e's sample i is e * size + i), in order."""
    batches = [list(range(e * size + j, e * size + min(j + batch, size))) for e in range(passes)
               for j in range(0, size, batch)]
    per_pass = len(batches) // passes
    return {r: [b for k, b in enumerate(batches) if (k % per_pass) % replicas == r] for r in range(replicas)}


def test_trainer_on_a_stream_heals_and_reads_each_share_once(ftrun_home, tmp_path):
    """An unmodified Trainer whose train_dataset is an IterableDataset, with max_steps (several
    passes over the stream), 3 replicas, replica 1 SIGKILLed mid-pass: it restarts, heals, and goes
    on reading its own share (Accelerate's: batches 1, 4, 7, ... of the stream) exactly at its last
    committed step. Every replica's share, over the passes, is trained as a prefix, each batch once
    among committed steps (weights -1/n, n the replicas of its step, or 0 past max_steps: nothing
    read twice, nothing skipped); the replicas that were never killed trained exactly their
    torchrun shares in order; and the replicas' whole state ends identical."""
    out, size, batch, passes, max_steps = tmp_path / "o", 120, 2, 3, 36
    proc = start_ftrun(["--nproc", 3, "--ft", "--max-restarts", 2, "--run-id", "hfs", WORKER, passes, out,
                        "--size", size, "--batch", batch, "--sleep", 0.05, "--iterable", "--max-steps", max_steps], files=("stderr",))
    try:
        _kill_at(ftrun_home, "hfs", proc, [(1, 4)])
        _while_away(out, 1, proc)
        rc, err = finish(proc, 300)
    finally:
        proc.kill()
    assert rc == 0, err[-3000:]
    assert err.count("restarting it alone") == 1 and "cannot heal" not in err, err[-3000:]
    reports = read_reports(out, 3)
    assert all(rep["step"] == max_steps for rep in reports.values()), {r: rep["step"] for r, rep in reports.items()}
    assert reports[0]["weights"] == reports[1]["weights"] == reports[2]["weights"]
    assert reports[0]["state"] == reports[1]["state"] == reports[2]["state"], [rep["state"] for rep in reports.values()]
    flat = [w for row in reports[0]["weights"] for w in row]
    shares = _shares(size, batch, 3, passes)
    done = {}
    for r, share in shares.items():
        trained = []
        for b in share:
            ws = {round(flat[i], 5) for i in b}
            assert len(ws) == 1 and ws <= {0.0, -0.5, -0.33333, -1.0}, (r, b, ws)  # once, or not at all
            trained.append(ws != {0.0})
        k = trained.count(True)
        assert trained == [True] * k + [False] * (len(trained) - k), (r, trained)  # a prefix: nothing skipped
        done[r] = share[:k]
    # While replica 1's share lagged, the others' were done: each such step trained the stream's
    # first sample at zero weight in place of a batch of none (the weights above are unchanged by it).
    assert any(len(b) == 1 for r in (0, 2) for b in reports[r]["trained"]), [reports[r]["trained"] for r in (0, 2)]
    for r in (0, 2):  # never killed: exactly their torchrun shares, in order
        mine = own_steps(reports[r]["trained"], batch)
        assert mine == done[r], (r, mine[:8], done[r][:8])
    starts = [json.loads(line) for line in Path(f"{out}.rank1.starts").read_text().splitlines()]
    assert len(starts) == 2 and starts[1]["step"] >= 4, starts
    # The restarted process read its own share on from where its last committed step left it.
    again = own_steps(reports[1]["trained"], batch)
    k = done[1].index(again[0])
    assert k > 0 and again == done[1][k:k + len(again)] and k + len(again) == len(done[1]), (k, again[:4], done[1])


def test_whole_run_killed_and_resumed_mid_epoch(ftrun_home, tmp_path):
    """--checkpoint-dir: the whole run (ftrun and every worker) is SIGKILLed mid-epoch, then run
    again: train() goes on from the checkpoint's step, mid-epoch, and every sample is trained once
    an epoch (the steps after the checkpoint are trained again, on the checkpoint's model)."""
    import signal

    from conftest import run_ftrun
    from helpers import wait_replica

    out, ck, size, epochs = tmp_path / "o", tmp_path / "ck", 80, 2
    args = ["--nproc", 2, "--ft", "--checkpoint-dir", ck, "--checkpoint-every", 7, "--run-id", "first", WORKER,
            epochs, out, "--size", size, "--batch", 2, "--sleep", 0.05, "--sleep-late", 0.25]
    proc = start_ftrun(args, files=("stderr",))
    try:
        wait_replica(ftrun_home, "first", 0, lambda r, st: r["step"] >= 24, 180, proc=proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        proc.kill()
    args[args.index("first")] = "second"
    again = run_ftrun(args, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from checkpoint" in again.stderr, again.stderr[-3000:]
    reports = read_reports(out, 2)
    assert reports[0]["weights"] == reports[1]["weights"] and reports[0]["step"] == epochs * 20
    strengths = _strengths(reports[0], epochs)
    assert all(s == {2} for s in strengths.values()), strengths
    starts = [json.loads(line) for line in Path(f"{out}.rank0.starts").read_text().splitlines()]
    # A checkpoint's step in epoch 1 (steps 20 to 39: mid-epoch):
    assert starts[-1]["step"] in (21, 28, 35) and starts[-1]["epoch"] == 1, starts


RUN_CLM = ROOT / "tests" / "hf_run_clm.py"
# run_clm's arguments: a 2-layer GPT-2 from a config, accumulation 2, clipping at 1.0 (the
# default), a cosine schedule, evaluation and saves every 4 steps, the best model loaded at the end.
CLM = ["--model_type", "gpt2", "--config_overrides", "n_layer=2,n_head=2,n_embd=32,n_positions=16,vocab_size=48,"
       "resid_pdrop=0.0,embd_pdrop=0.0,attn_pdrop=0.0,bos_token_id=0,eos_token_id=0", "--do_train", "--do_eval",
       "--per_device_train_batch_size", 4, "--per_device_eval_batch_size", 16, "--gradient_accumulation_steps", 2,
       "--learning_rate", 3e-3, "--lr_scheduler_type", "cosine", "--warmup_steps", 2, "--num_train_epochs", 2,
       "--eval_strategy", "steps", "--eval_steps", 4, "--save_strategy", "steps", "--save_steps", 4,
       "--save_total_limit", 2, "--load_best_model_at_end", "--metric_for_best_model", "eval_loss",
       "--logging_steps", 1, "--report_to", "none", "--use_cpu", "--disable_tqdm", "True", "--seed", 1]


def _clm(out, *extra):
    return [RUN_CLM, *CLM, "--output_dir", f"{out}.out", "--report", out, *extra]


def _evals(report):
    return {h["step"]: h["eval_loss"] for h in report["history"] if "eval_loss" in h}


def _clm_reports(out):
    """The replicas' reports, which end identical; exactly one Trainer took itself for process 0."""
    reports = list(read_reports(out, 3).values())
    same = [(rep["params"], rep["step"], rep["best"], rep["eval"]["eval_loss"]) for rep in reports]
    assert len(set(same)) == 1, same
    assert sum(rep["process_zero"] for rep in reports) == 1, [rep["process_zero"] for rep in reports]
    return reports[0]


def _while_away(out, rank, proc, deadline_s=180):
    """The run's steps are slower while `out`.slow exists: until the killed replica's train() began again."""
    import time

    slow, starts = Path(f"{out}.slow"), Path(f"{out}.rank{rank}.starts")
    slow.touch()
    try:
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline and proc.poll() is None and len(starts.read_text().splitlines()) < 2:
            time.sleep(0.05)
    finally:
        slow.unlink()


@pytest.mark.extended
def test_run_clm_shaped_script_under_a_kill_and_resumed_from_its_own_checkpoint(ftrun_home, tmp_path):
    """A script in the shape of transformers' run_clm.py (HfArgumentParser, TrainingArguments, a
    GPT-2 built from a config, train(resume_from_checkpoint=...), save_model, save_metrics,
    save_state, evaluate), unmodified, with 3 replicas, three ways at once: failure-free; with
    replica 0 killed mid-epoch (the writer of checkpoints, again once back with the state it
    healed); and killed whole (ftrun and every worker) once the Trainer's own checkpoint-8 is
    written, then run again with --resume_from_checkpoint. The killed replica goes on mid-run and
    writes the later checkpoints; every run ends with identical replicas, one of which took itself for process zero
    (one writer of the metrics files), the best checkpoint loaded; the killed run's and the resumed
    run's evaluation losses are the failure-free run's within float noise (each step's gradient is
    the same global batch's, whoever is away)."""
    import signal
    import threading
    import time

    from conftest import run_ftrun

    common = ["--nproc", 3, "--ft", "--max-restarts", 2]
    ref, out, whole = tmp_path / "ref", tmp_path / "k", tmp_path / "w"
    clean = start_ftrun([*common, "--run-id", "clean", *_clm(ref)], files=("stderr",))
    proc = start_ftrun([*common, "--run-id", "clm", *_clm(out, "--sleep", 0.15)], files=("stderr",))
    first = start_ftrun([*common, "--run-id", "first", *_clm(whole, "--sleep", 0.5)], files=("stderr",))
    def kill_whole_run() -> None:  # once its checkpoint-8 is written (checkpoint-16 would rotate it out)
        saved, deadline = Path(f"{whole}.out") / "checkpoint-8" / "trainer_state.json", time.monotonic() + 180
        while not saved.exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        first.send_signal(signal.SIGKILL)

    killer = threading.Thread(target=kill_whole_run, daemon=True)
    killer.start()
    try:
        _kill_at(ftrun_home, "clm", proc, [(0, 5)])
        _while_away(out, 0, proc)
        killer.join(200)
        first.wait(30)
        rc, err = finish(proc, 300)
        rc_clean, err_clean = finish(clean, 300)
    finally:
        for p in (proc, clean, first):
            p.kill()
    assert rc == 0, err[-3000:]
    assert rc_clean == 0, err_clean[-3000:]
    assert err.count("restarting it alone") == 1 and "cannot heal" not in err, err[-3000:]
    starts = [json.loads(line) for line in Path(f"{out}.rank0.starts").read_text().splitlines()]
    assert len(starts) == 2 and starts[1]["step"] >= 5, starts  # went on mid-run
    resumed = run_ftrun([*common, "--run-id", "second",
                         *_clm(whole, "--resume_from_checkpoint", f"{whole}.out/checkpoint-8")], timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    starts = [json.loads(line) for line in Path(f"{whole}.rank0.starts").read_text().splitlines()]
    assert starts[-1]["step"] == 8, starts  # the Trainer's own resume, at its checkpoint's step

    clean_run, killed, again = _clm_reports(ref), _clm_reports(out), _clm_reports(whole)
    ref_evals = _evals(clean_run)
    assert sorted(ref_evals) == [4, 8, 12, 16, 20, 22] and ref_evals[22] < ref_evals[4] - 0.2, ref_evals  # it learns
    for run in (killed, again):
        assert run["step"] == clean_run["step"] == 22, (run["step"], clean_run["step"])
        evals = _evals(run)
        assert all(abs(evals[s] - ref_evals[s]) < 5e-3 for s in evals) and 22 in evals, (evals, ref_evals)
        assert abs(run["eval"]["eval_loss"] - clean_run["eval"]["eval_loss"]) < 5e-3, (run["eval"], clean_run["eval"])
    for out_dir in (out, whole):
        best = Path(killed["best"] if out_dir == out else again["best"])
        assert best.parent == Path(f"{out_dir}.out") and (best / "trainer_state.json").exists(), best
        json.loads((Path(f"{out_dir}.out") / "all_results.json").read_text())  # whole: one writer


def test_what_ftrun_cannot_heal_is_one_line_and_group_restarts(ftrun_home, tmp_path):
    """fp16 steps through a GradScaler, which the Trainer's part does not support, and a
    transformers of another major version (the script sees 4.57.0): each gets one line at the
    start (and no advice to wrap the loop with ftrun.ft, which does not fit a Trainer script),
    Accelerate's own DDP (all workers in one group), and the run trains as without --ft.
    ddp_backend="nccl" with use_cpu=True cannot train at all (nor without --ft, where Accelerate
    refuses it), nor can a stream under --ft with Accelerate's split_batches: one line naming the
    fix, exit 2, nothing restarted."""
    runs = {"fp16": (["--fp16"], "TrainingArguments(fp16=True) steps through a GradScaler"),
            "version": (["--pretend-transformers", "4.57.0"],
                        "this transformers is 4.57.0; ftrun heals Trainer replicas with transformers 5.x only")}
    procs = {name: start_ftrun(["--nproc", 2, "--ft", WORKER, 1, tmp_path / name, "--size", 24, *extra],
                               files=("stderr",))
             for name, (extra, _) in runs.items()}
    procs["nccl"] = start_ftrun(["--nproc", 2, "--ft", WORKER, 1, tmp_path / "nccl", "--size", 24,
                                 "--ddp-backend", "nccl"], files=("stderr",))
    procs["iterable"] = start_ftrun(["--nproc", 2, "--ft", WORKER, 1, tmp_path / "iterable", "--size", 24,
                                     "--iterable", "--split-batches"], files=("stderr",))
    try:
        done = {name: finish(proc, 300) for name, proc in procs.items()}
    finally:
        for proc in procs.values():
            proc.kill()
    rc, err = done["nccl"]
    assert rc == 2, err[-3000:]
    refused = [line for line in err.splitlines() if 'ddp_backend="nccl"' in line]
    assert len(refused) == 1 and refused[0].endswith('set ddp_backend="gloo" or leave it out; stopping the run '
                                                     '(exit 2)'), err[-3000:]
    assert "Traceback" not in err and "restarting" not in err, err[-3000:]
    rc, err = done["iterable"]
    refused = [line for line in err.splitlines() if "accelerator_config={'split_batches': True}) over a stream" in line]
    assert rc == 2 and len(refused) == 1 and refused[0].endswith(
        "drop split_batches; stopping the run (exit 2)"), err[-3000:]
    assert "Traceback" not in err and "restarting" not in err, err[-3000:]
    for name, (_, line) in runs.items():
        rc, err = done[name]
        assert rc == 0, err[-3000:]
        assert err.count(line) == 1, err[-3000:]
        assert "trains without ftrun.ft" not in err and "train_ft.py" not in err, err[-3000:]  # a Trainer's advice only
        assert "quorum 1" not in err, err[-3000:]  # no replica joined one: plain DDP
        reports = read_reports(tmp_path / name, 2)
        assert reports[0]["weights"] == reports[1]["weights"]
        assert {round(w, 5) for w in reports[0]["weights"][0]} == {-0.5}


def test_deepspeed_and_fsdp_are_said_in_one_line(monkeypatch):
    """DeepSpeed and FSDP through Accelerate shard the state over a group of all workers: the
    line a TrainingArguments that asks for either gets at its set-up (and then the plain run)."""
    from types import SimpleNamespace

    from ftrun.worker.frameworks.hf import _cannot_heal

    plain = SimpleNamespace(deepspeed=None, fsdp="", fp16=False)
    assert _cannot_heal(plain) is None
    assert "a Trainer with DeepSpeed shards" in _cannot_heal(SimpleNamespace(**{**vars(plain), "deepspeed": "ds.json"}))
    assert "a Trainer with FSDP (through Accelerate)" in _cannot_heal(SimpleNamespace(**{**vars(plain),
                                                                                        "fsdp": "full_shard"}))
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # accelerate launch --use_fsdp's way
    assert "a Trainer with FSDP (through Accelerate)" in _cannot_heal(plain)


def test_a_script_that_says_so_with_ftrun_hf(ftrun_home, tmp_path):
    """`from ftrun.hf import FTTrainer`: the replicas form a quorum (no line) and train each sample
    once, in the order of the Trainer's data_seed (not its seed): the epoch's permutation seeded
    with data_seed + epoch, each step's 2 x 4 samples split over the 2 replicas."""
    import torch

    from conftest import run_ftrun

    out = tmp_path / "o"
    proc = run_ftrun(["--nproc", 2, "--ft", WORKER, 1, out, "--size", 24, "--subclass", "--data-seed", 7],
                     timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "quorum 1: 2 replicas" in proc.stderr and "ftrun: --ft:" not in proc.stderr, proc.stderr[-3000:]
    reports = read_reports(out, 2)
    assert reports[0]["weights"] == reports[1]["weights"]
    assert {round(w, 5) for w in reports[0]["weights"][0]} == {-0.5}
    order = torch.randperm(24, generator=torch.Generator().manual_seed(7)).tolist()
    for r in range(2):
        assert reports[r]["trained"] == [order[s * 8 + r:s * 8 + 8:2] for s in range(3)], reports[r]["trained"]
