"""The survivors' way through a failure: what a surviving replica pays between a peer's death and
the next quorum's groups. A member whose round failed drops its group so that a peer blocked in
the same collective on it (a ring all-reduce leaves live peers waiting on live peers) fails at
once: gloo closes a group's connections only when the group is freed (its abort does not), so the
group must go the moment it is dropped, without a full garbage collection of the process (about
0.2 s with torch loaded, paid once by each survivor in turn before its vote, measured by
scripts/bench_heal.py --spares both).
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import json
import re
import weakref

import pytest
import torch
import torch.distributed as dist

from ftrun.hookspec import HookSpec
from ftrun.worker.ft.heal.state import ReplicaState
from ftrun.worker.ft.member.group import build_group
from ftrun.worker.ft.member.torch_effects import TorchEffects
from ftrun.worker.hooks import Registration


@contextlib.contextmanager
def no_automatic_gc():
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def full_collections() -> int:
    return gc.get_stats()[2]["collections"]


def group_of_one(prefix: str) -> dist.ProcessGroup:
    return build_group(dist.HashStore(), prefix, 0, 1)


@pytest.mark.parametrize("hook", ["allreduce", "powersgd"])
def test_a_hook_registration_lets_its_group_go_without_a_collection(hook):
    """The hook's registration (what the --ft DDP holds per group) is no reference cycle: dropped,
    its group is freed by reference counting, so its connections close at once."""
    model = torch.nn.Linear(4, 2)
    with no_automatic_gc():
        pg = group_of_one(f"test/{hook}/")
        gone = weakref.ref(pg)
        reg = Registration(HookSpec(name=hook), model, pg)
        del pg, reg
        assert gone() is None, "the registration kept its group alive until a garbage collection"


def test_a_dropped_group_is_collected_only_when_something_still_holds_it():
    """TorchEffects drops a group and tells the listeners; it collects the process's garbage only
    when the group outlived them (held in a cycle), never on the way of every failure."""
    fx = TorchEffects(ReplicaState(), 0, datetime.timedelta(seconds=10))
    held: list = []
    fx.group_listeners.append(lambda g: held.__setitem__(slice(None), [g] if g is not None else []))
    with no_automatic_gc():
        pg = group_of_one("test/drop/")
        fx.group_changed(pg)
        gone = weakref.ref(pg)
        before = full_collections()
        fx.drop_group(pg)
        del pg
        fx.group_changed(None)
        assert gone() is None
        assert full_collections() == before, "a full garbage collection ran although the group was gone"

        # A listener that leaves the group in a cycle: a collection still frees it (the backstop).
        def cyclic(g):
            if g is not None:
                loop: dict = {"pg": g}
                loop["self"] = loop
        fx.group_listeners.append(cyclic)
        pg = group_of_one("test/drop2/")
        fx.group_changed(pg)
        gone = weakref.ref(pg)
        fx.drop_group(pg)
        del pg
        fx.group_changed(None)
        assert gone() is None and full_collections() == before + 1


# A linear model's training script's start, shared by the scripts below: rank 1's first process is
# the one that dies.
START = r'''
import json, os, signal, sys, time
import torch
import ftrun.ft as ft

out, total, k = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rank = int(os.environ["RANK"])
first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
torch.manual_seed(0)
model = ft.DistributedDataParallel(torch.nn.Linear(4, 1))
opt = ft.Optimizer(torch.optim.SGD(model.parameters(), lr=0.01))
'''

SCRIPT = START + r'''
handed = []
for step in ft.steps(total):
    handed.append(step)
    opt.zero_grad()
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    if step == k:
        if rank == 1 and first:
            os.kill(os.getpid(), signal.SIGKILL)  # between steps: its part of step k went through
        time.sleep(1.5)  # the survivors learn of the new quorum before their next step's top
with open(f"{out}.rank{rank}.{os.getpid()}.json", "w") as f:
    json.dump(handed, f)
'''


def test_survivors_hand_out_no_step_on_a_quorum_whose_member_is_known_dead(ftrun_home, tmp_path):
    """Rank 1 dies between steps. By the survivors' next step top the keeper has published a quorum
    without it, and rank 1 is marked gone: that step cannot commit on the old quorum, so the
    survivors vote its round down at the top and switch, instead of handing the step to the script
    (a whole forward and backward, up to the first collective, which fails) and handing it out again
    on the next quorum. Each survivor is handed step k + 1 once."""
    from conftest import run_ftrun

    script, out, k = tmp_path / "train.py", tmp_path / "h", 5
    script.write_text(SCRIPT)
    proc = run_ftrun(["--nproc", 3, "--ft", script, out, k + 4, k], timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "killed by SIGKILL" in proc.stderr, proc.stderr[-3000:]
    for r in (0, 2):
        (handed,) = [json.loads(p.read_text()) for p in tmp_path.glob(f"h.rank{r}.*.json")]
        assert handed.count(k + 1) == 1, f"rank {r} was handed steps {handed}"


LOST_BACKWARD = r'''
import json, os, signal, sys, time
import torch
import ftrun.ft as ft
from torch.utils.checkpoint import checkpoint

out, total, k, layers, slow_s = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
rank = int(os.environ["RANK"])
first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
slow = [False]


class Slow(torch.autograd.Function):
    """A layer whose backward is slow in the first backward of step k (the workload: a big model's
    backward); rank 1 dies as that backward starts."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        if slow[0]:
            if rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(slow_s)
        return g


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(layers))

    def forward(self, x):
        half = len(self.layers) // 2
        for layer in self.layers[:half]:
            x = Slow.apply(layer(x))
        # A reentrant checkpoint's backward is a backward inside the backward: the lost round is
        # found there, the backward's first half.
        return checkpoint(lambda y: self._rest(y, half), x, use_reentrant=True)

    def _rest(self, x, half):
        for layer in self.layers[half:]:
            x = Slow.apply(layer(x))
        return x


torch.manual_seed(0)
model = ft.DistributedDataParallel(Net())
opt = ft.Optimizer(torch.optim.Adam(model.parameters(), lr=0.01))
took, seen_k = None, False
for step in ft.steps(total):
    opt.zero_grad()
    loss = model(torch.full((4, 8), 0.1 * (step + 1))).square().sum()
    slow[0] = step == k and first and not seen_k
    seen_k = seen_k or step == k
    t0 = time.monotonic()
    loss.backward()
    if slow[0]:
        took = time.monotonic() - t0
    slow[0] = False
    opt.step()
digest = float(sum(p.double().sum() for p in model.parameters()))
with open(f"{out}.rank{rank}.{os.getpid()}.json", "w") as f:
    json.dump({"took": took, "digest": digest}, f)
'''


def test_survivors_stop_a_backward_whose_round_is_lost(ftrun_home, tmp_path):
    """Rank 1 dies as step k's backward starts, and the survivors' backward is slow (20 layers of
    0.2 s, the last half inside a reentrant checkpoint). Once the keeper has published a quorum
    without rank 1, a survivor's next gradient stops its backward: it left it well before the 4 s
    the rest would take, and the run ends with the replicas alike."""
    from conftest import run_ftrun

    script, out, k, layers, slow_s = tmp_path / "train.py", tmp_path / "h", 3, 20, 0.2
    script.write_text(LOST_BACKWARD)
    proc = run_ftrun(["--nproc", 3, "--ft", "--verbose", script, out, k + 4, k, layers, slow_s], timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "killed by SIGKILL" in proc.stderr, proc.stderr[-3000:]
    ends = {r: [json.loads(p.read_text()) for p in tmp_path.glob(f"h.rank{r}.*.json")] for r in (0, 1, 2)}
    for r in (0, 2):
        (end,) = ends[r]
        print(f"rank {r}: step {k}'s backward took {end['took']:.2f} s")
        assert end["took"] is not None and end["took"] < layers * slow_s / 2, (r, end, proc.stderr[-3000:])
    digests = {e["digest"] for r in (0, 1, 2) for e in ends[r]}
    assert len(digests) == 1, ends


GIVEN_UP = START + r'''
handed, slept = [], False
for step in ft.steps(total):
    handed.append(step)
    if step == k and rank == 1 and first:
        os.kill(os.getpid(), signal.SIGKILL)  # at the step's top: its peers' collective fails
    opt.zero_grad()
    model(torch.ones(2, 4)).sum().backward()
    took = opt.step()
    if step == k and not took and not slept and rank == 2:
        slept = True
        time.sleep(3.0)  # one survivor is slow to reach its next step's top
with open(f"{out}.rank{rank}.{os.getpid()}.json", "w") as f:
    json.dump(handed, f)
'''


def test_a_survivor_hands_out_no_step_on_a_quorum_whose_group_it_gave_up(ftrun_home, tmp_path):
    """Rank 1 dies in step k. Rank 0 enters the quorum without it at once and waits for rank 2 to
    form its group; rank 2 is slow, and meanwhile rank 1, restarted, is admitted in a newer quorum,
    so rank 0 gives the group up. It then votes that quorum's round down at its top and switches,
    instead of handing the script a step nobody can commit: it is handed step k twice (the failed
    round, then the round with rank 1 back), not three times."""
    from conftest import run_ftrun

    script, out, k = tmp_path / "train.py", tmp_path / "h", 4
    script.write_text(GIVEN_UP)
    proc = run_ftrun(["--nproc", 3, "--ft", "--verbose", script, out, k + 4, k], timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"rank 0: round \d+: could not form the group of quorum \d+: quorum \d+ is out",
                     proc.stderr), proc.stderr[-3000:]
    (handed,) = [json.loads(p.read_text()) for p in tmp_path.glob("h.rank0.*.json")]
    assert handed.count(k) == 2, f"rank 0 was handed steps {handed}\n{proc.stderr[-3000:]}"


RING = START + r'''
busy = float(sys.argv[4])
took = None
for step in ft.steps(total):
    opt.zero_grad()
    loss = model(torch.ones(2, 4)).sum()
    if step == k and first and rank == 3:
        time.sleep(1.0)  # its peers wait in the all-reduce for its gradients
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    loss.backward()
    if step == k and first and took is None:  # step k is handed out again after the heal
        took = time.monotonic() - t0
        time.sleep(busy)  # the script's own work after its backward (a metric, a log line)
    opt.step()
if first:
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump(took, f)
'''


def test_a_survivor_waiting_on_live_peers_ends_its_collective_when_one_of_them_fails(ftrun_home, tmp_path):
    """Four replicas; rank 3 dies while the others wait in step k's all-reduce for its gradients.
    Its ring neighbours fail at once (their connections to it closed), but rank 1 waits on them
    only, and they drop the group only when they vote, after the script's work that follows the
    backward (3 s here). A member whose collective failed shuts the group's connections down at
    once: rank 1's backward ends then too, not when its neighbours vote or at gloo's timeout."""
    from conftest import run_ftrun

    script, out, k, busy = tmp_path / "train.py", tmp_path / "h", 3, 3.0
    script.write_text(RING)
    # Rounds of one step: no re-sized quorum, whose new group would make step k a layout round
    # (nothing sent in the backward).
    proc = run_ftrun(["--nproc", 4, "--ft", script, out, k + 2, k, busy], timeout=180,
                     env={"FTRUN_FT_ROUND_STEPS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 3 (pid" in proc.stderr and "killed by SIGKILL" in proc.stderr, proc.stderr[-3000:]
    took = {r: json.loads((tmp_path / f"h.rank{r}.json").read_text()) for r in (0, 1, 2)}
    print(f"step {k}'s backward took {took} s (rank 3 died 1 s into it)")
    assert min(took.values()) > 0.9, (took, proc.stderr[-3000:])  # they did wait for rank 3's gradients
    assert max(took.values()) < 1.0 + 1.5, (took, proc.stderr[-3000:])  # not 1.0 + busy
