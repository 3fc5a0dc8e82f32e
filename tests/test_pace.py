"""The rounds of a run whose pace the keeper does not know yet (its first steps, or after a fresh
start): a replica restarted then joins at the survivors' next round's top, so those rounds must be
short. They were ROUND_STEPS long until the pace was known, and a 100M-parameter replica killed at
step 3 on CPU waited 14.4 s, most of a round of 8 slow steps, to train again (the keeper's decision:
keeper/core.py paced_steps and repace_due, tests/test_keeper_core.py).
"""

from __future__ import annotations

import json

from ftrun import pacing

SLOW = r'''
import json, os, signal, sys, time
import torch
import ftrun.ft as ft

out, total, kill_at, step_s = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
rank = int(os.environ["RANK"])
first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
torch.manual_seed(0)
model = ft.DistributedDataParallel(torch.nn.Linear(4, 1))
opt = ft.Optimizer(torch.optim.SGD(model.parameters(), lr=0.01))
asked = time.time()  # the loop's first step asks to join
handed = []
for step in ft.steps(total):
    handed.append([step, time.time()])
    opt.zero_grad()
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    time.sleep(step_s)  # the workload: a big model's slow step
    if rank == 1 and first and step == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
with open(f"{out}.rank{rank}.{os.getpid()}.json", "w") as f:
    json.dump({"asked": asked, "handed": handed}, f)
'''


def test_a_replica_killed_in_the_first_round_of_slow_steps_trains_again_within_a_few_steps(ftrun_home, tmp_path):
    """Steps of 0.5 s, rank 1 killed after step 1, before the keeper has seen the run's pace: the
    restarted replica asks to join and is handed a step before the survivor has taken more than
    three of its own (the step in flight when it asked; the one-step round whose decision names
    the new quorum, read a round late; and a quorum entered on the way, when the round the kill
    failed was decided for the quorum without rank 1 while the one with it was being published).
    With rounds of ROUND_STEPS while the pace was unknown, it waited for the survivor's round of 8
    steps to end: 9 of the survivor's steps (5.0 s at 0.5 s a step, 6.95 s at 0.7 s). The bound
    counts steps, not seconds: the join itself (the keeper's poll, the group, a 20-byte heal)
    takes a fraction of a step here."""
    from conftest import run_ftrun

    script, out, step_s, total = tmp_path / "slow.py", tmp_path / "h", 0.5, 12
    script.write_text(SLOW)
    proc = run_ftrun(["--nproc", 2, "--ft", script, out, total, 1, step_s], timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "killed by SIGKILL" in proc.stderr, proc.stderr[-3000:]
    runs = {}
    for path in tmp_path.glob("h.rank*.json"):
        runs.setdefault(int(path.name.split(".")[1][4:]), []).append(json.loads(path.read_text()))
    (survivor,) = runs[0]
    (restarted,) = runs[1]  # the first incarnation was killed before it wrote
    assert restarted["handed"], f"the restarted replica was handed no step before the run's end: {proc.stderr[-3000:]}"
    asked, back = restarted["asked"], restarted["handed"][0][1]
    meanwhile = [step for step, t in survivor["handed"] if asked < t < back]
    assert len(meanwhile) <= 3, (
        f"the restarted replica asked to join and waited {back - asked:.2f} s ({len(meanwhile)} of the survivor's "
        f"steps of {step_s} s: {meanwhile}; a round is up to {pacing.ROUND_STEPS}) to be handed a step\n"
        f"{proc.stderr[-3000:]}")
