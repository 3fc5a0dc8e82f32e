"""The slow-link benchmark's parts that need no network namespace (scripts/bench_slow_link.py, itself
a script run by hand as root): its arguments, the refusal where it cannot run, the undo list that
leaves nothing behind under a signal, the commands it gives each node, the table and the page it
writes; and its training script run by the real CLI on one node, over loopback.
"""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import textwrap

import pytest

from conftest import ROOT, SCRIPTS, run_ftrun

sys.path.insert(0, str(SCRIPTS))

import bench_slow_link as bench  # noqa: E402

@pytest.mark.quick
def test_arguments_defaults_and_refusals():
    args = bench.parse([])
    assert (args.runs, args.steps, args.warmup, args.rate, args.delay) == (2, 100, 10, "100mbit", "20ms")
    assert args.keys == ["ddp", "localsgd20", "diloco20", "diloco100", "diloco20-bf16", "diloco20-int8",
                         "streaming20-f4", "torchft-diloco20"]
    assert bench.parse(["--only", "diloco100, ddp"]).keys == ["diloco100", "ddp"]
    for bad in (["--only", "diloco50"], ["--only", ","], ["--runs", "0"], ["--warmup", "100"]):
        with pytest.raises(SystemExit) as e:
            bench.parse(bad)
        assert e.value.code == 2, bad


@pytest.mark.quick
def test_refuses_in_one_line_without_root_or_iproute2(tmp_path):
    assert "needs root" in bench.preflight(1000, lambda tool: "/sbin/" + tool)
    assert bench.preflight(0, lambda tool: None if tool == "tc" else "/sbin/" + tool).endswith("tc not found on PATH")
    assert bench.preflight(0, lambda tool: "/sbin/" + tool) is None
    # The real script, with nothing on PATH: refused before it makes anything (root or not).
    proc = subprocess.run([sys.executable, str(SCRIPTS / "bench_slow_link.py"), "--runs", "1"], capture_output=True,
                          text=True, timeout=60, env={"PATH": str(tmp_path)}, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bench_slow_link: needs"), proc.stderr
    assert proc.stdout == ""


GUARDED = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    sys.path.insert(0, {scripts!r})
    import bench_slow_link as b
    marks = Path(sys.argv[1])

    def mark(what):
        return lambda: marks.write_text(marks.read_text() + what + "\\n")

    def fail():
        raise RuntimeError("boom")

    def body(cleanup):
        marks.write_text("")
        cleanup.add("the namespace", mark("namespace"))
        cleanup.add("the veth", fail)
        cleanup.add("the node", mark("node"))
        print("ready", flush=True)
        time.sleep(60)
        return 0

    sys.exit(b.guarded(body))
""")


@pytest.mark.quick
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_undoes_everything_recorded_newest_first(tmp_path, sig):
    """Every recorded undo runs once, newest first (a node before the namespace it lives in), past
    one that fails, and the process exits as the signal says."""
    script = tmp_path / "guarded.py"
    script.write_text(GUARDED.format(scripts=str(SCRIPTS)))
    marks = tmp_path / "marks"
    proc = subprocess.Popen([sys.executable, str(script), str(marks)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 128 + sig, err
    assert marks.read_text() == "node\nnamespace\n"
    assert "could not undo the veth: boom" in err


@pytest.mark.quick
def test_undo_list_on_a_normal_end_and_on_an_error():
    done = []
    assert bench.guarded(lambda c: (c.add("a", lambda: done.append("a")), 0)[1]) == 0
    assert done == ["a"]

    def broken(c):
        c.add("b", lambda: done.append("b"))
        raise RuntimeError("setup failed")

    with pytest.raises(RuntimeError):
        bench.guarded(broken)
    assert done == ["a", "b"]
    c = bench.Cleanup()
    c.add("x", lambda: done.append("x"))
    assert c.pending() == ["x"] and c.run() == [] and c.run() == [] and done[-1] == "x"  # each once


@pytest.mark.quick
def test_each_node_runs_one_ftrun_in_its_namespace_on_its_veth(tmp_path):
    link = bench.Link(("nsA", "nsB"), ("vA", "vB"), "tbf", False)
    cmd = bench.node_cmd(link, 1, 29601, ["--hook", "diloco", "--period", "20"], ["--steps", "100"], tmp_path / "r")
    assert cmd[:4] == ["ip", "netns", "exec", "nsB"]
    flat = " ".join(cmd)
    assert "--nnodes 2 --node-rank 1 --nproc 1 --master-addr 10.233.57.1 --master-port 29601" in flat
    assert "--hook diloco --period 20 " + str(bench.TRAIN) in flat and flat.endswith(f"--iface vB --out {tmp_path / 'r'}")
    assert bench.shape_args("vA", "100mbit", "20ms", True)[-5:] == ["netem", "delay", "20ms", "rate", "100mbit"]
    assert bench.shape_args("vA", "100mbit", "20ms", False)[5:8] == ["tbf", "rate", "100mbit"]


@pytest.mark.quick
def test_torchft_runs_its_lighthouse_and_one_group_per_namespace_and_is_not_run_without_its_venv(tmp_path):
    """The torchft row: its lighthouse on node 0's address, each replica group (one process of
    scripts/train_slow_link_torchft.py, the torchft venv's python) in its node's namespace on its
    veth, asking that lighthouse; without --torchft-python the row says it was not run."""
    link = bench.Link(("nsA", "nsB"), ("vA", "vB"), "tbf", False)
    py = str(tmp_path / "venv" / "bin" / "python")
    lh = bench.lighthouse_cmd(link, py)
    assert lh[:5] == ["ip", "netns", "exec", "nsA", str(tmp_path / "venv" / "bin" / "torchft_lighthouse")]
    assert " ".join(lh).endswith(f"--min_replicas 2 --join_timeout_ms 60000 --bind 10.233.57.1:{bench.LIGHTHOUSE_PORT}")
    flags = bench.CONFIG_FLAGS["torchft-diloco20"]
    cmd = bench.torchft_cmd(link, 1, 29601, flags, ["--steps", "100"], tmp_path / "r", py)
    assert cmd[:6] == ["ip", "netns", "exec", "nsB", py, str(bench.TRAIN_TORCHFT)]
    flat = " ".join(cmd)
    assert (f"--group 1 --addr 10.233.57.2 --store-port 29601 --lighthouse http://10.233.57.1:{bench.LIGHTHOUSE_PORT} "
            f"--sync-every 20 --steps 100 --iface vB --out {tmp_path / 'r'}") in flat
    args = bench.parse(["--only", "torchft-diloco20"])
    assert args.torchft_python is None
    r = bench.run_once(link, flags, args, 29601, tmp_path, bench.Cleanup())
    assert r == {"error": "not run: give --torchft-python (a venv's python with torchft 0.2)"}
    text = bench.table({"torchft-diloco20": bench.summarize([r])}, {"shaping": "tbf", "steps": 100, "warmup": 10,
                                                                    "batch": 64, "runs": 1, "load": "0 0 0"})
    assert "| torchft 0.2 `DiLoCo`, sync every 20 (no ftrun) | not run: give --torchft-python" in text


def _row(mb, sps, loss):
    return {"mb_per_step": mb, "steps_per_s": sps, "heldout_loss": loss, "chance_loss": math.log(64),
            "params": 2_164_800}


@pytest.mark.quick
def test_medians_and_the_table(tmp_path):
    s = bench.summarize([_row(9.0, 0.8, 3.5), {"error": "node 1 exit 1: x"}, _row(9.2, 1.0, 3.4), _row(9.4, 0.9, 3.6)])
    assert (s["mb_per_step"], s["steps_per_s"], s["heldout_loss"], s["runs"], s["failed"]) == (9.2, 0.9, 3.5, 3, 1)
    assert bench.summarize([{"error": "no end within 600 s"}]) == {"error": "no end within 600 s"}
    rows = {"diloco100": bench.summarize([_row(0.1, 6.3, 3.6)]), "ddp": bench.summarize([_row(9.35, 0.9, 3.47)]),
            "localsgd20": {"error": "node 0 exit 1: boom"}}
    text = bench.table(rows, {"shaping": "tbf rate 100mbit on both ends", "steps": 100, "warmup": 10, "batch": 64,
                              "runs": 1, "load": "1.00 1.00 1.00"})
    lines = text.splitlines()
    assert "tbf rate 100mbit on both ends" in lines[0] and "2.16M-parameter" in lines[0] and "(chance: 4.159)" in lines[0]
    assert lines[2] == "| configuration | MB/step | steps/s | x DDP | held-out loss |"
    # CONFIGS' order, not the order the rows came in
    assert lines[4] == "| plain DDP (no hook) | 9.35 | 0.90 | 1.00x | 3.4700 |"
    assert lines[5] == "| `--hook localsgd --period 20` | failed: node 0 exit 1: boom | | | |"
    assert lines[6] == "| `--hook diloco --period 100` | 0.10 | 6.30 | 7.00x | 3.6000 |"


def test_the_training_script_on_one_node_over_loopback(ftrun_home, tmp_path):
    """Two ranks of scripts/train_slow_link.py through the real CLI: one JSON each, the DDP replicas'
    held-out losses equal and below chance, bytes read from the interface's counter. Not in the quick
    tier: about 10 s on a loaded 2-core machine, most of it two torch imports."""
    out = tmp_path / "r"
    proc = run_ftrun(["--nproc", "2", "--quiet", SCRIPTS / "train_slow_link.py", "--steps", "8", "--warmup", "2",
                      "--dim", "32", "--hidden", "64", "--classes", "8", "--heldout", "256", "--lr", "1e-2",
                      "--iface", "lo", "--out", out], timeout=120)
    assert proc.returncode == 0, proc.stderr
    ranks = [json.loads((tmp_path / f"r.rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["world"] == 2 for r in ranks)
    assert ranks[0]["heldout_loss"] == ranks[1]["heldout_loss"] < ranks[0]["chance_loss"] == math.log(8)
    assert all(r["timed_steps"] == 6 and r["steps_per_s"] > 0 for r in ranks)
    assert all(r["tx_bytes_per_step"] > 0 and r["iface"] == "lo" for r in ranks)
