"""Recipes: bundled ones are valid and documented, CLI flags override them key by key,
and every kind of bad recipe is one line naming file, line and key, exit 2, nothing started."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import run_ftrun

from ftrun.config import OPTIONS, build_config
from ftrun.errors import ConfigError
from ftrun.hookspec import parse_hook
from ftrun.recipe import RECIPES_DIR, bundled_recipes, find_recipe, load_recipe, validate_recipe

REPO = Path(__file__).resolve().parent.parent
EXPECTED_BUNDLED = {"ddp", "fp16", "bf16", "powersgd", "powersgd-r4-fp16", "localsgd", "ft"}


def ftrun(*args: str, cwd: Path = REPO, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return run_ftrun(args, timeout=timeout, env=env, cwd=cwd)


# ---------------------------------------------------------------------------
# Bundled recipes


@pytest.mark.quick
def test_bundled_recipes_exist_and_validate():
    names = {p.stem for p in bundled_recipes()}
    assert EXPECTED_BUNDLED <= names
    for p in bundled_recipes():
        recipe, cfg = validate_recipe(str(p))
        assert isinstance(recipe.data.get("description"), str) and "\n" not in recipe.data["description"].strip()


def test_bundled_recipes_comment_every_key():
    """Each option (and each hook parameter) has a comment line right above it."""
    for p in bundled_recipes():
        lines = p.read_text().splitlines()
        for i, line in enumerate(lines):
            m = re.match(r"^(\s*)([A-Za-z_][\w-]*):", line)
            if not m or m.group(2) == "description":
                continue
            assert i > 0 and lines[i - 1].strip().startswith("#"), f"{p.name}:{i + 1}: {m.group(2)} has no comment"


def test_recipes_list_and_print():
    r = ftrun("recipes")
    assert r.returncode == 0, r.stderr
    for p in bundled_recipes():
        desc = yaml.safe_load(p.read_text())["description"]
        assert any(line.split()[:1] == [p.stem] and desc in line for line in r.stdout.splitlines()), (p.stem, r.stdout)
    r = ftrun("recipes", "powersgd")
    assert r.returncode == 0 and r.stdout == (RECIPES_DIR / "powersgd.yaml").read_text()
    r = ftrun("recipes", "powersdg")
    assert r.returncode == 2 and "did you mean 'powersgd'" in r.stderr and len(r.stderr.splitlines()) == 1


def test_recipe_found_by_bundled_name():
    assert find_recipe("powersgd") == RECIPES_DIR / "powersgd.yaml"
    assert find_recipe("powersgd.yaml") == RECIPES_DIR / "powersgd.yaml"
    data, name = load_recipe("powersgd-r4-fp16")
    assert data["hook"]["rank"] == 4 and data["hook"]["wrap"] == "fp16" and name.endswith("powersgd-r4-fp16.yaml")


# ---------------------------------------------------------------------------
# Round trip: recipe + CLI override


def _write(tmp_path: Path, text: str, name: str = "r.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


RECIPE = """\
description: test recipe
nproc: 3
max_restarts: 2
hook:
  name: powersgd
  rank: 4
  start_iter: 10
  wrap: fp16
env:
  FOO: bar
  LEVEL: 3
script: train.py
args: [--epochs, 3]
"""


@pytest.mark.quick
def test_round_trip_cli_overrides_key_by_key(tmp_path):
    data, name = load_recipe(str(_write(tmp_path, RECIPE)))
    cfg = build_config({"script": "train.py", "args": [], "nproc": "2", "hook": {"rank": 1},
                        "env": {"FOO": "cli"}}, data, name, check_paths=False)
    assert cfg.nproc == 2                       # CLI wins
    assert cfg.max_restarts == 2                # recipe fills the rest
    assert cfg.hook.name == "powersgd" and cfg.hook.wrap == "fp16"
    assert dict(cfg.hook.params)["rank"] == 1 and dict(cfg.hook.params)["start_iter"] == 10
    assert cfg.env == {"FOO": "cli", "LEVEL": "3"}
    assert cfg.script_args == ("--epochs", "3")  # same script, no CLI args: the recipe's args
    assert cfg.recipe == name


def test_round_trip_other_hook_and_script(tmp_path):
    data, name = load_recipe(str(_write(tmp_path, RECIPE)))
    cfg = build_config({"script": "other.py", "hook": {"name": "fp16"}}, data, name, check_paths=False)
    assert cfg.hook.name == "fp16" and cfg.hook.wrap is None and not cfg.hook.params  # whole hook replaced
    assert cfg.script == "other.py" and cfg.script_args == ()  # the recipe's args belong to its script
    cfg = build_config({}, data, name, check_paths=False)
    assert cfg.script == "train.py" and cfg.script_args == ("--epochs", "3")
    cfg = build_config({"script": "train.py", "args": ["--epochs", "9"]}, data, name, check_paths=False)
    assert cfg.script_args == ("--epochs", "9")


def test_torchrun_keys_in_a_recipe(tmp_path):
    data, name = load_recipe(str(_write(tmp_path, "nnodes: 2:4\nrdzv_backend: c10d\nrdzv_endpoint: node0:29400\n"
                                                  "rdzv_conf: {last_call_timeout: 5}\ntee: 3\nrole: trainer\n")))
    cfg = build_config({"script": "x.py"}, data, name, check_paths=False, environ={})
    assert (cfg.min_nodes, cfg.max_nodes, cfg.rdzv, cfg.master_port) == (2, 4, "c10d", 29400)
    assert cfg.last_call_timeout == 5 and cfg.tee == {-1: 3} and cfg.role == "trainer"


def test_hook_shorthand_and_null_means_default(tmp_path):
    data, name = load_recipe(str(_write(tmp_path, "hook: bf16\nstep_timeout:\nnproc: auto\n")))
    cfg = build_config({"script": "x.py"}, data, name, check_paths=False)
    assert cfg.hook.name == "bf16" and cfg.step_timeout is None and cfg.nproc >= 1


# ---------------------------------------------------------------------------
# Bad recipes: one line, file + line + key, exit 2, nothing started

BAD = {
    # case: (recipe text, expected line, text the one line must contain)
    "invalid_yaml": ("nproc: 2\nhook: {name: powersgd,\n  rank: 1\n", 3, "invalid YAML near key 'hook'"),
    "tab_indent": ("nproc: 2\n\tmax_restarts: 1\n", 2, "invalid YAML"),
    "unknown_key": ("nproc: 2\nmax_restart: 3\n", 2, "max_restart: unknown key (did you mean 'max_restarts'?)"),
    "dashed_key": ("step-timeout: 30\n", 1, "did you mean 'step_timeout'?"),
    "wrong_type": ("nproc: 2\nmax_restarts: three\n", 2, "max_restarts: must be a whole number"),
    "wrong_type_bool": ("ft: 1\n", 1, "ft: must be true or false"),
    "wrong_type_float": ("step_timeout: [1]\n", 1, "step_timeout: must be a number"),
    "out_of_range": ("nproc: 2\nmin_replicas: 0\n", 2, "min_replicas: must be >= 1, not 0"),
    "nproc_zero": ("description: x\nnproc: 0\n", 2, "nproc: must be at least 1"),
    "negative_timeout": ("shutdown_timeout: -1\n", 1, "shutdown_timeout: must be >= 0"),
    "port_range": ("master_port: 70000\n", 1, "master_port: must be a port number"),
    "not_mapping": ("- nproc: 2\n- ft: true\n", 1, "must be a mapping"),
    "scalar": ("just text\n", 1, "must be a mapping"),
    "empty": ("", 1, "empty recipe"),
    "only_comments": ("# nothing here\n\n", 1, "empty recipe"),
    "duplicate": ("nproc: 2\nft: true\nnproc: 4\n", 3, "nproc: duplicate key (first set on line 1)"),
    "hook_name": ("nproc: 2\nhook:\n  name: powersgdd\n  rank: 1\n", 3, "hook.name: "),
    "hook_no_name": ("hook:\n  rank: 1\n", 1, "hook: needs a 'name:'"),
    # hookspec words these; only the placement (line, key) and the value are this file's business
    "hook_wrap": ("hook:\n  name: powersgd\n  rank: 1\n  wrap: fp8\n", 4, "hook.wrap: "),
    "hook_param": ("hook:\n  name: localsgd\n  period: 4\n  rank: 2\n", 4, "hook.rank: "),
    "hook_unknown_param": ("hook:\n  name: powersgd\n  rnk: 2\n", 3, "hook.rnk: "),
    "hook_type": ("hook: [powersgd]\n", 1, "hook: must be a hook name or a mapping"),
    "env_bool": ("env:\n  A: \"x\"\n  DEBUG: yes\n", 3, "env.DEBUG: is True as YAML reads it; quote it"),
    "env_name": ("env:\n  1BAD: x\n", 2, "env.1BAD: not a valid environment variable name"),
    "env_type": ("env: [A=1]\n", 1, "env: must be a mapping"),
    "args_type": ("args: --epochs 3\n", 1, "args: must be a list"),
    "cross_key": ("nnodes: 2\nnode_rank: 2\n", 2, "node_rank: --node-rank 2 is out of range"),
    # YAML 1.1 would read 2:4 as the number 124; it stays MIN:MAX, and static needs c10d for it
    "elastic_static": ("nproc: 2\nnnodes: 2:4\n", 2, "nnodes: --nnodes 2:4 is elastic"),
    "etcd": ("rdzv_backend: etcd\n", 1, "rdzv_backend: etcd is not supported"),
    "tee": ("tee: 0:3,1:9\n", 1, "tee: takes 0-3"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_recipe_in_process(tmp_path, case):
    text, line, expected = BAD[case]
    p = _write(tmp_path, text)
    with pytest.raises(ConfigError) as ei:
        validate_recipe(str(p))
    msg = str(ei.value)
    assert "\n" not in msg
    assert msg.startswith(f"{p}:{line}: "), msg
    assert expected in msg, msg


def test_bad_hook_parameter_is_placed_on_its_line(tmp_path):
    """Hook parameters are hookspec's to check; when it rejects one, the line is the parameter's."""
    with pytest.raises(ConfigError):
        parse_hook({"name": "powersgd", "rank": 0})
    p = _write(tmp_path, "nproc: 2\nhook:\n  name: powersgd\n  start_iter: 5\n  rank: 0\n")
    with pytest.raises(ConfigError) as ei:
        validate_recipe(str(p))
    assert str(ei.value).startswith(f"{p}:5: hook.rank: "), str(ei.value)


def test_missing_recipe_file(tmp_path):
    with pytest.raises(ConfigError) as ei:
        load_recipe(str(tmp_path / "nope.yaml"))
    assert "nope.yaml" in str(ei.value) and "not found" in str(ei.value)
    with pytest.raises(ConfigError, match="is a folder"):
        load_recipe(str(tmp_path))


@pytest.mark.quick
def test_bad_recipes_through_the_cli(tmp_path):
    """`ftrun validate` and `ftrun --recipe` both: exit 2, one stderr line, nothing started.

    Every case is checked in-process above; here each path of the real CLI gets a few (kept
    few because each ftrun start costs ~0.5 s on this machine).
    """
    marker = tmp_path / "started"
    script = _write(tmp_path, f"open({str(marker)!r}, 'w').write('ran')\n", "script.py")
    path = {name: _write(tmp_path, BAD[name][0], f"{name}.yaml") for name in BAD}
    path["missing"] = tmp_path / "missing.yaml"
    runs = [["validate", str(path[n])] for n in ("invalid_yaml", "unknown_key", "empty", "missing")]
    runs += [["--recipe", str(path[n]), str(script)] for n in ("wrong_type", "nproc_zero", "not_mapping", "hook_name")]
    for argv in runs:
        r = ftrun(*argv, cwd=tmp_path)
        assert r.returncode == 2, (argv, r.stdout, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and Path(argv[1]).name in lines[0], (argv, r.stderr)
        assert not marker.exists(), argv
    good = _write(tmp_path, "nproc: 2\nhook: fp16\n", "good.yaml")
    r = ftrun("validate", str(good), cwd=tmp_path)
    assert r.returncode == 0 and "ok" in r.stdout and not marker.exists()


def test_validate_never_imports_torch(tmp_path):
    code = ("import sys; from ftrun.recipe import validate_main, recipes_main; "
            f"validate_main({str(RECIPES_DIR / 'powersgd.yaml')!r}); recipes_main(None); "
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')))")
    r = subprocess.run([sys.executable, "-c", "import json; " + code], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1]) == []


def test_every_option_is_a_recipe_key():
    """The recipe checker knows every key of the schema, and each option's own default passes its check."""
    from ftrun.recipe import Recipe, _check_value

    samples = {"hook": {"name": "fp16"}, "env": {"A": "1"}, "args": ["a"], "script": "x.py", "description": "x",
               "nnodes": "1:2", "rdzv_endpoint": "node0:29400", "rdzv_conf": "join_timeout=5,is_host=1",
               "signals_to_handle": "SIGTERM,SIGUSR1", "redirects": "0:3,1:1", "tee": 3, "run_id": "r1",
               "log_dir": "logs", "local_addr": "n1", "logs_specs": "x", "numa_binding": "node",
               "duplicate_stdout_filters": "a,b", "duplicate_stderr_filters": "a", "ranks": "0",
               "local_ranks_filter": "0,1", "step_timeout": 5, "max_restarts": 1, "master_port": 29500,
               "checkpoint_dir": "ck", "metrics_port": 9400}
    for key, opt in OPTIONS.items():
        value = samples.get(key, opt.default)
        assert value is not None, f"no sample for {key}"
        if isinstance(value, tuple):
            value = ",".join(map(str, value))
        _check_value(Recipe(Path("t.yaml"), {key: value}, {key: 1}), key, value)


# ---------------------------------------------------------------------------
# End to end: the workers really get the merged env and hook (needs the supervisor)


DUMP_ENV = """\
import json, os, sys
with open(f"{sys.argv[1]}.{os.environ['RANK']}.json", "w") as f:
    json.dump({"env": dict(os.environ), "argv": sys.argv[1:]}, f)
"""


HOOK_YAML = """\
hook:
  name: powersgd
  rank: 4
  start_iter: 7
  wrap: fp16
"""


@pytest.mark.parametrize("with_hook", [False, True], ids=["env", "env+hook"])
def test_recipe_and_cli_override_reach_the_workers(tmp_path, with_hook):
    script = _write(tmp_path, DUMP_ENV, "dump_env.py")
    out = tmp_path / "env"
    recipe = _write(tmp_path, f"""\
description: end to end
nproc: 3
{HOOK_YAML if with_hook else ""}env:
  RECIPE_VAR: from-recipe
  NUMBER_VAR: 3
script: {script}
args: [{out}, --from-recipe]
""")
    cli = ["--recipe", str(recipe), "--nproc", "2", "--quiet"] + (["--rank", "1"] if with_hook else [])
    r = ftrun(*cli, cwd=tmp_path, env={"FTRUN_HOME": str(tmp_path / "home")}, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    dumps = sorted(tmp_path.glob("env.*.json"))
    assert [p.name for p in dumps] == ["env.0.json", "env.1.json"]  # --nproc 2 beat the recipe's 3
    for p in dumps:
        d = json.loads(p.read_text())
        env = d["env"]
        assert d["argv"] == [str(out), "--from-recipe"]  # the recipe's script and args
        assert env["WORLD_SIZE"] == "2" and env["RECIPE_VAR"] == "from-recipe" and env["NUMBER_VAR"] == "3"
        if with_hook:
            hook = json.loads(env["FTRUN_HOOK"])
            assert hook["name"] == "powersgd" and hook["wrap"] == "fp16"
            assert hook["params"]["rank"] == 1 and hook["params"]["start_iter"] == 7  # --rank 1 beat rank 4 only
        else:
            assert not env.get("FTRUN_HOOK")


def test_merged_errors_point_at_the_recipe_line_only_for_recipe_values(tmp_path):
    """A problem that shows only once recipe and CLI merge is placed on the recipe's line when the
    recipe's value is to blame, and left as a command-line error when the user typed it."""
    from ftrun.recipe import config_with_recipe

    p = _write(tmp_path, "description: x\nnproc: 2\nranks: 0,3\n")
    with pytest.raises(ConfigError) as ei:
        config_with_recipe({"script": "x.py"}, str(p), check_paths=False)
    assert str(ei.value).startswith(f"{p}:3: ranks: --ranks 3: no such rank"), str(ei.value)
    assert config_with_recipe({"script": "x.py", "nproc": "4"}, str(p), check_paths=False).ranks == (0, 3)
    with pytest.raises(ConfigError) as ei:
        config_with_recipe({"script": "x.py", "nproc": "4", "ranks": "0,9"}, str(p), check_paths=False)
    assert not str(ei.value).startswith(str(p)) and "--ranks 9" in str(ei.value)
