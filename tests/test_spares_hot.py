"""Hot spares that hold the live state (ft/heal/feed.py), through the real CLI with real SIGKILLs.

A waiting spare asks the quorum's feeder (its lowest training replica) for its state once, then
takes each step's gradients and steps its own optimizer, without a forward or backward. At its
promotion the heal compares the fingerprints of both ends' models and optimizers: equal, only
the registered state and the optimizers' settings move; different (a script that changes its
parameters outside the optimizer), the whole state moves. Either way every replica that trained
to the end is bitwise identical.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from conftest import SCRIPTS, start_ftrun
from helpers import assert_identical, finish, read_state, replica, wait_state
from test_spares import _kill

TRAIN = SCRIPTS / "train_ft.py"
# 37k parameters with AdamW: 0.45 MB of state, so a transfer of the whole is plainly not 0.0 MB.
MODEL = ["--dim", 32, "--hidden", 128, "--depth", 3, "--optim", "adamw", "--lr", 0.001, "--data", "step",
         "--print-every", 50]
RECEIVED = re.compile(r"\[rank (\d+)\] ftrun\.ft: detail: rank \d+: received ([\d.]+) MB of state from rank (\d+) in "
                      r"[\d.]+ s \([\d.]+ GB/s, (\d+) tensors in place\)")

# A survivor whose step finished where its peers' failed (the kill landed between the two).
CAUGHT = re.compile(r"rank \d+: round \d+ keeps its first \d+ steps while this member had taken \d+; taking the "
                    r"committed state from a peer")


def _console(proc) -> str:
    return Path(proc.err_path).read_text()


def _until_line(proc, pattern: str, count: int = 1, timeout: float = 90.0, start: int = 0) -> None:
    """Wait until `pattern` is on the console `count` times, from character `start` on."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if len(re.findall(pattern, _console(proc)[start:])) >= count:
            return
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    raise AssertionError(f"never saw {pattern!r} {count} time(s):\n{_console(proc)[-4000:]}")


def _heals_of(err: str, rank: int) -> list:
    """(MB received, tensors in place) of each heal of `rank`, in order."""
    return [(float(mb), int(n)) for r, mb, _src, n in RECEIVED.findall(err) if int(r) == rank]


def test_a_fed_spare_takes_over_without_moving_its_model_and_the_feeds_own_failures_cost_training_nothing(
        ftrun_home, tmp_path):
    """3 training replicas and 1 spare, one run:
    - replica 3 waits as the spare and is fed by rank 0;
    - rank 1 is killed: spare 3 takes its place and receives no model or optimizer tensor (0.0 MB
      of state, the scheduler's state only), and rank 1, restarted, is fed as the new spare (a kill
      that also caught a survivor past its peers' step heals both whole: then another replica is
      killed, up to three takeovers, one of which must keep the spare's model);
    - the fed spare (rank 1) is killed: its feed is dropped, no quorum changes, and it is fed again
      once back;
    - the feeder (rank 0) is killed: spare 1 takes its place, whatever it must receive.
    The three replicas that trained to the end are bitwise identical, scheduler included."""
    out = tmp_path / "p"
    run_id = "hot"
    proc = start_ftrun(["--nproc", 4, "--ft", "--spares", 1, "--verbose", "--run-id", run_id, TRAIN, *MODEL,
                        "--steps", 400, "--step-sleep", 0.02, "--out", out], files=("stderr",))
    try:
        _until_line(proc, r"rank 0: feeds hot spare rank 3 from step \d+")
        st = wait_state(ftrun_home, run_id, lambda st: replica(st, 3).get("spare"), 90, "rank 3 fed as the spare", proc)
        spare, victim = 3, 1
        for _ in range(3):
            seen = len(_console(proc))
            _kill(st, victim)
            _until_line(proc, rf"rank 0: feeds hot spare rank {victim} from step \d+", start=seen)
            err = _console(proc)[seen:]
            if _heals_of(err, spare) == [(0.0, 0)]:  # nothing but the scheduler moved
                break
            # The kill can land as a survivor's step finished but its peers' did not: the round is
            # voted down, that survivor takes the committed state, and the one broadcast of that heal
            # carries the whole state to every healer, the spare included. Another takeover, then.
            assert CAUGHT.search(err), err[-4000:]
            spare, victim = victim, min({1, 2, 3} - {victim})
            st = wait_state(ftrun_home, run_id, lambda st: replica(st, spare).get("spare"), 90,
                            f"rank {spare} the spare", proc)
        else:
            raise AssertionError(f"no takeover of three kept the fed spare's model:\n{_console(proc)[-4000:]}")
        quorums_before = len(re.findall(r"ftrun: quorum \d+:", _console(proc)))
        st = wait_state(ftrun_home, run_id, lambda st: replica(st, victim).get("spare"), 90,
                        f"rank {victim} the spare", proc)
        restarts = replica(st, victim)["restarts"]
        seen = len(_console(proc))
        _kill(st, victim)
        _until_line(proc, rf"rank 0: feeds hot spare rank {victim} from step \d+", start=seen)
        err = _console(proc)
        assert f"rank 0: stopped feeding hot spare rank {victim}: the other end went away" in err, err[-4000:]
        assert len(re.findall(r"ftrun: quorum \d+:", err)) == quorums_before, err[-4000:]
        st = wait_state(ftrun_home, run_id,
                        lambda st: replica(st, victim)["restarts"] == restarts + 1 and replica(st, victim).get("spare"),
                        90, f"rank {victim} back as the spare", proc)
        _kill(st, 0)
        rc, err = finish(proc, 180)
    finally:
        proc.kill()
    assert rc == 0, err[-4000:]
    assert "Traceback" not in err, err[-4000:]
    assert re.search(rf"rank 0 left; spare replica {victim} takes its place", err), err[-4000:]
    trained = [1, 2, 3]
    assert assert_identical(out, trained)[1]["step"] == 400
    # Rank 0, back as the spare, waits out the run: fed at the end, it says so as it leaves.
    feeding = re.findall(r"rank \d+: (feeds|stopped feeding) hot spare rank 0\b", err)
    if feeding and feeding[-1] == "feeds":
        assert ("rank 0: the run finished at step 400 while this replica was waiting to join as a hot spare; "
                "no peer is left to heal it") in err, err[-4000:]
        assert "a fed copy of the model that no vote confirmed" in err, err[-4000:]
    scheds = {json.dumps(json.loads(Path(f"{out}.rank{r}.json").read_text())["sched"], sort_keys=True)
              for r in trained}
    assert len(scheds) == 1, scheds


def test_a_stopped_spare_never_holds_training_up_and_a_changed_model_is_sent_whole(ftrun_home, tmp_path):
    """- The fed spare is stopped (SIGSTOP): within FEED_WAIT_S its feeder drops its feed and
      training goes on (no step of the feeder waits the group's 10 s teardown); continued, it
      is fed again.
    - The script changes a parameter after each step outside the optimizer (--nudge, as an EMA or
      a weight constraint would): the fed spare misses it, the fingerprints differ at its
      promotion, and it receives the whole state (every tensor in place); all end identical."""
    out = tmp_path / "p"
    run_id = "hotnudge"
    proc = start_ftrun(["--nproc", 4, "--ft", "--spares", 1, "--verbose", "--run-id", run_id, TRAIN, *MODEL,
                        "--nudge", "--steps", 300, "--step-sleep", 0.02, "--out", out], files=("stderr",))
    try:
        _until_line(proc, r"rank 0: feeds hot spare rank 3 from step \d+")
        st = wait_state(ftrun_home, run_id, lambda st: replica(st, 3).get("spare"), 90, "rank 3 fed as the spare", proc)
        spare = replica(st, 3)["pid"]
        os.kill(spare, signal.SIGSTOP)
        stopped_at = time.time()
        try:
            _until_line(proc, r"rank 0: stopped feeding hot spare rank 3: it had not taken step \d+ after 1 s")
            step = replica(read_state(ftrun_home, run_id), 0)["step"]
            wait_state(ftrun_home, run_id, lambda st: replica(st, 0)["step"] >= step + 10, 90,
                       "rank 0 training on", proc)
        finally:
            os.kill(spare, signal.SIGCONT)
        assert time.time() - stopped_at < 8, "the feeder stalled on the stopped spare"
        _until_line(proc, r"rank 0: feeds hot spare rank 3 from step \d+", count=2)
        st = read_state(ftrun_home, run_id)
        _kill(st, 1)
        rc, err = finish(proc, 180)
    finally:
        proc.kill()
    assert rc == 0, err[-4000:]
    heals = _heals_of(err, 3)
    assert len(heals) == 1 and heals[0][0] >= 0.4 and heals[0][1] > 0, (heals, err[-4000:])  # 0.45 MB: all of it
    assert assert_identical(out, [0, 2, 3])[1]["step"] == 300


# Both training replicas spend their first step's forward asleep for longer than ftrun's timeout
# (FTRUN_FT_TIMEOUT 3 s): a data loader warming up, a first compile. The feeder answers the waiting
# spare only between its steps.
FIRST_STEP_SLOW = """\
import os, sys, time
import torch
import torch.nn as nn
import ftrun.ft as ft

torch.manual_seed(0)
model = ft.DistributedDataParallel(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1)))
opt = ft.Optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
for step in ft.steps(60):
    loss = model(torch.randn(8, 16)).pow(2).mean()
    if step == 0:
        time.sleep(float(sys.argv[1]))
    loss.backward()
    opt.step()
    time.sleep(0.05)
print(f"done at step {ft.global_step()}", flush=True)
"""


def test_a_spare_waits_for_a_feeder_slower_than_the_timeout_and_a_feeder_never_feeds_a_spare_gone(ftrun_home, tmp_path):
    """The spare asks to be fed while its feeder is 14 s into its first step: it waits for the answer
    (up to feed.ASK_S), rather than giving up at ftrun's 3 s timeout and asking again. Before, the
    feeder woke to an ask its spare had given up, formed the group with the spare's stale address,
    and sent its state into it for the whole timeout: its training thread held, and the other
    replica's next collective failed (a round voted down, every few rounds: the sharded spare run
    of CI stalled so). Here the spare is fed from the feeder's first answer, and no round fails."""
    script = tmp_path / "slow_first.py"
    script.write_text(FIRST_STEP_SLOW)
    proc = start_ftrun(["--nproc", 3, "--ft", "--spares", 1, "--verbose", script, 14], files=("stderr",),
                       env={"FTRUN_FT_TIMEOUT": "3"})
    try:
        rc, err = finish(proc, 180)
    finally:
        proc.kill()
    assert rc == 0, err[-4000:]
    assert re.search(r"rank 0: feeds hot spare rank 2 from step \d+", err), err[-4000:]
    assert "rank 2: a hot spare fed by rank 0" in err, err[-4000:]
    for bad in ("could not start feeding", "its feed as a hot spare broke", "voted down", "failed:"):
        assert bad not in err, (bad, err[-4000:])


@pytest.mark.quick
def test_a_read_that_must_not_wait_never_waits_nor_creates_the_key():
    """membership.read_now on a real TCPStore whose reads wait 20 s: a missing key (a spare's ask it
    withdrew between the feeder's check and its read) is None at once, and stays missing."""
    import datetime

    import torch.distributed as dist

    from ftrun.worker.ft.member.membership import read_now

    server = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=20), wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, None, False, datetime.timedelta(seconds=20))
    t0 = time.monotonic()
    assert read_now(client, "ftrun/ft/feed/ask/3") is None
    assert time.monotonic() - t0 < 5 and not client.check(["ftrun/ft/feed/ask/3"])
    client.set("ftrun/ft/feed/ask/3", "1 0 2")
    client.set("empty", "")
    assert read_now(client, "ftrun/ft/feed/ask/3") == "1 0 2" and read_now(client, "empty") == ""


def test_workers_that_wait_for_a_late_peer_before_the_first_quorum_start_at_once(ftrun_home, tmp_path):
    """Rank 0 comes to ftrun.ft 6 s after the others (a slow import, a big dataset), so the first
    quorum waits for it, with no quorum out yet. The others' waits to join pass their first second
    there, and spend the rest following a feeder (ft/heal/feed.py): with none out, they used to read
    quorum 0, which never exists, and wait on the store for its whole 600 s timeout; the run
    stalled before its first step (the sharded spare run of stop 62's CI stalled so). Here the
    run trains as soon as rank 0 is in, and the spare is fed."""
    script = tmp_path / "late_rank0.py"
    script.write_text("import os, sys, time\n"
                      "if os.environ['RANK'] == '0':\n    time.sleep(6)\n" + FIRST_STEP_SLOW.replace("import os, sys, time\n", ""))
    t0 = time.monotonic()
    proc = start_ftrun(["--nproc", 3, "--ft", "--spares", 1, "--verbose", script, 0], files=("stderr",))
    try:
        rc, err = finish(proc, 90)
    finally:
        proc.kill()
    assert rc == 0, err[-4000:]
    assert time.monotonic() - t0 < 75, err[-4000:]
    assert "rank 2: a hot spare fed by rank" in err, err[-4000:]


@pytest.mark.extended
def test_a_fed_spare_is_never_a_fresh_quorums_source(ftrun_home, tmp_path):
    """Every training replica lost at once while the fed spare is the lowest rank: the spare's state
    is the feed's, not a committed one, so named the fresh quorum's source it restarts clean, and
    the run begins again from the first step (no --checkpoint-dir) on every replica alike."""
    out = tmp_path / "p"
    run_id = "hotfresh"
    proc = start_ftrun(["--nproc", 4, "--ft", "--spares", 1, "--verbose", "--run-id", run_id, TRAIN, *MODEL,
                        "--steps", 200, "--step-sleep", 0.02, "--out", out], files=("stderr",))
    try:
        st = wait_state(ftrun_home, run_id, lambda st: replica(st, 3).get("spare"), 90, "replica 3 the spare", proc)
        _kill(st, 0)
        _until_line(proc, r"rank 1: feeds hot spare rank 0 from step \d+")  # rank 0 back, the fed spare
        st = read_state(ftrun_home, run_id)
        for r in (1, 2, 3):
            _kill(st, r)
        rc, err = finish(proc, 180)
    finally:
        proc.kill()
    assert rc == 0, err[-4000:]
    assert "rank 0: named the source of a fresh quorum while holding a state that is not the committed one" \
        in err, err[-4000:]
    ranks = [r for r in range(4) if Path(f"{out}.rank{r}.pt").exists()]
    assert len(ranks) == 3, ranks
    assert assert_identical(out, ranks)[1]["step"] == 200
