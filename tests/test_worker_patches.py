"""The worker's global torch patches go through one registry (ftrun/worker/patches.py), and
the worker reads its environment once (ftrun/worker/settings.py)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from conftest import ROOT

WORKER = ROOT / "ftrun" / "worker"
# A module-level attribute of torch's set by assignment: `torch.save = ...`, `dist.x = ...`,
# `DDP.__init__ = ...`, `setattr(dcp, ...)`.
DIRECT_PATCH = re.compile(r"^\s*(torch|dist|dcp|DDP|TorchDDP)(\.\w+)+\s*=[^=]|setattr\(\s*(torch|dist|dcp|DDP)\b",
                          re.MULTILINE)
# Modules that read os.environ themselves: the settings, the zygote (not a worker yet: it sets
# the worker's environment), and the --ft member's modules (the store's moves still rewrite
# FTRUN_STORE when the store moves, and the others read it and the member's tuning knobs at use),
# and the Trainer's part (the environment Accelerate sees while it sets up a run of one, less the
# distributed run's variables), and Accelerate's (the environment variables that choose
# DeepSpeed, FSDP or a precision Accelerate itself reads).
READS_ENV = {"frameworks/hf.py", "frameworks/accelerate.py", "settings.py", "zygote.py", "ft/manager.py", "ft/member/vote.py", "ft/member/torch_effects.py", "ft/member/member_io.py"}


def _sources():
    for path in sorted(WORKER.rglob("*.py")):
        yield path.relative_to(WORKER).as_posix(), path.read_text()


@pytest.mark.quick
def test_every_torch_patch_goes_through_the_registry():
    direct = [f"{name}: {m.group(0).strip()}" for name, text in _sources() if name != "patches.py"
              for m in DIRECT_PATCH.finditer(text)]
    assert direct == [], "patch torch through ftrun.worker.patches.install():\n" + "\n".join(direct)
    from ftrun.worker import patches

    uses = {m.group(1) for _, text in _sources() for m in re.finditer(r'patches\.install\("([^"]+)"', text)}
    assert uses == set(patches.PATCHES), "every listed patch is installed somewhere, and only those"


@pytest.mark.quick
def test_undo_gives_torch_its_own_functions_back():
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ftrun.hookspec import HookSpec
    from ftrun.worker import inject, patches
    from ftrun.worker.ft.api import world

    init, destroy, ddp_init = dist.init_process_group, dist.destroy_process_group, DDP.__init__
    try:
        world.install()
        inject.install(HookSpec("allreduce"))
        assert {"process_group", "ddp.hook"} <= set(patches.installed())
        assert dist.init_process_group is not init and DDP.__init__ is not ddp_init
        assert world.torch_init_process_group() is init
    finally:
        patches.undo("process_group")
        inject.uninstall()
    assert (dist.init_process_group, dist.destroy_process_group, DDP.__init__) == (init, destroy, ddp_init)
    assert not {"process_group", "ddp.hook"} & set(patches.installed())
    with pytest.raises(KeyError):
        patches.install("torch.compile", dist, "init_process_group", init)  # not on the list


@pytest.mark.quick
def test_the_worker_side_reads_the_environment_in_one_place():
    readers = sorted(name for name, text in _sources()
                     if re.search(r"os\.environ|os\.getenv", text) and name not in READS_ENV)
    assert readers == [], f"read the environment through ftrun.worker.settings: {readers}"


@pytest.mark.quick
def test_only_the_zygote_writes_the_environment():
    """The environment is the worker's input, as under torchrun: the zygote sets it at the fork,
    and nothing else in ftrun writes it (a moved store is told through settings.store_moved)."""
    writes = re.compile(r"os\.environ\[[^]]+\]\s*=(?!=)|os\.environ\.(update|setdefault|pop|clear)\(|os\.putenv|del os\.environ")
    writers = sorted(name for name, text in _sources() if writes.search(text) and name != "zygote.py")
    assert writers == [], f"write the environment: {writers}"


@pytest.mark.quick
def test_settings_parse_as_the_readers_did():
    from ftrun.worker.settings import Settings

    s = Settings.from_env({"RANK": "3", "TORCHELASTIC_RESTART_COUNT": "2", "FTRUN_FT": "1",
                           "FTRUN_FT_TIMEOUT": "nan", "FTRUN_HOOK_LOG_EVERY": "",
                           "FTRUN_CHECKPOINT_EVERY": "not read without a checkpoint dir"})
    assert (s.rank, s.rank_text, s.restart_count, s.ft, s.ft_timeout_s, s.hook_log_every, s.checkpoint) == \
        (3, "3", 2, True, 10.0, 0, None)
    empty = Settings.from_env({})
    assert (empty.rank_text, empty.local_rank, empty.replica_size, empty.ft_timeout_s, empty.hook_log_every) == \
        ("?", 0, 1, 10.0, 100)
    ck = Settings.from_env({"FTRUN_CHECKPOINT_DIR": "/x", "FTRUN_CHECKPOINT_EVERY": "0"}).checkpoint
    assert (str(ck.root), ck.every, ck.keep) == ("/x", 1, 2)


@pytest.mark.quick
def test_a_worker_reads_its_environment_once():
    """After the bootstrap's load(), a change to os.environ changes nothing; the run's store
    is where it started until the worker follows it elsewhere (store_moved)."""
    code = ("import os; from ftrun.worker import settings\n"
            "os.environ['FTRUN_HOOK_LOG_EVERY'] = '7'; os.environ['FTRUN_STORE'] = 'a:1'\n"
            "settings.load()\n"
            "os.environ['FTRUN_HOOK_LOG_EVERY'] = '9'; os.environ['FTRUN_STORE'] = 'b:2'\n"
            "print(settings.current().hook_log_every, settings.current().store, settings.run_store())\n"
            "settings.store_moved('c:3')\n"
            "print(settings.run_store(), os.environ['FTRUN_STORE'])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["7", "a:1", "a:1", "c:3", "b:2"]
