"""The DiLoCo quality benchmark (scripts/bench_diloco_quality.py, run by hand) and its training script
(scripts/train_tiny_gpt.py): the script under the real CLI with `--hook diloco` at a tiny size (the
replicas apart between syncs, bitwise the same at each, the loss going down), the language's loss
floor against a computation of it by hand, and the driver's parts that start no worker (its
arguments and refusals, the medians, the table, the page), and its cleanup under SIGTERM.
"""

from __future__ import annotations

import math
import signal
import subprocess
import sys

import psutil
import pytest

from conftest import ROOT, SCRIPTS, run_ftrun
from helpers import read_reports, wait_for

sys.path.insert(0, str(SCRIPTS))

import bench_diloco_quality as bench  # noqa: E402

TINY = ["--layers", "1", "--dim", "32", "--heads", "2", "--batch", "8", "--heldout", "64", "--lr", "1e-2"]


def test_diloco_replicas_part_between_syncs_and_meet_at_each(ftrun_home, tmp_path):
    """Two workers, `--hook diloco --period 5`, 30 steps, the parameters' digest every 3 steps: at
    steps 15 and 30 (syncs) both ranks hold bitwise the same model, at the others (each replica's
    own steps, nothing sent) they differ; the held-out and training losses go down, and never
    below the language's floor. About 10 s on 2 cores, most of it two torch imports."""
    out = tmp_path / "r"
    proc = run_ftrun(["--nproc", "2", "--hook", "diloco", "--period", "5", SCRIPTS / "train_tiny_gpt.py",
                      "--steps", "30", "--eval-every", "3", *TINY, "--out", out], timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert "DiLoCo: 6 syncs" in proc.stdout + proc.stderr
    ranks = read_reports(out, 2)
    assert [r["world"] for r in ranks.values()] == [2, 2]
    assert all(r["samples"] == 30 * 8 * 2 and len(r["losses"]) == 30 for r in ranks.values())
    steps = [e["step"] for e in ranks[0]["evals"]]
    assert steps == list(range(3, 31, 3)) == [e["step"] for e in ranks[1]["evals"]]
    for a, b in zip(ranks[0]["evals"], ranks[1]["evals"]):
        if a["step"] % 5 == 0:
            assert a["sha256"] == b["sha256"] and a["heldout_loss"] == b["heldout_loss"], a["step"]
        else:
            assert a["sha256"] != b["sha256"], a["step"]
    assert ranks[0]["sha256"] == ranks[1]["sha256"]
    for r in ranks.values():
        evals = [e["heldout_loss"] for e in r["evals"]]
        assert evals[-1] < evals[0] - 0.2, evals
        assert sum(r["losses"][-5:]) < sum(r["losses"][:5]) - 1.0, r["losses"]
        assert r["floor_loss"] < min(evals) and r["floor_loss"] < r["no_topic_loss"] < r["bigram_loss"] < \
            r["unigram_loss"] < math.log(64)
        assert r["steps_per_s"] > 0 and r["wall_s"] > 0


def test_the_languages_floor_is_the_bayes_optimal_loss():
    """floor_loss against the same sum written out position by position: the topic's posterior from
    the tokens within their classes seen so far, the classes' second-order table as it is."""
    import torch

    import train_tiny_gpt as t

    lang = t.Language(3)
    x = lang.sample(5, 12, torch.Generator().manual_seed(1))
    assert x.shape == (5, 12) and 0 <= int(x.min()) and int(x.max()) < t.VOCAB
    total, n = 0.0, 0
    for seq in x.tolist():
        classes = [t.BOS] * t.ORDER + [v // t.PER_CLASS for v in seq]
        joint = [math.log(1 / t.TOPICS)] * t.TOPICS  # log P(topic, tokens so far), the class part left out
        for i, v in enumerate(seq):
            c, w = v // t.PER_CLASS, v % t.PER_CLASS
            p_class = float(lang.pc[tuple(classes[i:i + t.ORDER])][c])
            norm = math.log(sum(math.exp(j) for j in joint))
            p_tok = sum(math.exp(joint[z] - norm) * float(lang.pt[z, c, w]) for z in range(t.TOPICS))
            if i > 0:  # the model predicts tokens 1.. from those before them
                total -= math.log(p_class * p_tok)
                n += 1
            joint = [joint[z] + math.log(float(lang.pt[z, c, w])) for z in range(t.TOPICS)]
    assert lang.floor_loss(x) == pytest.approx(total / n, rel=1e-5)
    # Without the topic, its prior in place of the posterior: worse on a long sample.
    long = lang.sample(64, 65, torch.Generator().manual_seed(2))
    assert lang.floor_loss(long) < lang.floor_loss(long, topic_inferred=False) - 0.2


@pytest.mark.quick
def test_arguments_defaults_and_refusals():
    args = bench.parse([])
    assert (args.runs, args.nproc, args.steps, args.eval_every) == (2, 2, 500, 100)
    assert args.keys == ["ddp", "diloco20", "diloco100", "streaming20-f4", "diloco20-int8", "localsgd20"]
    assert bench.parse(["--only", "diloco20, ddp", "--steps", "60", "--eval-every", "20"]).keys == ["diloco20", "ddp"]
    for bad in (["--only", "diloco50"], ["--only", ","], ["--runs", "0"], ["--nproc", "1"], ["--steps", "0"],
                ["--steps", "550"],                                  # diloco100's syncs fall off the end
                ["--eval-every", "50"],                              # evaluations between diloco100's syncs
                ["--only", "ddp,diloco20", "--steps", "70"]):
        with pytest.raises(SystemExit) as e:
            bench.parse(bad)
        assert e.value.code == 2, bad
    assert bench.parse(["--only", "ddp", "--steps", "7", "--eval-every", "7"]).steps == 7
    assert [bench.period_of(f) for _, _, f in bench.CONFIGS] == [1, 20, 100, 20, 20, 20]


@pytest.mark.quick
def test_each_run_is_the_real_cli_with_the_configurations_flags_and_the_runs_seed(tmp_path):
    args = bench.parse(["--nproc", "3", "--only", "streaming20-f4", "--steps", "40", "--eval-every", "20"])
    cmd = bench.run_cmd(args, bench.FLAGS["streaming20-f4"], 1, tmp_path / "r")
    assert cmd[:6] == [sys.executable, "-m", "ftrun", "--nproc", "3", "--quiet"]
    flat = " ".join(cmd)
    assert f"--hook diloco --period 20 --fragments 4 --sync-delay 4 {bench.TRAIN} --steps 40 " in flat
    assert "--seed 1 " in flat and "--eval-every 20 " in flat and flat.endswith(f"--out {tmp_path / 'r'}")
    assert bench.run_cmd(args, [], 0, tmp_path / "r")[6] == str(bench.TRAIN)  # plain DDP: no hook flag


def _rank(loss, evals, sps, sha="a"):
    return {"heldout_loss": loss, "evals": [{"step": s, "heldout_loss": v} for s, v in evals], "steps_per_s": sps,
            "wall_s": 60.0, "sha256": sha, "params": 421_376, "samples": 16_000, "tokens": 1_024_000,
            "floor_loss": 2.083, "no_topic_loss": 2.927, "unigram_loss": 3.946, "bigram_loss": 3.381,
            "torch": "2.13.0+cpu", "device": "cpu"}


def _run(loss, sps=8.0, same=True):
    evals = [(100, loss + 0.8), (200, loss + 0.5), (300, loss + 0.2), (400, loss + 0.1), (500, loss)]
    return bench.collect([_rank(loss, evals, sps), _rank(loss, evals, sps, "a" if same else "b")])


@pytest.mark.quick
def test_one_runs_figures_the_medians_and_the_table(tmp_path):
    one = bench.collect([_rank(2.2, [(100, 3.0), (200, 2.2)], 8.0), _rank(2.4, [(100, 3.2), (200, 2.4)], 10.0, "b")])
    assert one["heldout_loss"] == pytest.approx(2.3)
    assert one["evals"] == {100: pytest.approx(3.1), 200: pytest.approx(2.3)}
    assert one["steps_per_s"] == 9.0 and one["same_model"] is False and one["floor_loss"] == 2.083
    s = bench.summarize([_run(2.2, 8.0), {"error": "exit 1: boom"}, _run(2.1, 9.0), _run(2.3, 7.0)])
    assert (s["heldout_loss"], s["steps_per_s"], s["runs"], s["failed"]) == (2.2, 8.0, 3, 1)
    assert s["evals"][100] == pytest.approx(3.0) and s["same_model"] is True
    assert bench.summarize([{"error": "no end within 600 s"}]) == {"error": "no end within 600 s"}
    assert bench.points([100, 200, 300, 400, 500]) == [100, 200, 300, 400, 500]
    assert bench.points(list(range(100, 1001, 100))) == [200, 500, 700, 1000]

    rows = {"diloco100": bench.summarize([_run(2.31)]), "ddp": bench.summarize([_run(2.2)]),
            "streaming20-f4": bench.summarize([_run(2.2, same=False)]), "diloco20-int8": {"error": "exit 1: boom"}}
    meta = {"machine": "x86_64, 2 CPU cores", "nproc": 2, "layers": 2, "dim": 128, "seq": 64, "lr": 3e-3,
            "steps": 500, "batch": 16, "runs": 1, "load": "1.00 1.00 1.00"}
    lines = bench.table(rows, meta).splitlines()
    for needle in ("x86_64, 2 CPU cores; torch 2.13.0+cpu on cpu", "0.42M-parameter GPT (2 layers, width 128",
                   "16,000 sequences (1.02M tokens)", "one run (seed 0)", "2.083 (Bayes-optimal)",
                   "3.381 for a bigram", "Load average 1.00 1.00 1.00"):
        assert needle in lines[0], needle
    assert lines[2] == ("| configuration | held-out @ step 100 | held-out @ step 200 | held-out @ step 300 | "
                        "held-out @ step 400 | held-out @ step 500 | x DDP's (end) | same model on every rank "
                        "| steps/s |")
    assert lines[3] == "|---|---:|---:|---:|---:|---:|---:|:---:|---:|"
    # CONFIGS' order, not the order the rows came in
    assert lines[4] == "| plain DDP (no hook) | 3.0000 | 2.7000 | 2.4000 | 2.3000 | 2.2000 | 1.000x | yes | 8.00 |"
    assert lines[5] == ("| `--hook diloco --period 100` | 3.1100 | 2.8100 | 2.5100 | 2.4100 | 2.3100 | 1.050x | yes "
                        "| 8.00 |")
    assert lines[6].startswith("| `--hook diloco --period 20 --fragments 4 --sync-delay 4` |")
    assert lines[6].endswith("| 1.000x | no | 8.00 |")
    assert lines[7] == "| `--hook diloco --period 20 --wrap int8` | failed: exit 1: boom | | | | | | | |"
    assert all(line.count("|") == lines[2].count("|") for line in lines[2:])
    assert "median of 2 runs (seeds 0-1" in bench.table(rows, dict(meta, runs=2))



def test_sigterm_stops_the_run_and_removes_the_folder(tmp_path):
    """The driver stopped mid-run: its ftrun and workers are gone, its temporary folder too, and it
    exits as SIGTERM says."""
    env = {"TMPDIR": str(tmp_path), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, str(SCRIPTS / "bench_diloco_quality.py"), "--only", "ddp", "--runs", "1",
                             "--steps", "100000", "--eval-every", "100000", "--layers", "1", "--dim", "32"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        def workers():
            found = []
            for kid in psutil.Process(proc.pid).children(recursive=True):
                try:
                    if any("train_tiny_gpt.py" in a for a in kid.cmdline()) and "ftrun" not in kid.cmdline()[1:3]:
                        found.append(kid)
                except psutil.NoSuchProcess:
                    pass
            return found

        found = wait_for(lambda: len(workers()) == 2 and workers(), 60, "two workers started", proc)
        assert [p.name for p in tmp_path.glob("ftrun-bench-diloco-quality-*")]
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    _, alive = psutil.wait_procs(found, timeout=10)
    assert not alive, alive
    assert not list(tmp_path.iterdir()), list(tmp_path.iterdir())
