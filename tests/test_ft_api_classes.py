"""The ftrun.ft API in torch's conventions, through the real CLI: ft.DistributedDataParallel,
ft.Optimizer and ft.DataLoader are torch's classes (isinstance holds both ways), an LR
scheduler takes ft.Optimizer itself (across a kill and a heal too), `step(closure)` returns the
closure's loss, and a discarded step says so (opt.stepped, ft.redo())."""

from __future__ import annotations

from pathlib import Path

import torch

from conftest import run_ftrun
from helpers import read_reports, restarts_of_kills

# Step 0 is a layout round (see ftrun/worker/ft/api/ddp.py); with a sparse embedding its gradients
# cannot be averaged, so every replica discards it and the loop hands step 0 out again: a
# discarded step on every run, without a kill.
SCRIPT = '''
import json, os, signal, sys, time
import torch, torch.nn as nn, torch.nn.functional as F
from torch.utils.data import TensorDataset
import ftrun.ft as ft

out, total, die_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rank = int(os.environ["RANK"])
first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 4, sparse=True)
        self.lin = nn.Linear(4, 1)

    def forward(self, i):
        return self.lin(self.emb(i)).squeeze(-1)

torch.manual_seed(0)
model = ft.DistributedDataParallel(Net())
# Two optimizers (a sparse one for the embedding), one scheduler over both, on ft.Optimizer itself.
opt = ft.Optimizer(torch.optim.SGD(model.module.emb.parameters(), lr=0.4),
                   torch.optim.SGD(model.module.lin.parameters(), lr=0.2, momentum=0.9))
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
ft.register_state("sched", sched)
g = torch.Generator().manual_seed(1)
data = TensorDataset(torch.randint(0, 16, (64,), generator=g), torch.randn(64, generator=g))
loader = ft.DataLoader(data, batch_size=4, shuffle=True)
kinds = {
    "ddp_is_torch_ddp": isinstance(model, torch.nn.parallel.DistributedDataParallel),
    "ddp_is_ft_ddp": isinstance(model, ft.DistributedDataParallel),
    "opt_is_torch_optimizer": isinstance(opt, torch.optim.Optimizer),
    "opt_is_ft_optimizer": isinstance(opt, ft.Optimizer),
    "loader_is_torch_loader": isinstance(loader, torch.utils.data.DataLoader),
    "loader_is_ft_loader": isinstance(loader, ft.DataLoader),
    "groups_shared": [id(g) for g in opt.param_groups] == [id(g) for o in opt.optimizers for g in o.param_groups],
}
log = []
for epoch in ft.epochs(total):
    for i, y in loader:
        step = ft.global_step()
        if first and rank == 1 and step == die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        made = []

        def closure():
            opt.zero_grad()
            loss = F.mse_loss(model(i), y)
            loss.backward()
            made.append(loss)
            return loss

        got = opt.step(closure)
        if opt.stepped:
            sched.step()
        log.append({"step": step, "redo": ft.redo(), "stepped": opt.stepped, "calls": len(made),
                    "same_loss": len(made) == 1 and got is made[0]})
        time.sleep(0.03)
sd = opt.state_dict()
torch.save({k: v.detach().clone().to_dense() for k, v in model.module.state_dict().items()}, f"{out}.rank{rank}.pt")
torch.save(sd, f"{out}.rank{rank}.opt.pt")
with open(f"{out}.rank{rank}.json", "w") as f:
    json.dump({"kinds": kinds, "log": log, "step": ft.global_step(), "sched": sched.state_dict(),
               "lrs": [g["lr"] for g in opt.param_groups],
               "inner_lrs": [g["lr"] for o in opt.optimizers for g in o.param_groups]}, f)
'''

STEPS_PER_EPOCH = 64 // (4 * 2)  # 64 samples, 4 a worker, 2 replicas alive


def _train_api_classes(tmp_path: Path, epochs: int, die_at: int, timeout: int = 120):
    """SCRIPT on 2 replicas (rank 1 dying at step `die_at`): (its run, --out, the ranks' reports)."""
    script = tmp_path / "api_classes.py"
    script.write_text(SCRIPT)
    out = tmp_path / "p"
    proc = run_ftrun(["--nproc", 2, "--ft", script, out, epochs, die_at], timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, out, read_reports(out, 2)


def _assert_same_state(out: Path) -> None:
    """Both replicas ended with the same parameters and the same optimizer state (both optimizers)."""
    params = [torch.load(f"{out}.rank{r}.pt", weights_only=True) for r in range(2)]
    opts = [torch.load(f"{out}.rank{r}.opt.pt", weights_only=True) for r in range(2)]
    for k in params[0]:
        assert torch.equal(params[0][k], params[1][k]), k
    assert opts[0]["state"].keys() == opts[1]["state"].keys() and opts[0]["state"], opts
    for idx, st in opts[0]["state"].items():
        for name, value in st.items():
            other = opts[1]["state"][idx][name]
            assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other, (idx, name)
    assert [g["lr"] for g in opts[0]["param_groups"]] == [g["lr"] for g in opts[1]["param_groups"]]


def test_ft_classes_are_torchs_and_a_scheduler_on_ft_optimizer_heals_with_a_killed_replica(ftrun_home, tmp_path):
    """isinstance holds for the three classes; step(closure) evaluates the closure once and returns
    its loss, taken or discarded. Step 0 (a layout round no replica can average) is discarded:
    opt.stepped is False, the loop hands step 0 out again with ft.redo() True, and the scheduler,
    stepped only when opt.stepped, did not move. Replica 1 is then SIGKILLed at step 10 and heals
    from replica 0: the scheduler built on ft.Optimizer itself (over two optimizers) comes back
    with the rest of the state, both replicas end identical (parameters, both optimizers' state
    and learning rates, the scheduler), and the scheduler counted exactly the committed steps.
    The healed replica's first round is a layout round again, discarded by both."""
    proc, out, reports = _train_api_classes(tmp_path, 3, 10, timeout=180)
    restarts_of_kills(proc.stderr, 1)
    assert "healed from a peer" in proc.stderr, proc.stderr[-3000:]
    first = reports[0]["log"]  # replica 0's one incarnation, from step 0
    assert [(e["step"], e["stepped"], e["redo"]) for e in first[:2]] == [(0, False, False), (0, True, True)], first[:3]
    # (an epoch takes more steps while one replica trains alone: the step count is the run's own)
    total = reports[0]["step"]
    assert total >= 3 * STEPS_PER_EPOCH and reports[0]["sched"] == reports[1]["sched"], reports
    for r, rep in reports.items():
        assert all(rep["kinds"].values()), (r, rep["kinds"])
        assert rep["step"] == total and rep["sched"]["last_epoch"] == total, (r, rep["step"], rep["sched"])
        assert rep["lrs"] == rep["inner_lrs"] == [lr * 0.5 ** (total // 3) for lr in (0.4, 0.2)], (r, rep["lrs"])
        log = rep["log"]
        assert all(e["calls"] == 1 and e["same_loss"] for e in log), (r, log)
        for k, e in enumerate(log[:-1]):  # a discarded step comes again, as a redo
            if not e["stepped"]:
                assert log[k + 1]["step"] == e["step"] and log[k + 1]["redo"], (r, log[k:k + 2])
    # The survivor saw discarded steps after step 0 too: the kill's round, or the heal's layout round.
    assert [e for e in first if not e["stepped"] and e["step"] > 0], first
    _assert_same_state(out)


FUSED = """
import sys, torch
import ftrun.ft as ft

model = torch.nn.Linear(1, 1, bias=False)
torch.nn.init.ones_(model.weight)
ddp = ft.DistributedDataParallel(model)
opt = ft.Optimizer(torch.optim.SGD(ddp.parameters(), lr=0.01, fused=True))
scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
for step in ft.steps(5):
    opt.zero_grad()
    scaler.scale(ddp(torch.ones(1, 1)).sum()).backward()  # the gradient is 1 on every replica
    scaler.step(opt)
    scaler.update()
print(f"weight {model.weight.item():.6f} step {ft.global_step()}", flush=True)
"""


def test_grad_scaler_unscales_for_a_fused_optimizer_inside_ft_optimizer(ftrun_home, tmp_path):
    """A fused optimizer handles GradScaler's scale itself, from attributes GradScaler sets on the
    optimizer it is given: on ft.Optimizer, which the wrapped one never read, so it stepped on
    gradients 1024 times too large. ft.Optimizer now asks GradScaler to unscale: 5 steps of lr
    0.01 on a gradient of 1 take the weight from 1 to 0.95 on both replicas."""
    script = tmp_path / "fused.py"
    script.write_text(FUSED)
    proc = run_ftrun(["--nproc", 2, "--ft", script], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if "weight " in line]
    assert len(lines) == 2 and all(line.endswith("weight 0.950000 step 5") for line in lines), proc.stdout[-2000:]
