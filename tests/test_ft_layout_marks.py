"""A layout round (the first round on every new group, ftrun/worker/ft/api/ddp.py) averages a
model's gradients only if a backward went through it since its forward (GradMarks). A script that
drops its gradients between the forward and the backward (Lightning's closure does:
training_step, zero_grad(set_to_none=True), backward) gets new gradient tensors whose Python
objects often lie at the dropped ones' addresses, with the same version count: marked by
address, they read as untouched, and the members that read so stepped on their own gradients
while a peer waited in the average's collective (a failure-free run stalled 10 s at the keeper's
re-pacing of the rounds, then a member took the state again), or the replicas went on apart."""

from __future__ import annotations

import glob
import json
from pathlib import Path

import torch

from conftest import run_ftrun
from ftrun.worker.ft.api.ddp import GradMarks


def _fresh_at(address: int, like: torch.Tensor, version: int) -> torch.Tensor:
    """A new tensor shaped as `like` whose Python object lies at `address` (a freed tensor's), at
    `version`: what a backward after zero_grad(set_to_none=True) often creates."""
    keep = []  # tensors that landed elsewhere stay alive, so the next one takes another place
    for _ in range(100_000):
        g = torch.zeros_like(like)
        if id(g) == address:
            for _ in range(version):
                g.add_(1.0)
            return g
        keep.append(g)
    raise AssertionError("no tensor was allocated at the freed one's address")


def test_a_new_gradient_at_a_dropped_ones_address_is_not_taken_for_it():
    model = torch.nn.Linear(4, 1, bias=False)
    p = model.weight
    marks = GradMarks(model)
    marks.take()
    assert marks.untouched()  # no gradient yet, none since
    model(torch.ones(1, 4)).sum().backward()
    assert not marks.untouched()  # a backward created the gradient
    marks.take()
    assert marks.untouched()
    model(torch.ones(1, 4)).sum().backward()
    assert not marks.untouched()  # a backward added into the gradient in place

    # Lightning's closure: marked at the forward's end, then zero_grad(set_to_none=True), then the
    # backward's new gradient, here put at the dropped one's address with its version count.
    marks.take()
    address, version = id(p.grad), p.grad._version
    p.grad = None
    assert not marks.untouched()  # dropped: a backward may follow
    p.grad = _fresh_at(address, p, version)
    assert id(p.grad) == address and p.grad._version == version  # the case an address cannot tell apart
    assert not marks.untouched()


SCRIPT = '''
import json, os, sys, time
import torch
import ftrun.ft as ft

total, out = int(sys.argv[1]), sys.argv[2]

class Counter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(2 * total))

    def forward(self, idx):
        return self.w[idx].sum()

model = Counter()
ddp = ft.DistributedDataParallel(model)
opt = ft.Optimizer(torch.optim.SGD(ddp.parameters(), lr=1.0))
for step in ft.steps(total):
    # Lightning's order: the forward, then the gradients dropped, then the backward.
    loss = ddp(torch.tensor([2 * step + ft.replica_index()]))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    time.sleep(0.02)
with open(f"{out}.rank{os.environ['RANK']}.json", "w") as f:
    json.dump({"w": model.w.detach().tolist(), "step": ft.global_step()}, f)
'''


def test_gradients_dropped_between_forward_and_backward_are_averaged_on_a_new_group(ftrun_home, tmp_path):
    """Two replicas, no failure, a script in Lightning's order: the keeper re-paces the rounds
    once the pace is known (a quorum of the same replicas: a new group, a layout round while
    every member holds the last step's gradients). Each step trains one sample per replica with
    SGD at lr 1, so every weight ends at exactly -1/2 on both replicas only if every step's
    gradients were averaged; no member waits for a decision, none takes the state again."""
    script, out, total = tmp_path / "order.py", tmp_path / "o", 80
    script.write_text(SCRIPT)
    proc = run_ftrun(["--nproc", 2, "--ft", "--verbose", script, total, out], timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    state = json.loads(Path(glob.glob(f"{ftrun_home}/*/state.json")[0]).read_text())
    assert state["quorum_id"] >= 2 and not state["failures"], state  # the re-paced quorum's group
    for words in ("waited", "voted down", "taking the committed state", "restarting", "restarted"):
        assert words not in proc.stderr, proc.stderr[-3000:]
    assert "of them in this process" not in proc.stderr, proc.stderr[-3000:]  # every step went through the hook
    reports = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(2)]
    assert reports[0]["step"] == reports[1]["step"] == total, reports
    assert reports[0]["w"] == reports[1]["w"] == [-0.5] * (2 * total), (reports[0]["w"], reports[1]["w"])


class _Members:
    """What a wrapped model reads of its member in a layout round: the round planned, the
    sub-step's serial, a group (never used: the reduction is recorded instead)."""

    def __init__(self) -> None:
        self.layout_planned = self.layout_serial = 0
        self.pg, self.round_ok = object(), True

    def on_group_change(self, fn) -> None:
        pass

    def plan(self) -> None:
        self.layout_planned += 1
        self.layout_serial += 1


def _wrapped(members: _Members):
    from ftrun.worker.ft.api.ddp import _Replicated

    class Recorded(_Replicated):
        def reduce_layout(self, pg) -> None:
            self.reduced += 1

    class Ddp:  # the options of torch's DDP the layout forward reads
        gradient_as_bucket_view = False

    model = torch.nn.Linear(4, 1)
    path = Recorded(members, None, model, Ddp())
    path.reg, path.reduced = object(), 0
    return model, path


def test_a_layout_round_averages_only_the_models_forwarded_in_it_whatever_each_member_did_before():
    """The vote's average (a GAN's discriminator's sub-step, its generator's counter not yet
    forwarded) is decided on what this layout round did, never on a process's history: a fresh
    healer (no marks at all) and a survivor (marks of an earlier round, whose gradients a
    discarded step dropped since) decide the same, so they send the same collectives. Decided by
    the marks, the healer averaged the counter and its peers did not: gloo aborted it on the
    mismatched sizes (544 vs 344 bytes)."""
    healer_members, survivor_members = _Members(), _Members()
    _, healer = _wrapped(healer_members)
    survivor_model, survivor = _wrapped(survivor_members)
    survivor_members.plan()  # an earlier layout round: forward, backward, then the step discarded
    survivor.layout_forward()
    survivor_model(torch.ones(1, 4)).sum().backward()
    for p in survivor_model.parameters():
        p.grad = None  # the discarded step's gradients dropped
    for members in (healer_members, survivor_members):
        members.plan()  # the layout round both are in now, the model not forwarded yet
    healer.layout_average()
    survivor.layout_average()
    assert (healer.reduced, survivor.reduced) == (0, 0)

    # Forwarded and backwarded in this round: each averages once; forwarded only: neither does.
    for members, path in ((healer_members, healer), (survivor_members, survivor)):
        path.layout_forward()
        path.module(torch.ones(1, 4)).sum().backward()
        path.layout_average()
        path.layout_average()
        assert path.reduced == 1
        members.plan()
        path.layout_forward()
        path.layout_average()
        assert path.reduced == 1
