"""--ft for an unmodified Lightning script (ftrun's FTStrategy put in place of DDP): only the
killed replica restarts, it goes on mid-run with the whole Lightning state from a peer, and every
sample is trained once an epoch (the counter model of tests/lightning_counter.py). Real CLI,
real SIGKILL, CPU gloo."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import ROOT, start_ftrun
from helpers import finish, needs, own_steps, read_reports
from test_ft_data import _kill_at

pytestmark = needs("lightning")

WORKER = ROOT / "tests" / "lightning_counter.py"


def _weights_once_an_epoch(report, epochs, size, accumulate=1):
    """Each (epoch, sample) weight is -1/n for the n replicas of the one committed step that
    trained it (-1/(k n) with accumulate_grad_batches=k): once, at full or reduced strength."""
    strengths = {}
    for e in range(epochs):
        for i, w in enumerate(report["weights"][e]):
            n = next((n for n in (3, 2, 1) if abs(w + 1 / (accumulate * n)) < 1e-5), None)
            assert n is not None, (e, i, w)
            strengths.setdefault(e, set()).add(n)
    return strengths


def test_unmodified_lightning_script_heals_mid_run(ftrun_home, tmp_path):
    """Three replicas, 4 epochs of 10 steps of 2 accumulated batches (accumulate_grad_batches=2),
    a loader with 2 workers (prefetching batches planned for a membership that changes); replica
    1 killed early in epoch 1, then replica 2 late in it: the run finishes, each restarted
    replica's fit() went on where the run was (not from epoch 0), every sample was trained once an
    epoch (every weight is -1/(2n): a redone step computed both batches of its window again, not
    only the last, and never twice), and the replicas end identical."""
    out, size, epochs = tmp_path / "o", 120, 4
    proc = start_ftrun(["--nproc", 3, "--ft", "--max-restarts", 4, "--run-id", "light", WORKER, epochs, out,
                        "--size", size, "--batch", 2, "--sleep", 0.06, "--workers", 2, "--accumulate", 2], files=("stderr",))
    try:
        # Early and late in epoch 1, with 20 steps left for the second to come back.
        _kill_at(ftrun_home, "light", proc, [(1, 11), (2, 19)])
        rc, err = finish(proc, 300)
    finally:
        proc.kill()
    assert rc == 0, err[-3000:]
    # Two restarts for the two kills; a kill as a survivor's step went through may add one more, named
    # as taking the committed state again (a Lightning loop cannot take it in place).
    restarts = [line for line in err.splitlines() if "restarting it alone" in line]
    killed = [line for line in restarts if "killed by SIGKILL" in line]
    assert len(killed) == 2 and all(line in killed or "committed state again" in line for line in restarts), err[-3000:]
    assert "cannot heal" not in err, err[-3000:]
    reports = read_reports(out, 3)
    assert all(rep["step"] == epochs * 10 for rep in reports.values()), {r: rep["step"] for r, rep in reports.items()}
    assert reports[0]["weights"] == reports[1]["weights"] == reports[2]["weights"]
    strengths = _weights_once_an_epoch(reports[0], epochs, size, accumulate=2)
    assert strengths[0] == {3}, strengths  # nothing failed in epoch 0
    assert any(2 in s for s in strengths.values()), strengths  # steps ran with a replica away
    for r in (1, 2):
        starts = [json.loads(line) for line in Path(f"{out}.rank{r}.starts").read_text().splitlines()]
        assert len(starts) >= 2 and starts[0] == {**starts[0], "epoch": 0, "step": 0}, starts
        # Went on where the run was, mid-epoch or at an epoch's start, not from epoch 0:
        assert all(s["step"] >= 11 and s["epoch"] == s["step"] // 10 for s in starts[1:]), starts
    assert sum(len(Path(f"{out}.rank{r}.starts").read_text().splitlines()) - 1 for r in range(3)) == len(restarts)


def test_lightning_on_a_stream_heals_and_reads_each_share_once(ftrun_home, tmp_path):
    """An unmodified Lightning script whose training DataLoader reads an IterableDataset split by
    rank (rank r of 3 reads r, r + 3, ..., as a torchrun script splits a stream), 3 replicas, 2
    epochs (passes), accumulate_grad_batches=2; replica 1 SIGKILLed mid-epoch: it restarts, heals,
    and its fit() goes on reading its own shard exactly at its last committed step; the pass ends
    once every shard is read (the others train empty batches meanwhile; while it is away their
    draws take 10 times longer, and 60 times from the fourth, so that it is back before their
    shards end: on a loaded machine its restart took 12 s, and the pass then ended without its
    shard's rest, as ftrun says). Every sample is trained
    once an epoch among committed steps (-1/(2n)), the replicas never killed trained exactly their
    shards' batches in order, and the replicas' whole state ends identical."""
    out, size, batch, epochs = tmp_path / "o", 120, 2, 2
    proc = start_ftrun(["--nproc", 3, "--ft", "--max-restarts", 2, "--run-id", "lstream", WORKER, epochs, out,
                        "--size", size, "--batch", batch, "--sleep", 0.08, "--away-sleep", 60, "--iterable",
                        "--accumulate", 2], files=("stderr",))
    try:
        _kill_at(ftrun_home, "lstream", proc, [(1, 3)])
        rc, err = finish(proc, 300)
    finally:
        proc.kill()
    assert rc == 0, err[-3000:]
    assert err.count("restarting it alone") == 1 and "cannot heal" not in err, err[-3000:]
    assert "ends without the rest" not in err, err[-3000:]
    reports = read_reports(out, 3)
    assert reports[0]["weights"] == reports[1]["weights"] == reports[2]["weights"]
    assert reports[0]["state"] == reports[1]["state"] == reports[2]["state"], [rep["state"] for rep in reports.values()]
    strengths = _weights_once_an_epoch(reports[0], epochs, size, accumulate=2)
    assert any(2 in s for s in strengths.values()), strengths  # steps ran with replica 1 away
    shards = {r: [list(range(r, size, 3))[i:i + batch] for i in range(0, size // 3, batch)] for r in range(3)}
    # While replica 1's shard lagged, the others' were done: each such batch was their stream's first
    # sample at zero weight in place of a batch of none (the weights above are unchanged by it).
    assert any(len(b) == 1 for r in (0, 2) for b in reports[r]["trained"]), [reports[r]["trained"] for r in (0, 2)]
    for r in (0, 2):  # never killed: exactly their shards, each epoch, in order
        mine = own_steps(reports[r]["trained"], batch, 2)
        assert mine == shards[r] * epochs, (r, mine)
    starts = [json.loads(line) for line in Path(f"{out}.rank1.starts").read_text().splitlines()]
    assert len(starts) == 2 and starts[1]["step"] >= 1, starts
    # The restarted process read its own shard on from where its last committed step left it, to the end.
    again = own_steps(reports[1]["trained"], batch, 2)
    whole = shards[1] * epochs
    k = len(whole) - len(again)
    assert 0 < k < len(shards[1]) and again == whole[k:], (k, again[:4])


FEATURES = ROOT / "tests" / "lightning_features.py"


def test_lightning_state_scheduler_callbacks_and_checkpoints_heal(ftrun_home, tmp_path):
    """An LR scheduler stepped every batch, a callback counting batches, sync_dist logging,
    validation every epoch, a ModelCheckpoint and a loader with workers; replica 1 killed, then
    replica 0 (the checkpoint writer): the run finishes, and every replica ends with the same
    parameters, learning rate, callback state and checkpoint choices as the others, the callback
    having counted each committed batch once; the checkpoints are written; validate() after fit()
    gives every replica the same metrics. Lightning's barrier, reduce (self.log's sync_dist),
    all_gather, broadcast and reduce_boolean_decision go over the replicas alive in each step."""
    import torch

    out, epochs, steps = tmp_path / "o", 4, 20
    proc = start_ftrun(["--nproc", 3, "--ft", "--max-restarts", 4, "--run-id", "feat", FEATURES, epochs, out,
                        "--size", 240, "--batch", 4, "--sleep", 0.1], files=("stderr",))
    try:
        _kill_at(ftrun_home, "feat", proc, [(1, 12), (0, 30)])
        rc, err = finish(proc, 300)
    finally:
        proc.kill()
    assert rc == 0, err[-3000:]
    assert err.count("restarting it alone") == 2, err[-3000:]
    reports = read_reports(out, 3)
    first = reports[0]
    for r, rep in reports.items():
        assert rep["params"] == first["params"], r
        assert rep["step"] == rep["batches"] == rep["started"] == rep["total_batch_idx"] + 1 == epochs * steps, (r, rep)
        assert rep["lr"] == first["lr"] and abs(rep["lr"] - 0.05 * 0.9 ** (epochs * steps // 7)) < 1e-9, (r, rep["lr"])
        assert rep["best"] == first["best"] and rep["best_k"] == first["best_k"], (r, rep["best"], first["best"])
        assert rep["metrics"]["val_loss"] == first["metrics"]["val_loss"], r
        assert rep["validated"] == first["validated"], r  # validate() after fit(): no group of all workers
    for r in (0, 1):
        starts = [json.loads(line) for line in Path(f"{out}.rank{r}.starts").read_text().splitlines()]
        assert len(starts) == 2 and starts[1]["step"] >= 12, starts
    _collectives_over_live_replicas(reports, kills=2)
    last = torch.load(f"{out}.ckpt/last.ckpt", weights_only=False)
    assert last["global_step"] == epochs * steps
    assert all(Path(p).exists() for p in first["best_k"]), first["best_k"]


def _collectives_over_live_replicas(reports, kills):
    """Lightning's distributed calls inside a step and between steps went over the replicas alive
    in the step: the same answer on every replica that made the step, every replica at the end.
    A call between steps that a kill interrupted gave each survivor its own value (at most one
    step per kill); one inside a step was made again with the redone step. An evaluation's
    reduce and all_gather are each replica's own (it evaluated the whole set)."""
    interrupted = set()
    for where in ("in_step", "between"):
        by_step = {}
        for r, rep in reports.items():
            for step, seen in rep["seen"][where].items():
                ids = seen["ids"]
                if not (r in ids and ids == sorted(ids) and seen["n"] == len(ids) and seen["first"] == ids[0]
                        and seen["any0"] == (0 in ids) and seen["all0"] == (ids == [0])):
                    assert where == "between", (where, r, step, seen)
                    interrupted.add(step)
                by_step.setdefault(step, []).append((r, seen))
        last = [seen for _, seen in by_step[max(by_step, key=int)]]
        assert len(last) == 3 and last[0]["ids"] == [0, 1, 2], (where, last)
        for step, entries in by_step.items():
            seen = [s for _, s in entries]
            if all(s == seen[0] for s in seen):
                continue
            # The call the kill interrupted may also have fallen back whole to each survivor's own
            # value (ids == [itself]): consistent on each, different between them.
            own = where == "between" and all(s["ids"] == [r] for r, s in entries)
            assert step in interrupted or own, (where, step, seen)
            interrupted.add(step)
    assert len(interrupted) <= kills, interrupted
    assert all(rep["seen"]["live"] == 3.0 for rep in reports.values())  # self.log(..., sync_dist=True)
    assert all(rep["seen"]["validation"] == {"n": 1.0, "gathered": [1]} for rep in reports.values())


def test_whole_run_killed_and_resumed_mid_epoch(ftrun_home, tmp_path):
    """--checkpoint-dir: the whole run (ftrun and every worker) is SIGKILLed mid-epoch, then run
    again: fit() goes on from the checkpoint's step, mid-epoch, and every sample is trained once an
    epoch (the steps after the checkpoint are trained again, on the checkpoint's model)."""
    import signal

    from conftest import run_ftrun
    from helpers import wait_replica

    out, ck, size, epochs = tmp_path / "o", tmp_path / "ck", 80, 3
    args = ["--nproc", 2, "--ft", "--checkpoint-dir", ck, "--checkpoint-every", 7, "--run-id", "first", WORKER,
            epochs, out, "--size", size, "--batch", 2, "--sleep", 0.05]
    proc = start_ftrun(args, files=("stderr",))
    try:
        wait_replica(ftrun_home, "first", 0, lambda r, st: r["step"] >= 30, 180, proc=proc)
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
    strengths = _weights_once_an_epoch(reports[0], epochs, size)
    assert all(s == {2} for s in strengths.values()), strengths
    starts = [json.loads(line) for line in Path(f"{out}.rank0.starts").read_text().splitlines()]
    assert starts[-1]["step"] >= 28 and starts[-1]["step"] % 7 == 0, starts  # the checkpoint's step, mid-run


GAN = ROOT / "tests" / "lightning_gan.py"


def test_manual_optimization_heals_a_gans_two_optimizers_and_one_clipped(ftrun_home, tmp_path):
    """Lightning's manual optimization, unmodified: a GAN (two optimizers, the discriminator's
    manual_backward and step, then the generator's, each inside toggle_optimizer) on three replicas, rank 1 killed inside the
    discriminator's backward, rank 2 between the two steps (the discriminator's committed, the
    generator's not: the batch is trained again with the first step skipped), rank 0 inside the
    generator's backward; and one optimizer whose gradients the script clips, on two replicas, one
    killed. Each run finishes with every kill healed from a peer, each counter (one weight per
    sample for each optimizer) at exactly -epochs, global_step counting committed optimizer steps
    only, the LR schedulers the script steps after each step stepped once a batch, and every
    replica's whole state (both models, both optimizers, the step) the same. A training_step that
    steps no optimizer in a batch is refused."""
    import torch

    runs = {"gan": (3, 6, 3, ["--die-at", "1:2:d,2:7:between,0:12:g"]),
            "one": (2, 4, 1, ["--optimizers", "one", "--die-at", "1:5:d"]),
            "nostep": (2, 1, 0, ["--no-step-at", 1])}
    procs = {name: start_ftrun(["--nproc", n, "--ft", GAN, epochs, tmp_path / name, "--sleep", 0.05, *extra],
                               files=("stderr",))
             for name, (n, epochs, _, extra) in runs.items()}
    try:
        done = {name: finish(proc, 300) for name, proc in procs.items()}
    finally:
        for proc in procs.values():
            proc.kill()
    # A batch that steps no optimizer (gradients kept for a later batch's step) is refused in one line.
    rc, err = done.pop("nostep")
    assert rc == 2 and "training_step (manual optimization) stepped no optimizer in batch 1 of epoch 0" in err, err[-3000:]
    assert "Traceback" not in err and "restarting" not in err, err[-3000:]
    for name, (n, epochs, kills, _) in runs.items():
        if name not in done:
            continue
        rc, err = done[name]
        assert rc == 0, err[-3000:]
        assert err.count("healed from a peer") == kills and "cannot heal" not in err, err[-3000:]
        assert "Traceback" not in err, err[-3000:]
        states = [torch.load(f"{tmp_path / name}.rank{r}.pt", weights_only=False) for r in range(n)]
        two = name == "gan"
        batches = epochs * 96 // (8 * n)
        for r, s in enumerate(states):
            for counter in ("count_d", "count_g") if two else ("count_d",):
                assert torch.unique(s[counter]).tolist() == [-float(epochs)], (name, r, counter, torch.unique(s[counter]))
            assert s["step"] == batches * (2 if two else 1), (name, r, s["step"])
            if two:  # each scheduler stepped once a batch, however often the batch was trained
                assert s["lr"] == [[0.05 * 0.99 ** batches, 1.0]] * 2, (name, r, s["lr"])
        for s in states[1:]:
            for part in ("G", "D"):
                assert all(torch.equal(v, states[0][part][k]) for k, v in s[part].items()), (name, part)
            assert len(s["optimizers"]) == (2 if two else 1)
            for mine, theirs in zip(s["optimizers"], states[0]["optimizers"]):
                assert mine["param_groups"] == theirs["param_groups"] and mine["state"].keys() == theirs["state"].keys()
                assert all(torch.equal(a, theirs["state"][i][k]) for i, st in mine["state"].items()
                           for k, a in st.items()), name


def test_a_spare_promoted_into_a_lost_gan_step_takes_its_schedules_as_at_the_batchs_top(ftrun_home, tmp_path):
    """The GAN on 4 workers with --spares 1: rank 1 is killed inside the discriminator's backward,
    and the spare takes its place in the quorum published at once, so it heals at the top of the
    batch trained again, from a survivor whose lost attempt had stepped both LR schedulers. Its
    source used to send them so, one step ahead: the promoted spare stepped both optimizers at
    the next learning rate, and the guard found it apart at the next step (2 of 2 runs). Now
    no state differs, and the replicas that trained to the end hold the same state and rates."""
    import torch

    out, epochs = tmp_path / "spare", 2
    proc = start_ftrun(["--nproc", 4, "--ft", "--spares", 1, GAN, epochs, out, "--sleep", 0.05, "--spares", 1,
                        "--die-at", "1:2:d"], files=("stderr",))
    try:
        rc, err = finish(proc, 300)
    finally:
        proc.kill()
    assert rc == 0, err[-3000:]
    assert "spare replica 3 takes its place" in err, err[-3000:]
    assert "differs from its peers" not in err and "differ from their peers" not in err, err[-3000:]
    trained = [r for r in range(4) if Path(f"{out}.rank{r}.pt").exists()]
    assert len(trained) == 3 and 3 in trained, trained
    states = [torch.load(f"{out}.rank{r}.pt", weights_only=False) for r in trained]
    batches = epochs * 96 // (8 * 4)  # Lightning's batches: its sampler splits the set over the 4 workers
    for s in states:
        assert s["step"] == 2 * batches and s["lr"] == [[0.05 * 0.99 ** batches, 1.0]] * 2, (s["step"], s["lr"])
        for counter in ("count_d", "count_g"):  # every sample once an epoch, by each optimizer
            assert torch.unique(s[counter]).tolist() == [-float(epochs)], (counter, torch.unique(s[counter]))
        for part in ("G", "D"):
            assert all(torch.equal(v, states[0][part][k]) for k, v in s[part].items()), part


def test_what_ftrun_cannot_heal_is_one_line_and_group_restarts(ftrun_home, tmp_path):
    """A DDPStrategy object the script builds is not ftrun's: one line at the start (and no advice
    to wrap the loop with ftrun.ft, which does not fit a Lightning script), Lightning's own DDP
    (all workers in one group), and the run trains as without --ft (group restarts)."""
    runs = {"object": (["--strategy", "DDPStrategy"], "this Lightning Trainer's strategy is DDPStrategy, which ftrun "
                                                      "cannot heal: a failure restarts all workers")}
    procs = {name: start_ftrun(["--nproc", 2, "--ft", WORKER, 1, tmp_path / name, "--size", 24, *extra],
                               files=("stderr",))
             for name, (extra, _) in runs.items()}
    try:
        done = {name: finish(proc, 300) for name, proc in procs.items()}
    finally:
        for proc in procs.values():
            proc.kill()
    for name, (_, line) in runs.items():
        rc, err = done[name]
        assert rc == 0, err[-3000:]
        assert err.count(line) == 1, err[-3000:]
        assert "trains without ftrun.ft" not in err and "train_ft.py" not in err, err[-3000:]
        assert "Initializing distributed: GLOBAL_RANK" in err, err[-3000:]  # Lightning's own DDP
        assert "init_process_group" not in err, err[-3000:]  # not taken for an ftrun.ft script
        reports = read_reports(tmp_path / name, 2)
        assert reports[0]["weights"] == reports[1]["weights"]
        assert {round(w, 5) for w in reports[0]["weights"][0]} == {-0.5}


def test_the_older_package_and_a_strategy_object_the_script_builds(ftrun_home, tmp_path):
    """`import pytorch_lightning` and `Trainer(strategy=FTStrategy())` from ftrun.lightning: the
    replicas form a quorum (no group-restart line) and train each sample once."""
    from conftest import run_ftrun

    out = tmp_path / "o"
    proc = run_ftrun(["--nproc", 2, "--ft", WORKER, 1, out, "--size", 24, "--package=pytorch_lightning",
                      "--strategy", "FTStrategy"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "quorum 1: 2 replicas" in proc.stderr and "ftrun: --ft:" not in proc.stderr, proc.stderr[-3000:]
    reports = read_reports(out, 2)
    assert reports[0]["weights"] == reports[1]["weights"]
    assert {round(w, 5) for w in reports[0]["weights"][0]} == {-0.5}
