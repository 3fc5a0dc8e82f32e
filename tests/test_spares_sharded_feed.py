"""Sharded hot spares that hold the live state (--replica-size 2 --spares 1), through the real CLI.

A spare replica of K workers is fed shard by shard: its worker j follows worker j of the feeder
replica (the same mesh, so each pair holds the same local shards), taking each step's gradient
shards, the optimizers' settings and the buffers, and stepping its own optimizer on them. At its
promotion every shard pair compares fingerprints, and the replica keeps its state only if every
pair matches: one shard whose feed broke makes the whole replica take the whole state, never a
mix of kept and sent shards.
"""

from __future__ import annotations

import pytest

import json
import os
import re
import signal
import time
from pathlib import Path

from conftest import start_ftrun
from helpers import finish, replica, wait_state
from test_spares import _kill
from test_spares_hot import RECEIVED, _console, _until_line

# FSDP2 over the replica's 2 workers, Adam, a step LR scheduler (registered), and a BatchNorm whose
# running statistics (buffers) every forward changes, also the survivors' forward of the round a
# kill fails. While HOLD exists each step sleeps, so the run lasts until the test has seen what it
# waits for; then the rest runs at full speed.
SCRIPT = '''
import json, os, sys, time
from pathlib import Path

import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

import ftrun.ft as ft

out, steps, hold = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 512), nn.BatchNorm1d(512), nn.Tanh(), nn.Linear(512, 1))
mesh = ft.device_mesh()
fully_shard(model[0], mesh=mesh)
fully_shard(model, mesh=mesh)
model = ft.replicate(model)
opt = ft.Optimizer(torch.optim.Adam(model.parameters(), lr=0.01))
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=15, gamma=0.8)
ft.register_state("sched", sched)
shard = int(os.environ["RANK"]) % 2
for step in ft.steps(steps):
    g = torch.Generator().manual_seed(1000 * step + 10 * ft.replica_index() + shard)
    x = torch.randn(8, 32, generator=g)
    loss = nn.functional.mse_loss(model(x), x[:, :1].sin())
    opt.zero_grad()
    loss.backward()
    if opt.step():
        sched.step()
    if hold.exists():
        time.sleep(0.1)
local = lambda t: (t.to_local() if hasattr(t, "to_local") else t).detach().clone()
# The parameters: BatchNorm's running statistics are each replica's own (no replica syncs them).
torch.save({"model": {n: local(t) for n, t in model.named_parameters()},
            "optim": {i: {n: local(v) for n, v in s.items()} for i, s in opt.state_dict()["state"].items()}},
           f"{out}.rank{os.environ['RANK']}.pt")
with open(f"{out}.rank{os.environ['RANK']}.json", "w") as f:
    json.dump({"step": ft.global_step(), "sched": sched.state_dict()}, f)
'''


def _heals(err: str, rank: int) -> list:
    """(MB received, tensors in place) of each heal of `rank`, in order."""
    return [(float(mb), int(n)) for r, mb, _src, n in RECEIVED.findall(err) if int(r) == rank]


@pytest.mark.extended
def test_a_fed_sharded_spare_keeps_its_shards_and_one_broken_shard_feed_sends_the_whole_state(ftrun_home, tmp_path):
    """2 training replicas of 2 workers (ranks 0-1, 2-3) and a spare replica (ranks 4-5), one run:
    - the spare's workers are fed shard by shard: rank 4 by rank 0, rank 5 by rank 1;
    - rank 5 is stopped (SIGSTOP) until its feeder drops it, and replica 1 is killed meanwhile: the
      spare replica takes its place, and though shard 0's feed held, both of its workers receive
      the whole state (one shard's broken feed leaves the whole replica untrusted);
    - replica 1, restarted, is fed as the new spare (rank 2 by rank 0, rank 3 by rank 1); replica 2
      is killed: replica 1 takes its place and receives 0.0 MB on both shards: its parameters and
      optimizer state are kept, only the buffers move.
    The two replicas that trained to the end hold the same shards, optimizer state and scheduler, bitwise."""
    import torch

    script, out, hold = tmp_path / "sharded_feed.py", tmp_path / "p", tmp_path / "hold"
    script.write_text(SCRIPT)
    hold.write_text("")
    run_id = "sharded-feed"
    proc = start_ftrun(["--nproc", 6, "--ft", "--replica-size", 2, "--spares", 1, "--verbose", "--run-id", run_id,
                        script, out, 300, hold], files=("stderr",))
    try:
        _until_line(proc, r"rank 0: feeds hot spare rank 4 from step \d+")
        _until_line(proc, r"rank 1: feeds hot spare rank 5 from step \d+")
        st = wait_state(ftrun_home, run_id, lambda st: replica(st, 5).get("spare"), 90, "replica 2 the spare", proc)
        stopped = replica(st, 5)["pid"]
        os.kill(stopped, signal.SIGSTOP)
        try:
            _until_line(proc, r"rank 1: stopped feeding hot spare rank 5: ")
            _kill(st, 3)
            _until_line(proc, r"spare replica 2 takes its place")
        finally:
            os.kill(stopped, signal.SIGCONT)
        _until_line(proc, r"rank 0: feeds hot spare rank 2 from step \d+")
        _until_line(proc, r"rank 1: feeds hot spare rank 3 from step \d+")
        err = _console(proc)
        whole = [_heals(err, r) for r in (4, 5)]
        assert all(len(h) == 1 and h[0][0] >= 0.1 and h[0][1] > 0 for h in whole), (whole, err[-5000:])
        st = wait_state(ftrun_home, run_id, lambda st: all(replica(st, r).get("spare") for r in (2, 3)), 90,
                        "replica 1 the spare", proc)
        _kill(st, 5)
        _until_line(proc, r"\[rank 2\] ftrun\.ft: detail: rank 2: received ")
        _until_line(proc, r"\[rank 3\] ftrun\.ft: detail: rank 3: received ")
        hold.unlink()
        rc, err = finish(proc, 180)
    finally:
        proc.kill()
    assert rc == 0, err[-5000:]
    promoted = err.split("spare replica 1 takes its place")[1]
    # Nothing moved but the BatchNorm's 3 buffers (the failed round's forward changed the source's).
    assert _heals(promoted, 2) == [(0.0, 3)] and _heals(promoted, 3) == [(0.0, 3)], err[-5000:]
    assert not Path(f"{out}.rank4.pt").exists()  # the spare at the end saves nothing
    for j in (0, 1):
        a, b = (torch.load(f"{out}.rank{r}.pt", weights_only=True) for r in (j, 2 + j))
        for name, t in a["model"].items():
            assert torch.equal(t, b["model"][name]), f"shard {j}: {name} differs"
        for idx, group in a["optim"].items():
            for name, t in group.items():
                assert torch.equal(t, b["optim"][idx][name]), f"shard {j}: optimizer state {idx}.{name} differs"
        ends = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in (j, 2 + j)]
        assert ends[0] == ends[1] and ends[0]["step"] == 300, ends
