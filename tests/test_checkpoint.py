"""Durable checkpoints under --ft (--checkpoint-dir), through the real CLI, with real SIGKILLs.

Every process of a run (supervisor, zygote, workers) is killed at once, and
the same command run again resumes from the newest complete checkpoint and
ends bitwise equal to a run that was never killed; a checkpoint killed while
it was being written is never loaded; a sharded replica's checkpoint loads at
another replica count; damaged and foreign checkpoints are one line each;
losing node 0 under --ft ends the other node with the requeue status.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import psutil
import pytest
import torch

from conftest import ROOT, SCRIPTS, free_port, really_alive, run_ftrun, start_ftrun
from helpers import assert_bad, err_text, read_state, wait_for, worker_stacks

TRAIN = SCRIPTS / "train_ft.py"
WORKER = ROOT / "tests" / "ckpt_worker.py"
FSDP = SCRIPTS / "train_fsdp_ft.py"
# 10.5M parameters with Adam: 126 MB of model and optimizer state per replica.
BIG = ["--dim", 1024, "--hidden", 2048, "--depth", 3, "--optim", "adam", "--lr", 0.001]


def _kill_everything(proc) -> None:
    """SIGKILL the supervisor, its zygote and every worker at the same moment."""
    root = psutil.Process(proc.pid)
    family = [root] + root.children(recursive=True)
    assert len(family) >= 3, family  # supervisor, zygote, workers
    for p in family:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait(timeout=30)
    assert not really_alive(family, 10.0), "a process of the killed run survived"


def _complete(d: Path):
    return sorted(int(p.name.split("-")[1]) for p in d.glob("step-*") if p.name.split("-")[1].isdigit())


def _final_state(out: Path, ranks):
    return {r: (torch.load(f"{out}.rank{r}.pt", weights_only=True),
                torch.load(f"{out}.rank{r}.opt.pt", weights_only=True),
                json.loads(Path(f"{out}.rank{r}.json").read_text())) for r in ranks}


def _assert_bitwise(ref, got) -> None:
    for r in ref:
        (p0, o0, j0), (p1, o1, j1) = ref[r], got[r]
        assert j0["step"] == j1["step"], (r, j0["step"], j1["step"])
        for k in p0:
            assert torch.equal(p0[k], p1[k]), f"rank {r}: parameter {k} differs from the uninterrupted run"
        assert o0["state"].keys() == o1["state"].keys()
        for idx, st in o0["state"].items():
            for name, value in st.items():
                assert torch.equal(value, o1["state"][idx][name]), f"rank {r}: optimizer {idx}.{name} differs"
        assert o0["param_groups"] == o1["param_groups"], r
        assert j0["sched"] == j1["sched"], (r, j0["sched"], j1["sched"])


def test_everything_killed_resumes_bitwise(ftrun_home, tmp_path):
    """126 MB of state per replica, 3 replicas. The first run is killed whole while the
    checkpoint of step 6 is written (held open by fault injection: its .metadata is there,
    it is not published): the next run resumes from step 3, never from the partial one. That
    run is killed whole right after it published step 6, between two saves; the third
    resumes from step 6 and ends bitwise equal to an uninterrupted run of the same command
    (parameters, Adam moments, scheduler, step)."""
    def cmd(d, out):
        return ["--nproc", 3, "--ft", "--run-id", "ck", "--checkpoint-dir", d, "--checkpoint-every", 3,
                TRAIN, *BIG, "--steps", 9, "--print-every", 100, "--out", out]

    ref_dir, d = tmp_path / "ref-ck", tmp_path / "ck"
    # The uninterrupted run goes on beside the others (a run mostly waits while it starts).
    # It stages each save with a fresh stager, as ftrun does on torch 2.11 (whose stager fails
    # every stage after its first).
    ref = start_ftrun(cmd(ref_dir, tmp_path / "ref"), env={"FTRUN_HOME": str(tmp_path / "ref-home"),
                                                     "FTRUN_CHECKPOINT_FRESH_STAGER": "1"}, files=("stderr",))
    first = start_ftrun(cmd(d, tmp_path / "out"), env={"FTRUN_CHECKPOINT_INJECT_DELAY": "6:120"}, files=("stderr",))
    partial = d / ".step-6.ck.partial"  # .step-N.<run id>.partial

    def seen() -> str:
        return f"in {d}: {sorted(p.name for p in d.iterdir()) if d.is_dir() else 'nothing'}"

    # Two runs of 3 x 126 MB beside the suite's other workers: on a loaded CI machine the first
    # took over 90 s to reach step 6. A stalled run still fails here, with its workers' stacks.
    stacks = lambda: worker_stacks(read_state(ftrun_home, "ck"))  # noqa: E731
    wait_for(lambda: (partial / ".metadata").exists() and (d / "step-3").is_dir(), 240,
             "the checkpoint of step 6 written but not published", first, show=seen, before_kill=stacks)
    _kill_everything(first)
    assert _complete(d) == [3] and (partial / ".metadata").exists()

    second = start_ftrun(cmd(d, tmp_path / "out"), files=("stderr",))
    wait_for(lambda: (d / "step-6").is_dir(), 240, "the checkpoint of step 6 published", second, show=seen,
             before_kill=stacks)
    _kill_everything(second)
    assert f"resumed from checkpoint {d}/step-3 at step 3" in err_text(second), err_text(second)[-3000:]
    newest = _complete(d)[-1]
    assert newest == 6, _complete(d)

    third = run_ftrun(cmd(d, tmp_path / "out"), timeout=300)
    assert ref.wait(timeout=300) == 0, err_text(ref)[-3000:]
    assert _complete(ref_dir) == [6, 9], _complete(ref_dir)
    assert not [w for w in ("not written", "failed while writing", "not published") if w in err_text(ref)], \
        err_text(ref)[-3000:]
    size = json.loads((ref_dir / "step-9" / "ftrun.json").read_text())["bytes"]
    assert size > 100e6, size
    assert third.returncode == 0, third.stderr[-3000:]
    assert third.stderr.count("resumed from checkpoint") == 1, third.stderr
    assert f"resumed from checkpoint {d}/step-6 at step 6" in third.stderr, third.stderr[-3000:]
    assert "resuming from the newest checkpoint" not in third.stderr  # a first epoch, not a loss of every holder
    _assert_bitwise(_final_state(tmp_path / "ref", range(3)), _final_state(tmp_path / "out", range(3)))

    assert _complete(d) == [6, 9] and not list(d.glob(".step-*")), list(d.iterdir())
    state = json.loads((ftrun_home / "ck" / "state.json").read_text())
    assert state["checkpoint"]["step"] == 9 and state["checkpoint"]["path"] == str(d / "step-9"), state
    view = run_ftrun(["status", "ck"], timeout=30)
    assert "checkpoint step 9" in view.stdout, view.stdout


def test_killed_whole_over_several_buckets_then_a_spare_heal_both_bitwise(ftrun_home, tmp_path):
    """Three replicas and a hot spare, AdamW over three DDP buckets, steps of a few milliseconds
    (the keeper re-sizes the rounds once it knows their pace, which rebuilds every group: a layout
    round, at another step in each run). The run is SIGKILLed whole past its checkpoint of step 20;
    the same command resumes from it, a layout round on a new group; at step 40 the replica at
    index 1 dies and the spare takes its place, a heal with no step committed by fewer replicas.
    Every replica that trained to the end is bitwise equal to the uninterrupted run: parameters,
    AdamW's moments, the sampler, and replica 0's BatchNorm statistics (each replica's own). A
    layout round's average in parameter order, not in DDP's buckets, differed in the last bits at
    three replicas, from the first layout round on."""
    def cmd(d, out, *extra, spares=0):
        # 76k parameters, in three DDP buckets once DDP has rebuilt them (50 kB, or one larger tensor, each).
        return ["--nproc", 3 + spares, "--spares", spares, "--ft", "--checkpoint-dir", d, "--checkpoint-every", 10,
                WORKER, 60, out, "--width", 192, "--depth", 2, "--optim", "adamw", "--bucket-cap-mb", 0.05, *extra]

    ref = start_ftrun(cmd(tmp_path / "ref-ck", tmp_path / "ref"), env={"FTRUN_HOME": str(tmp_path / "ref-home")},
                      files=("stderr",))
    d, out = tmp_path / "ck", tmp_path / "out"
    spare = cmd(d, out, "--die-once", f"{tmp_path / 'died'}:40", spares=1)
    first = start_ftrun(spare, files=("stderr",))
    wait_for(lambda: (d / "step-20").is_dir(), 90, "the checkpoint of step 20", first)
    _kill_everything(first)
    assert not (tmp_path / "died").exists()
    again = run_ftrun(spare, timeout=180)
    assert again.returncode == 0, again.stderr[-3000:]
    resumed = re.search(rf"rank 0: resumed from checkpoint {d}/step-(\d+) at step", again.stderr)
    assert resumed and 20 <= int(resumed[1]) < 40, again.stderr[-3000:]
    assert re.search(r"rank \d left; spare replica \d takes its place", again.stderr), again.stderr[-3000:]
    assert (tmp_path / "died").exists()
    assert ref.wait(timeout=180) == 0, err_text(ref)[-3000:]
    trained = sorted(int(p.name.split("rank")[1].split(".")[0]) for p in tmp_path.glob("out.rank*.pt"))
    # The three that trained to the end, and the spare if it was fed at the end (then it writes too).
    assert len(trained) >= 3 and 0 in trained, trained
    a = torch.load(f"{tmp_path / 'ref'}.rank0.pt", weights_only=True)
    buffers = {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
    for r in trained:
        b = torch.load(f"{out}.rank{r}.pt", weights_only=True)
        assert a["step"] == b["step"] == 60 and a["sampler"] == b["sampler"], (r, a["sampler"], b["sampler"])
        for k, v in a["model"].items():
            if k not in buffers or r == 0:
                assert torch.equal(v, b["model"][k]), f"rank {r}: {k} differs from the uninterrupted run"
        assert a["optim"]["state"].keys() == b["optim"]["state"].keys()
        for i, st in a["optim"]["state"].items():
            for n, v in st.items():
                assert torch.equal(v, b["optim"]["state"][i][n]), f"rank {r}: AdamW's {i}.{n} differs"


def test_sharded_replicas_resume_at_another_replica_count(ftrun_home, tmp_path):
    """2 replicas x 2 workers (FSDP2) write their shards in parallel; 1 replica x 2 resumes
    from that checkpoint with every shard exactly as written (parameters and AdamW state)."""
    d = tmp_path / "ck"
    common = ["--ft", "--replica-size", 2, "--checkpoint-dir", d, "--checkpoint-every", 10]
    two = run_ftrun(["--nproc", 4, *common, FSDP, "--steps", 20, "--print-every", 100, "--out", tmp_path / "two"],
                    timeout=180)
    assert two.returncode == 0, two.stderr[-3000:]
    files = sorted(p.name for p in (d / "step-20").iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp", "ftrun.json"], files  # one file per worker
    one = run_ftrun(["--nproc", 2, *common, FSDP, "--steps", 20, "--print-every", 100, "--out", tmp_path / "one"],
                    timeout=180)
    assert one.returncode == 0, one.stderr[-3000:]
    assert f"resumed from checkpoint {d}/step-20 at step 20" in one.stderr, one.stderr[-3000:]
    for r in range(2):
        a = torch.load(f"{tmp_path / 'two'}.rank{r}.pt", weights_only=True)
        b = torch.load(f"{tmp_path / 'one'}.rank{r}.pt", weights_only=True)
        for k in a["model"]:
            assert torch.equal(a["model"][k], b["model"][k]), (r, k)
        for i, st in a["optim"].items():
            for n, v in st.items():
                assert torch.equal(v, b["optim"][i][n]), (r, i, n)
        assert json.loads(Path(f"{tmp_path / 'one'}.rank{r}.json").read_text())["step"] == 20


@pytest.mark.extended
def test_every_holder_killed_then_damaged_and_foreign_checkpoints(ftrun_home, tmp_path):
    """Both replicas SIGKILLed at once mid-run (the supervisor lives on): the next epoch has no
    holder of the trained state and resumes from the newest checkpoint, and the run ends
    bitwise equal to one never interrupted, with state that changes before the optimizer
    step (BatchNorm statistics, a registered sampler that moves on at the top of the loop).
    Then the two newest checkpoints are damaged (unreadable .metadata, a truncated data
    file): the next run moves each aside with one line and resumes from the third. A run of
    another model, or of another optimizer, on that folder ends at once with one line naming
    the mismatch, exit 2."""
    d = tmp_path / "ck"

    def cmd(run_id, folder, steps, out, *extra, nproc=2):
        return ["--nproc", nproc, "--ft", "--run-id", run_id, "--checkpoint-dir", folder, "--checkpoint-every", 5,
                "--checkpoint-keep", 3, WORKER, steps, out, *extra]

    ref = start_ftrun(cmd("ref", tmp_path / "ref-ck", 60, tmp_path / "ref", "--step-sleep", 0.03), files=("stderr",))
    run = start_ftrun(cmd("hold", d, 60, tmp_path / "out", "--step-sleep", 0.03), files=("stderr",))
    wait_for(lambda: (d / "step-15").is_dir(), 90, "the checkpoint of step 15", run)
    state = json.loads((ftrun_home / "hold" / "state.json").read_text())
    for r in state["replicas"]:
        psutil.Process(r["pid"]).kill()
    killed_after = _complete(d)[-1]
    assert run.wait(timeout=120) == 0, err_text(run)[-3000:]
    err = err_text(run)
    assert "no replica holding the trained state is left: resuming from the newest checkpoint" in err, err[-3000:]
    resumed = [line for line in err.splitlines() if "resumed from checkpoint" in line]
    assert len(resumed) == 1 and int(resumed[0].rsplit("at step ", 1)[1].split()[0]) >= killed_after, resumed
    # Back from the checkpoint, not from a peer, and the console says so.
    back = [line for line in err.splitlines() if "is training again" in line]
    assert back and all("no replica held the trained state: resuming from the newest checkpoint" in line
                        for line in back), back
    assert ref.wait(timeout=120) == 0, err_text(ref)[-3000:]
    for r in range(2):
        a = torch.load(f"{tmp_path / 'ref'}.rank{r}.pt", weights_only=True)
        b = torch.load(f"{tmp_path / 'out'}.rank{r}.pt", weights_only=True)
        assert a["step"] == b["step"] == 60 and a["sampler"] == b["sampler"], (a["sampler"], b["sampler"])
        buffers = {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
        for k, v in a["model"].items():
            # BatchNorm's statistics are each replica's own (nothing averages them): the writer's
            # are checkpointed, and after the resume every replica has them, as a heal gives them.
            if k not in buffers or r == 0:
                assert torch.equal(v, b["model"][k]), (r, k)
        for i, st in a["optim"]["state"].items():
            for n, v in st.items():
                assert torch.equal(v, b["optim"]["state"][i][n]), (r, i, n)
    assert _complete(d) == [50, 55, 60]

    (d / "step-60" / ".metadata").write_bytes(b"not a pickle")
    data = d / "step-55" / "__0_0.distcp"
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size // 2)
    again = run_ftrun(cmd("hold", d, 65, tmp_path / "again"), timeout=120)
    assert again.returncode == 0, again.stderr[-2000:]
    damaged = [line for line in again.stderr.splitlines() if "is damaged" in line]
    assert len(damaged) == 2, again.stderr
    assert f"{d}/step-60 is damaged (.metadata does not match its checksum" in damaged[0], damaged
    assert f"{d}/step-55 is damaged (__0_0.distcp is truncated" in damaged[1], damaged
    assert f"resumed from checkpoint {d}/step-50 at step 50" in again.stderr, again.stderr[-2000:]

    cases = {"model": (["--width", 32], "model tensor model.0.weight is [16, 8] in the checkpoint, [32, 8] in this run"),
             "optimizer": (["--optim", "sgd"], "it was written with optimizer Adam, this run uses SGD")}
    for name, (extra, needle) in cases.items():  # one after the other: one run at a time on a folder
        t0 = time.monotonic()
        run = start_ftrun(["-q", *cmd(name, d, 100, tmp_path / name, *extra, nproc=1)], files=("stderr",))
        code, err = run.wait(timeout=120), err_text(run)
        assert code == 2, (name, code, err[-2000:])
        lines = [line for line in err.splitlines() if "does not fit this run" in line]
        assert len(lines) == 1 and needle in lines[0] and lines[0].startswith("ftrun: rank 0: checkpoint "), err
        assert "restarting" not in err and "Traceback" not in err, err
        assert time.monotonic() - t0 < 45
    assert _complete(d) == [55, 60, 65]  # a foreign run writes nothing


def test_checkpoint_options_bad_input(ftrun_home, tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    script = tmp_path / "s.py"
    script.write_text("print('ran')\n")
    cases = [
        (["--checkpoint-dir", tmp_path / "ck"], ["--checkpoint-dir", "only to --ft runs"]),
        (["--ft", "--checkpoint-every", 5], ["--checkpoint-every 5", "without --checkpoint-dir"]),
        (["--ft", "--checkpoint_keep=3"], ["--checkpoint-keep 3", "without --checkpoint-dir"]),
        (["--ft", "--checkpoint-dir", a_file], [f"--checkpoint-dir {a_file} is a file"]),
        (["--ft", "--checkpoint_dir", a_file / "ck"], ["cannot be created", f"{a_file} is a file"]),
        (["--ft", "--checkpoint-dir", tmp_path / "ck", "--checkpoint-every", 0], ["--checkpoint-every", ">= 1"]),
        (["--ft", "--checkpoint-dir=" + str(tmp_path / "ck"), "--checkpoint-keep", "two"],
         ["--checkpoint-keep", "whole number"]),
    ]
    for args, needles in cases:
        assert_bad(run_ftrun(["--nproc", 2, *args, script], timeout=30), *needles)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"nproc: 2\nft: true\ncheckpoint_dir: {a_file}\ncheckpoint_every: 10\n")
    assert_bad(run_ftrun(["validate", recipe], timeout=30), "checkpoint_dir", "is a file")
    recipe.write_text(f"nproc: 2\nft: true\ncheckpoint_dir: {tmp_path / 'ck'}\ncheckpoint_every: 10\n")
    ok = run_ftrun(["validate", recipe], timeout=30)
    assert ok.returncode == 0 and "checkpoint_dir" in ok.stdout, ok
    assert not (tmp_path / "ck").exists(), "validate created the checkpoint folder"
    assert not ftrun_home.exists() or not any(ftrun_home.iterdir()), "a run was started"


def test_store_node_lost_under_ft_exits_for_requeue(ftrun_home, tmp_path):
    """Two nodes, --ft: node 0 (the run's store) SIGKILLed; node 1 ends in one line with
    the documented requeue status (200) and leaves nothing behind."""
    port = free_port()
    procs = {}
    for k in (1, 0):
        procs[k] = start_ftrun(["--nnodes", 2, "--node-rank", k, "--master-addr", "127.0.0.1", "--master-port", port,
                           "--nproc", 1, "--ft", "--run-id", "lost", "--checkpoint-dir", tmp_path / "ck",
                           "--checkpoint-every", 5, TRAIN, "--steps", 100_000, "--step-sleep", 0.02], files=("stderr",))
    try:
        wait_for(lambda: (tmp_path / "ck" / "step-5").is_dir(), 90, "a first checkpoint", procs[1])
        family = psutil.Process(procs[1].pid).children(recursive=True)
        _kill_everything(procs[0])
        procs[1].wait(timeout=30)
    finally:
        for p in procs.values():
            p.kill()
    err = err_text(procs[1])
    assert procs[1].returncode == 200, (procs[1].returncode, err[-3000:])
    assert "node 0 (the run's store at 127.0.0.1:" in err and f"exit 200: requeue the job to resume from {tmp_path / 'ck'}" \
        in err, err[-3000:]
    assert not really_alive(family, 10.0), "orphans left behind"
