"""Bad input: one line naming the problem and the fix, exit 2, nothing started; no torch on the CLI path."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, SCRIPTS, run_ftrun
from helpers import assert_bad

TRAIN = SCRIPTS / "train_ddp.py"


@pytest.mark.parametrize("args,needles", [
    (["missing_script.py"], ["missing_script.py", "not found"]),
    (["--nproc", "0", str(TRAIN)], ["--nproc", "at least 1"]),
    (["--nproc", "-3", str(TRAIN)], ["--nproc"]),
    (["--nproc", "four", str(TRAIN)], ["--nproc", "whole number"]),
    (["--frobnicate", str(TRAIN)], ["No such option: --frobnicate"]),
    (["--shutdown-timeout", "-1", str(TRAIN)], ["--shutdown-timeout", ">= 0"]),
    (["--step-timeout", "-5", str(TRAIN)], ["--step-timeout", ">= 0"]),
    (["-m", "no_such_module_xyz"], ["no_such_module_xyz", "no module"]),
    (["--max-restarts", "-1", str(TRAIN)], ["--max-restarts"]),
    (["--ranks", "0,9", "--nproc", "2", str(TRAIN)], ["--ranks", "0..1"]),
    (["--nproc", "2"], ["no training script"]),
])
@pytest.mark.quick
def test_bad_input_exits_2_with_one_line(ftrun_home, args, needles):
    proc = run_ftrun(args, timeout=30)
    assert_bad(proc, *needles)
    assert not ftrun_home.exists() or not any(ftrun_home.iterdir()), "a run was started"


def test_port_in_use(ftrun_home):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        proc = run_ftrun(["--master-port", port, TRAIN], timeout=30)
    assert_bad(proc, f"--master-port {port}", "in use")


@pytest.mark.quick
def test_help_and_version_do_not_import_torch():
    code = ("import sys\nfrom ftrun.cli import main\n"
            "for argv in (['--help'], ['run', '--help'], ['--version'], ['status'], ['recipes']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "--nproc" in proc.stdout and "--max-restarts" in proc.stdout


def test_python_dash_m_ftrun_works():
    proc = subprocess.run([sys.executable, "-m", "ftrun", "--version"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0 and proc.stdout.startswith("ftrun ")


@pytest.mark.parametrize("args,env,needles", [
    (["--rdzv-backend", "etcd", str(TRAIN)], {}, ["etcd", "--rdzv-backend c10d"]),
    (["--rdzv_backend=etcd-v2", str(TRAIN)], {}, ["etcd-v2", "c10d"]),
    (["--nnodes", "3:2", str(TRAIN)], {}, ["--nnodes", "MIN <= MAX"]),
    (["--nnodes", "1:2", str(TRAIN)], {}, ["--nnodes 1:2", "c10d"]),
    (["--tee", "5", str(TRAIN)], {}, ["--tee", "0:3,1:1"]),
    (["--rdzv-backend", "c10d", str(TRAIN)], {}, ["--rdzv-endpoint"]),
    (["--standalone", "--nnodes", "2", str(TRAIN)], {}, ["--standalone", "one node"]),
    (["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", str(TRAIN)], {},
     ["localhost:0", "one node"]),
    (["--nproc-per-node", "gpu", str(TRAIN)], {"CUDA_VISIBLE_DEVICES": ""}, ["gpu", "no GPU"]),
    ([str(TRAIN)], {"PET_NPROC_PER_NODE": "abc"}, ["PET_NPROC_PER_NODE='abc'", "unset"]),
    ([str(TRAIN)], {"PET_STANDALONE": "yes"}, ["PET_STANDALONE", "0 or 1"]),
    (["--signals-to-handle", "SIGNOPE", str(TRAIN)], {}, ["--signals-to-handle", "SIGNOPE"]),
    (["--local-ranks-filter", "0,4", "--nproc", "2", str(TRAIN)], {}, ["--local-ranks-filter 4", "0..1"]),
])
def test_bad_torchrun_input_exits_2_with_one_line(ftrun_home, args, env, needles):
    proc = run_ftrun(args, timeout=30, env=env)
    assert_bad(proc, *needles)
    assert not ftrun_home.exists() or not any(ftrun_home.iterdir()), "a run was started"


def test_module_is_found_from_the_working_directory(ftrun_home, tmp_path):
    """`-m` looks where python -m looks: the working directory first; a package needs a __main__."""
    (tmp_path / "proj" / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "proj" / "pkg" / "__init__.py").write_text("raise SystemExit('a package __init__ ran in the launcher')\n")
    (tmp_path / "proj" / "pkg" / "sub" / "__init__.py").write_text("")
    (tmp_path / "proj" / "pkg" / "train.py").write_text("print('trained', flush=True)\n")
    ftrun_bin = [str(Path(sys.executable).parent / "ftrun")]
    run = lambda *a: subprocess.run(ftrun_bin + list(a), capture_output=True, text=True, timeout=60,  # noqa: E731
                                    cwd=tmp_path / "proj")
    assert_bad(run("-m", "pkg.sub"), "package without a __main__", "pkg.sub.train")
    assert_bad(run("-m", "pkg.nope"), "no module named 'pkg.nope'")
    assert_bad(run("-m", "pkg/train.py"), "not a module name")


def test_every_torchrun_option_is_accepted_with_its_pet_name():
    """The schema holds every option string of torch's own parser, and the PET_ name torchrun reads for it."""
    import argparse

    from torch.distributed.run import get_args_parser

    from ftrun.options import HOOK_OPTIONS, OPTIONS

    ours = {f: o for o in list(OPTIONS.values()) + list(HOOK_OPTIONS.values()) for f in o.flags}
    parser = get_args_parser()
    seen = 0
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        for s in action.option_strings:
            assert s in ours, f"torchrun's {s} is not an ftrun option"
        opt = ours[action.option_strings[0]]
        if type(action).__name__ in ("env", "check_env"):
            assert opt.pet == f"PET_{action.dest.upper()}", (s, opt.pet)
        seen += 1
    assert seen >= 30


def test_precedence_command_line_recipe_pet_slurm_default(tmp_path):
    """command line > recipe > PET_* > Slurm > defaults, key by key."""
    from ftrun.config import build_config

    slurm = {"SLURM_JOB_ID": "77", "SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_NTASKS": "2",
             "SLURM_JOB_NODELIST": "node[01-02]"}
    pet = {"PET_NNODES": "2", "PET_NODE_RANK": "0", "PET_MASTER_ADDR": "pet-host", "PET_MASTER_PORT": "29511",
           "PET_MAX_RESTARTS": "4", "PET_NPROC_PER_NODE": "3"}
    cfg = build_config({"script": "x.py"}, {}, None, check_paths=False, environ=slurm)
    assert (cfg.nnodes, cfg.node_rank, cfg.master_addr, cfg.max_restarts) == (2, 1, "node01", 0)
    cfg = build_config({"script": "x.py"}, {}, None, check_paths=False, environ={**slurm, **pet})
    assert (cfg.node_rank, cfg.master_addr, cfg.master_port, cfg.max_restarts, cfg.nproc) == (0, "pet-host", 29511, 4, 3)
    cfg = build_config({"script": "x.py"}, {"max_restarts": 1, "nproc": 2}, "r.yaml", check_paths=False,
                       environ={**slurm, **pet})
    assert (cfg.max_restarts, cfg.nproc, cfg.master_port) == (1, 2, 29511)
    cfg = build_config({"script": "x.py", "nproc": "1", "max_restarts": "5"}, {"max_restarts": 1}, "r.yaml",
                       check_paths=False, environ={**slurm, **pet})
    assert (cfg.max_restarts, cfg.nproc) == (5, 1)
    assert cfg.sources["max_restarts"] == "command line" and cfg.sources["master_port"] == "PET_MASTER_PORT"
    cfg = build_config({"script": "x.py"}, {}, None, check_paths=False, environ={})
    assert (cfg.nnodes, cfg.max_restarts, cfg.nproc, cfg.rdzv) == (1, 0, 1, "local")


def test_a_hook_from_pet_variables_under_the_recipes_and_the_command_lines():
    """PET_HOOK and each hook parameter's PET_ name (a flag's 1) give a hook, under a recipe's
    `hook:` key by key and the command line's; another hook in a recipe or on the command line
    replaces the environment's whole; a bad value is one line naming the variable."""
    from ftrun.config import build_config
    from ftrun.errors import ConfigError

    pet = {"PET_HOOK": "diloco", "PET_PERIOD": "20", "PET_FRAGMENTS": "4", "PET_SYNC_DELAY": "2",
           "PET_WRAP": "int8"}
    cfg = build_config({"script": "x.py"}, {}, None, check_paths=False, environ=pet)
    assert (cfg.hook.name, dict(cfg.hook.params), cfg.hook.wrap) == (
        "diloco", {"period": 20, "fragments": 4, "sync_delay": 2}, "int8")
    assert cfg.sources["hook"] == "PET_HOOK" and cfg.sources["hook.period"] == "PET_PERIOD"
    cfg = build_config({"script": "x.py", "hook": {"sync_delay": 1}}, {"hook": {"name": "diloco", "period": 8}},
                       "r.yaml", check_paths=False, environ=pet)
    assert dict(cfg.hook.params) == {"period": 8, "fragments": 4, "sync_delay": 1}
    assert (cfg.sources["hook.period"], cfg.sources["hook.fragments"], cfg.sources["hook.sync_delay"]) == (
        "r.yaml", "PET_FRAGMENTS", "command line")
    cfg = build_config({"script": "x.py"}, {"hook": {"name": "powersgd", "rank": 2}}, "r.yaml", check_paths=False,
                       environ=pet)
    assert (cfg.hook.name, dict(cfg.hook.params), cfg.hook.wrap) == ("powersgd", {"rank": 2}, None)
    cfg = build_config({"script": "x.py", "hook": {"name": "fp16"}}, {}, None, check_paths=False, environ=pet)
    assert (cfg.hook.name, dict(cfg.hook.params)) == ("fp16", {})
    cfg = build_config({"script": "x.py"}, {}, None, check_paths=False,
                       environ={"PET_HOOK": "powersgd", "PET_START_ITER": "0", "PET_NO_ERROR_FEEDBACK": "1",
                                "PET_NO_WARM_START": "1", "PET_BATCH_SAME_SHAPE": "0"})
    assert dict(cfg.hook.params) == {"start_iter": 0, "error_feedback": False, "warm_start": False}
    with pytest.raises(ConfigError) as e:
        build_config({"script": "x.py"}, {}, None, check_paths=False, environ={"PET_HOOK": "diloco", "PET_PERIOD": "x"})
    assert str(e.value) == "environment: PET_PERIOD='x' must be a whole number, not 'x'; fix it or unset PET_PERIOD"
    with pytest.raises(ConfigError) as e:
        build_config({"script": "x.py"}, {}, None, check_paths=False, environ={"PET_PERIOD": "4"})
    assert "given without a hook" in str(e.value) and "\n" not in str(e.value)


def test_the_docs_torchrun_table_has_every_torchrun_option():
    """The site's torchrun table (generated at build time) is the schema's: one row per torchrun option."""
    from ftrun.options import OPTIONS_LIST

    sys.path.insert(0, str(ROOT / "scripts"))
    import docs_reference

    page = docs_reference.options_page()
    rows = docs_reference.torchrun_table()
    assert len(rows) == sum(1 for o in OPTIONS_LIST if o.torchrun) >= 30
    for spellings, pet, does in rows:
        assert f"| {spellings} | {pet} | {does} |" in page, spellings