"""--ft for a script's own loop over Accelerate or Lightning Fabric, with the drop-ins
(ftrun.accelerate.Accelerator, ftrun.fabric.Fabric) and their epochs(): only the killed replica
restarts, it goes on mid-epoch with the run's whole state from a peer, and every sample is trained
once an epoch (tests/accelerate_example.py and tests/fabric_example.py: copies of the frameworks'
own examples with a counter). Real CLI, real SIGKILL, CPU gloo, nothing downloaded."""

from __future__ import annotations

import json
import os
from pathlib import Path

from conftest import ROOT, start_ftrun
from helpers import finish, needs, read_reports, read_state
from test_ft_data import _kill_at

EXAMPLE = ROOT / "tests" / "accelerate_example.py"
os.environ["HF_HUB_OFFLINE"] = "1"


def same_state(a, b) -> bool:
    """Bitwise equal, tensors and all."""
    import torch

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    return a == b


def strengths(seen, accumulate, gamma=1.0):
    """Each (epoch, sample) weight is -lr/(k n) for the n replicas of the one committed step that
    trained it (lr: the counter's, gamma**epoch): once, at full or reduced strength."""
    found = {}
    for e, row in enumerate(seen):
        for i, w in enumerate(row):
            n = next((n for n in (3, 2, 1) if abs(w + gamma ** e / (accumulate * n)) < 1e-5), None)
            assert n is not None, (e, i, w)
            found.setdefault(e, set()).add(n)
    return found


@needs("accelerate", "transformers")
def test_accelerate_loop_heals_mid_epoch(ftrun_home, tmp_path):
    """Three replicas, 2 epochs of 8 steps of 2 accumulated batches (accelerator.accumulate), bf16
    autocast, an LR schedule with warmup, save_state() at each epoch's end and a custom state
    registered for checkpointing; replica 1 killed in epoch 0, then replica 2 in epoch 1: the run
    finishes, each restarted replica's loop went on where the run was, every sample was trained
    once an epoch in committed steps (a redone step trained both its batches again, never one
    twice), and every replica's whole state (BERT and the counter, SGD's momentum, the schedule,
    Accelerate's step and save iteration, the custom state) ends bitwise the same."""
    import torch

    out = tmp_path / "o"
    proc = start_ftrun(["--nproc", 3, "--ft", "--max-restarts", 4, "--run-id", "acc", EXAMPLE, out,
                        "--mixed-precision", "bf16", "--sleep", 0.1], files=("stderr",))
    try:
        _kill_at(ftrun_home, "acc", proc, [(1, 3), (2, 11)])
        rc, err = finish(proc, 300)
    finally:
        proc.kill()
    assert rc == 0, err[-3000:]
    assert err.count("restarting it alone") == 2 and "cannot heal" not in err, err[-3000:]
    # The kills land inside steps (the example sleeps there): at least one step was made again.
    assert read_state(ftrun_home, "acc")["steps_discarded"] >= 1
    reports = read_reports(out, 3)
    found = strengths(reports[0]["seen"], 2)
    assert found[0] >= {3} and found[1] >= {3}, found
    assert sum(rep["main"] for rep in reports.values()) == 1, reports  # one main process: the first live replica
    assert all(rep["autocast"] == ["torch.bfloat16"] for rep in reports.values()), reports
    states = [torch.load(f"{out}.rank{r}.pt", weights_only=False) for r in range(3)]
    assert all(same_state(states[0], s) for s in states[1:]), [s["scheduler"] for s in states]
    assert states[0]["iteration"] == 2 and len(states[0]["evaluations"]["accuracy"]) == 2, states[0]
    for r, step in ((1, 3), (2, 11)):
        starts = [json.loads(line) for line in Path(f"{out}.rank{r}.starts").read_text().splitlines()]
        assert len(starts) == 2 and starts[0]["step"] == 0 and starts[1]["step"] >= step, starts
    assert sorted(p.name for p in (Path(f"{out}.ckpt") / "epoch_1").iterdir()) == [
        "custom_checkpoint_0.pkl", "model.safetensors", "optimizer.bin", "random_states_0.pkl", "scheduler.bin"]


FABRIC = ROOT / "tests" / "fabric_example.py"


@needs("lightning")
def test_fabric_loop_heals_mid_epoch(ftrun_home, tmp_path):
    """Three replicas of Lightning's Fabric image-classifier example, 2 epochs of 8 steps of 2
    accumulated batches (fabric.no_backward_sync), bf16-mixed, StepLR stepped after every optimizer
    step (the script's own call, taken or not: a discarded step's is put back),
    fabric.save at the end; replica 2 killed in epoch 0, then replica 0 (the writer) in epoch 1:
    the run finishes, each restarted replica went on where the run was, every sample was trained
    once an epoch in committed steps, and the replicas' whole state (the network and the counter,
    SGD's momentum, the schedule) ends bitwise the same; the evaluation's loss is the same on each."""
    import torch

    out = tmp_path / "f"
    proc = start_ftrun(["--nproc", 3, "--ft", "--max-restarts", 4, "--run-id", "fab", FABRIC, out, "--sleep", 0.1],
                       files=("stderr",))
    try:
        _kill_at(ftrun_home, "fab", proc, [(2, 3), (0, 11)])
        rc, err = finish(proc, 300)
    finally:
        proc.kill()
    assert rc == 0, err[-3000:]
    assert err.count("restarting it alone") == 2 and "cannot heal" not in err, err[-3000:]
    assert read_state(ftrun_home, "fab")["steps_discarded"] >= 1  # the kills land inside steps
    reports = read_reports(out, 3)
    found = strengths(reports[0]["seen"], 2, gamma=0.7)
    assert found[0] >= {3} and found[1] >= {3}, found
    assert len({rep["test_loss"] for rep in reports.values()}) == 1, reports
    states = [torch.load(f"{out}.rank{r}.pt", weights_only=False) for r in range(3)]
    assert all(same_state(states[0], s) for s in states[1:]), [s["scheduler"] for s in states]
    assert states[0]["scheduler"]["last_epoch"] == 16  # committed steps, whatever was discarded
    for r, step in ((2, 3), (0, 11)):
        starts = [json.loads(line) for line in Path(f"{out}.rank{r}.starts").read_text().splitlines()]
        assert len(starts) == 2 and starts[0]["step"] == 0 and starts[1]["step"] >= step, starts
    assert Path(f"{out}.ckpt").is_file()


@needs("accelerate", "transformers", "lightning")
def test_unported_loops_say_why_and_restart_the_group(ftrun_home, tmp_path):
    """The scripts as the frameworks' examples have them (accelerate.Accelerator, Lightning's Fabric,
    `range` epochs), under --ft: each says in one line why its loop cannot heal and what the port
    is, gets no ftrun.ft advice (it would not fit), and trains to its end: a failure there restarts
    the group, as for any script that does not use ftrun.ft."""
    runs = {name: start_ftrun(["--nproc", 2, "--ft", "--run-id", name, script, tmp_path / name, "--plain", "--epochs", 1,
                               "--size", 16], files=("stderr",))
            for name, script in (("acc", EXAMPLE), ("fab", FABRIC))}
    for name, proc in runs.items():
        rc, err = finish(proc, 300)
        assert rc == 0, err[-3000:]
        port = {"acc": "`from ftrun.accelerate import Accelerator` and `for epoch in accelerator.epochs(num_epochs):`",
                "fab": "`from ftrun.fabric import Fabric` and `for epoch in fabric.epochs(num_epochs):`"}[name]
        assert err.count("a failure restarts all workers") == 1 and port in err, err[-3000:]
        assert "wrap the model, optimizer and loop with ftrun.ft" not in err, err[-3000:]


def test_the_zygote_imports_the_frameworks_of_the_drop_ins(tmp_path):
    """A script whose file imports a drop-in (or Accelerate) has its framework imported by the
    zygote before its first fork, so a restarted replica does not import it again; only under --ft."""
    from types import SimpleNamespace

    from ftrun.supervisor.workers.env import zygote_env

    def preimported(text: str, ft: bool = True) -> str:
        script = tmp_path / "train.py"
        script.write_text(text)
        return zygote_env(SimpleNamespace(ft=ft, module=False, script=str(script)), {}).get("FTRUN_ZYGOTE_PREIMPORT", "")

    assert preimported("from ftrun.accelerate import Accelerator\n") == "accelerate.accelerator"
    assert preimported("import accelerate\n") == "accelerate.accelerator"
    # `import lightning` (what the zygote imports for a file that names it) imports lightning.fabric too.
    assert preimported("from ftrun.fabric import Fabric\nfrom lightning.fabric import seed_everything\n") == "lightning"
    assert preimported("from ftrun.fabric import Fabric\n") == "lightning.fabric"
    assert preimported("from ftrun.accelerate import Accelerator\n", ft=False) == ""
