"""`ftrun --dry-run`: the launch line resolved as a real run would, the plan printed, exit 0, nothing
started (no store, no zygote, no run folder, no torch import), through the real CLI."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from conftest import ROOT, run_ftrun


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("raise SystemExit('a dry run must never run the script')\n")
    return path


def _option(plan: str, flag: str):
    """(value, source) of one row of the plan's options table."""
    m = re.search(rf"^\s+{re.escape(flag)}\s+(.+?)\s{{2,}}(\S.*)$", plan, re.M)
    assert m, f"{flag} not in the plan:\n{plan}"
    return m.group(1).strip(), m.group(2).strip()


def _worker_rows(plan: str):
    """{local rank: (RANK, LOCAL_RANK)} from the plan's table of workers."""
    section = plan.split("Workers on this node", 1)[1].split("\n\n", 1)[0]
    return {int(m.group(1)): (int(m.group(2)), int(m.group(3)))
            for m in re.finditer(r"^\s+(\d+)\s+(\d+)\s+(\d+)\s", section, re.M)}


def _env(plan: str):
    section = plan.split("Environment of every worker", 1)[1].split("\n\n", 1)[0]
    return dict(m.groups() for m in re.finditer(r"^\s+([A-Z_][A-Z0-9_]*)=(.*?)(?:   \(.*)?$", section, re.M))


@pytest.mark.quick
def test_one_node_plan_starts_nothing(ftrun_home, script, tmp_path):
    t0 = time.monotonic()
    proc = run_ftrun(["--dry-run", "--nproc", "3", "--max-restarts", "2", script, "--lr", "0.1"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert time.monotonic() - t0 < 30
    plan = proc.stdout
    assert "nothing was started" in plan and proc.stderr == ""
    assert f"python {script} --lr 0.1" in plan
    assert _worker_rows(plan) == {0: (0, 0), 1: (1, 1), 2: (2, 2)}
    env = _env(plan)
    assert env["WORLD_SIZE"] == "3" and env["TORCHELASTIC_MAX_RESTARTS"] == "2" and env["FTRUN_FT"] == "0"
    assert env["MASTER_PORT"].startswith("<a free port")
    assert _option(plan, "--nproc") == ("3", "command line")
    assert _option(plan, "--shutdown-timeout") == ("5", "default")
    # Nothing written: no run folder, no state file; the script (which would exit 1) never ran.
    assert not ftrun_home.exists() or not any(ftrun_home.iterdir())
    # and `ftrun run --dry-run` is the same command
    again = run_ftrun(["run", "--dry-run", "--nproc", "3", script], cwd=tmp_path)
    assert again.returncode == 0 and "Workers on this node" in again.stdout


def test_dry_run_never_imports_torch(ftrun_home, script):
    code = ("import sys\nfrom ftrun.cli import main\ntry:\n    main(['--dry-run', '--nproc', '2', '--ft', "
            f"{str(script)!r}])\nexcept SystemExit as e:\n    print('exit', e.code, 'torch' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, FTRUN_HOME=str(ftrun_home)))
    assert proc.stdout.strip().splitlines()[-1] == "exit 0 False", proc.stdout + proc.stderr


@pytest.mark.quick
def test_sources_command_line_recipe_pet_and_your_own_variables(ftrun_home, script, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("max_restarts: 4\nshutdown_timeout: 9\nhook: {name: powersgd, rank: 2}\nenv:\n  MY_FLAG: 'on'\n")
    proc = run_ftrun(["--dry-run", "--recipe", recipe, "--shutdown-timeout", "7", "--start-iter", "10", script],
                     env={"PET_NPROC_PER_NODE": "2", "PET_MAX_RESTARTS": "9", "RANK": "5", "WORLD_SIZE": "99"},
                     cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    plan = proc.stdout
    assert _option(plan, "--nproc") == ("2", "PET_NPROC_PER_NODE")
    assert _option(plan, "--max-restarts") == ("4", str(recipe))        # the recipe wins over PET_
    assert _option(plan, "--shutdown-timeout") == ("7", "command line")  # the flag wins over the recipe
    assert _option(plan, "--rank") == ("2", str(recipe))
    assert _option(plan, "--start-iter") == ("10", "command line")
    assert "hook    powersgd rank=2 start_iter=10" in plan
    assert "MY_FLAG=on   (recipe env:)" in plan
    # A pod's own RANK and WORLD_SIZE describe the pod: each worker gets its own.
    assert "RANK" not in _env(plan) and _worker_rows(plan) == {0: (0, 0), 1: (1, 1)}
    assert "your RANK='5' never reach a worker" in plan
    assert "WORLD_SIZE=2   (replaces your '99')" in plan


@pytest.mark.quick
def test_static_node_of_several_never_connects_to_node_0(ftrun_home, script, tmp_path):
    """Node 1 of a static layout whose node 0 does not exist: the plan comes at once (a real run
    would wait for node 0), with this node's global ranks."""
    t0 = time.monotonic()
    proc = run_ftrun(["--dry-run", "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.255.255.1",
                      "--master-port", "29500", "--nproc", "2", "--ft", script], cwd=tmp_path, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert time.monotonic() - t0 < 20
    plan = proc.stdout
    assert _worker_rows(plan) == {0: (2, 0), 1: (3, 1)}
    env = _env(plan)
    assert (env["MASTER_ADDR"], env["MASTER_PORT"], env["WORLD_SIZE"], env["GROUP_RANK"]) == \
        ("10.255.255.1", "29500", "4", "1")
    assert env["FTRUN_NODE_RANKS"] == "1 2 2"  # --ft on a node that is not the store's: its own relay store
    assert "this node joins it there" in plan


@pytest.mark.quick
def test_elastic_c10d_line_plans_without_a_rendezvous(ftrun_home, script, tmp_path):
    t0 = time.monotonic()
    proc = run_ftrun(["--dry-run", "--nnodes", "2:4", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                      "--rdzv-endpoint", "10.255.255.1:29400", "--rdzv-id", "job7", script], cwd=tmp_path,
                     timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert time.monotonic() - t0 < 20
    plan = proc.stdout
    assert "node ranks are assigned at join" in plan and "if it joins" in plan
    assert _option(plan, "--nnodes") == ("2:4", "command line")
    assert _option(plan, "--run-id") == ("job7", "command line")
    assert _env(plan)["MASTER_ADDR"].startswith("<the FQDN of the node hosting")


def test_slurm_layout_and_its_source(ftrun_home, script, tmp_path):
    slurm = {"SLURM_JOB_ID": "77", "SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_NTASKS": "2",
             "SLURM_JOB_NODELIST": "127.0.0.[1-2]", "SLURM_STEP_ID": "0"}
    proc = run_ftrun(["--dry-run", "--nproc", "2", script], env=slurm, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    plan = proc.stdout
    assert _option(plan, "--node-rank") == ("1", "Slurm (SLURM_* variables)")
    assert _option(plan, "--master-addr") == ("127.0.0.1", "Slurm (SLURM_* variables)")
    assert _worker_rows(plan) == {0: (2, 0), 1: (3, 1)}
    assert "slurm-77.0" in plan


@pytest.mark.parametrize("args,env,needle", [
    pytest.param(["--dry-run", "--nproc", "0", "train.py"], {}, "--nproc must be at least 1", marks=pytest.mark.quick),
    (["--dry-run", "--nproc", "2", "missing.py"], {}, "not found"),
    (["--dry-run", "train.py"], {"PET_NPROC_PER_NODE": "eight"}, "PET_NPROC_PER_NODE"),
    (["--dry-run", "--nnodes", "2", "train.py"], {}, "needs --master-port"),
    (["--dry-run", "--min-replicas", "2", "train.py"], {}, "applies only to --ft"),
])
def test_bad_input_is_still_one_line_and_exit_2(ftrun_home, script, tmp_path, args, env, needle):
    proc = run_ftrun(args, env=env, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("ftrun: error:") and needle in lines[0], proc.stderr
    assert proc.stdout == ""


def test_a_recipe_cannot_ask_for_a_dry_run(ftrun_home, script, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("dry_run: true\n")
    proc = run_ftrun(["--recipe", recipe, "--dry-run", script], cwd=tmp_path)
    assert proc.returncode == 2 and "dry_run" in proc.stderr, proc.stderr
    assert (ROOT / "ftrun" / "plan.py").is_file()


def test_a_plan_nobody_reads_is_no_traceback(ftrun_home, script, tmp_path):
    """A reader that stops early (`| head -1`) ends the dry run quietly; no standard output, or a full
    one (/dev/full), is one line and exit 1."""
    from conftest import FTRUN

    argv = FTRUN + ["--dry-run", "--nproc", "16", script]
    env = dict(os.environ, FTRUN_HOME=str(ftrun_home))
    reader = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=tmp_path)
    reader.stdout.close()  # gone before the plan is written
    assert reader.wait(timeout=60) == 0 and reader.stderr.read() == b""
    closed = subprocess.run(argv, stderr=subprocess.PIPE, env=env, cwd=tmp_path, text=True, timeout=60,
                            preexec_fn=lambda: os.close(1))
    assert closed.returncode == 1 and closed.stderr.count("\n") == 1, closed.stderr
    assert "cannot print the plan" in closed.stderr and "Traceback" not in closed.stderr
    with open("/dev/full", "w") as full:
        proc = subprocess.run(argv, stdout=full, stderr=subprocess.PIPE, env=env, cwd=tmp_path, text=True, timeout=60)
    assert proc.returncode == 1 and "No space left on device" in proc.stderr and "Traceback" not in proc.stderr
