"""Every worker sees the same torchrun variables under ftrun as under torchrun itself."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

from conftest import FTRUN, ROOT

CONTRACT = ("RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE GROUP_RANK GROUP_WORLD_SIZE ROLE_RANK ROLE_NAME "
            "ROLE_WORLD_SIZE MASTER_ADDR MASTER_PORT TORCHELASTIC_RESTART_COUNT TORCHELASTIC_MAX_RESTARTS "
            "TORCHELASTIC_RUN_ID TORCHELASTIC_USE_AGENT_STORE OMP_NUM_THREADS").split()

DUMP = """
import json, os, sys
keys = {keys!r}
extra = ["FTRUN_RUN_ID", "FTRUN_HOOK", "FTRUN_STORE", "FTRUN_REPLICA_ID", "FTRUN_FT"]
with open(os.path.join(sys.argv[1], "env." + os.environ["RANK"] + ".json"), "w") as f:
    json.dump({{k: os.environ.get(k) for k in keys + extra}}, f)
"""


def _collect(d, n):
    return [json.loads((d / f"env.{r}.json").read_text()) for r in range(n)]


def test_env_matches_torchrun(ftrun_home, tmp_path):
    """The same plain one-node line under both, nothing forced on either side."""
    script = tmp_path / "dump_env.py"
    script.write_text(DUMP.format(keys=CONTRACT))
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS" and not k.startswith("PET_")}
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or "torchrun"
    (tmp_path / "t").mkdir()
    (tmp_path / "f").mkdir()
    t = subprocess.run([torchrun, "--nproc-per-node", "3", "--max-restarts", "2", str(script), str(tmp_path / "t")],
                       capture_output=True, text=True, env=env, timeout=120)
    assert t.returncode == 0, t.stderr
    f = subprocess.run(FTRUN + ["--nproc-per-node", "3", "--max-restarts", "2", str(script), str(tmp_path / "f")],
                       capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
    assert f.returncode == 0, f.stderr
    theirs, ours = _collect(tmp_path / "t", 3), _collect(tmp_path / "f", 3)
    uuid = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
    for r in range(3):
        for k in CONTRACT:
            if k == "MASTER_PORT":  # a free port on both sides
                assert ours[r][k].isdigit() and theirs[r][k].isdigit()
            elif k == "TORCHELASTIC_RUN_ID":  # a fresh uuid on both sides
                assert uuid.fullmatch(ours[r][k]) and uuid.fullmatch(theirs[r][k]), (ours[r][k], theirs[r][k])
            else:
                assert ours[r][k] == theirs[r][k], (r, k, ours[r][k], theirs[r][k])
        assert ours[r]["FTRUN_RUN_ID"].startswith("ftrun-")
        assert ours[r]["FTRUN_REPLICA_ID"] == str(r)
        assert ours[r]["FTRUN_FT"] == "0"
        assert ours[r]["FTRUN_STORE"] == f"{ours[r]['MASTER_ADDR']}:{ours[r]['MASTER_PORT']}"
    assert len({o["MASTER_PORT"] for o in ours}) == 1 and len({o["TORCHELASTIC_RUN_ID"] for o in ours}) == 1
