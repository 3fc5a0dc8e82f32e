"""Issue 12, bad input by family: every member through the real CLI (flag, recipe, PET_*, `ftrun validate`)
is one line naming the problem and the fix, exit 2, nothing started; `ftrun status` survives damaged
state files and shows a SIGSTOPped rank as stalled; a second live run of one run id is refused."""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import FTRUN, ROOT, SCRIPTS, STEP_LOOP, run_ftrun, start_ftrun, wait_for_line
from helpers import assert_bad, status_record, wait_for

TRAIN = SCRIPTS / "train_ddp.py"
LONG_ID = "r" * 300


def _nothing_started(home: Path) -> None:
    assert not home.exists() or not any(home.iterdir()), f"a run was started: {list(home.iterdir())}"


# --------------------------------------------------------------------------- 1. numbers that are not numbers
NUMBERS = [
    (["--step-timeout", "nan"], ["--step-timeout", "NaN"]),
    (["--shutdown-timeout", "nan"], ["--shutdown-timeout", "NaN"]),
    (["--shutdown-timeout", "inf"], ["--shutdown-timeout", "finite"]),
    (["--step-timeout", "-inf"], ["--step-timeout", "finite"]),
    (["--join-timeout", "Infinity"], ["--join-timeout", "finite"]),
    (["--monitor-interval", "nan"], ["--monitor-interval", "NaN"]),
    (["--step-timeout", "1e300"], ["--step-timeout", "at most 604800"]),
    (["--shutdown-timeout", "1e300"], ["--shutdown-timeout", "at most 604800"]),
    (["--join-timeout", "-2"], ["--join-timeout", ">= 0"]),
    (["--monitor-interval", "-0.1"], ["--monitor-interval", ">= 0"]),
    (["--step-timeout", "0.01"], ["--step-timeout", "0 (off) or at least 1"]),
    (["--rdzv-conf", "join_timeout=nan"], ["join_timeout=nan", "NaN"]),
    (["--rdzv-conf", "read_timeout=1e300"], ["read_timeout", "at most"]),
    (["--max-restarts", "99999999999999999999"], ["--max-restarts", "at most 1000000"]),
    (["--max-restarts", "2.5"], ["--max-restarts", "whole number"]),
    (["--max-restarts", "three"], ["--max-restarts", "whole number"]),
    (["--nproc", "1e3"], ["--nproc", "whole number"]),
    (["--nproc", "99999999999999999999"], ["--nproc", "at most"]),
    (["--nnodes", "100000000"], ["--nnodes", "at most 65536"]),
    (["--node-rank", "-1"], ["--node-rank", ">= 0"]),
    (["--node-rank", "1.5"], ["--node-rank", "whole number"]),
    (["--ft", "--min-replicas", "0"], ["--min-replicas", ">= 1"]),
    (["--master-port", "1e4"], ["--master-port", "whole number"]),
    (["--master-port", "70000"], ["--master-port", "1..65535"]),
    (["--hook", "powersgd", "--min-compression-rate", "inf"], ["--min-compression-rate", "finite"]),
    (["--hook", "powersgd", "--min-compression-rate", "nan"], ["--min-compression-rate", "NaN"]),
    (["--hook", "powersgd", "--orthogonalization-epsilon", "-inf"], ["--orthogonalization-epsilon", "finite"]),
    (["--hook", "powersgd", "--rank", "0.5"], ["--rank", "whole number"]),
    (["--hook", "localsgd", "--period", "-3"], ["--period"]),
]


# Through the real CLI: one of each kind; the whole table goes through the same parser in-process.
CLI_NUMBERS = [0, 1, 2, 6, 11, 13, 15, 18, 24]


def _parse_cli(args):
    """What `ftrun ARGS TRAIN` makes of its flags, in this process (the CLI's own typer command)."""
    import typer

    from ftrun.cli import app

    command = typer.main.get_command(app)
    return command.main(args=["run"] + [str(a) for a in args] + [str(TRAIN)], prog_name="ftrun",
                        standalone_mode=False)


@pytest.mark.parametrize("args,needles", NUMBERS, ids=[" ".join(a) for a, _ in NUMBERS])
def test_numbers_that_are_not_numbers(ftrun_home, args, needles):
    from ftrun.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        _parse_cli(args)
    assert "\n" not in str(e.value) and all(n in str(e.value) for n in needles), str(e.value)
    if NUMBERS.index((args, needles)) in CLI_NUMBERS:
        assert_bad(run_ftrun(args + [TRAIN], timeout=30), *needles)
    _nothing_started(ftrun_home)


@pytest.mark.parametrize("key,value,needle", [
    ("step_timeout", ".nan", "not .nan"), ("shutdown_timeout", ".inf", "finite"), ("join_timeout", "-.inf", "finite"),
    ("shutdown_timeout", "1.0e+300", "at most"), ("max_restarts", "10000000000", "at most"),
    ("hook", "{name: powersgd, min_compression_rate: .nan, start_iter: 10}", "finite"),
])
def test_numbers_in_recipes_and_validate(ftrun_home, tmp_path, key, value, needle):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"nproc: 1\n{key}: {value}\n")
    for args in (["validate", recipe], ["--recipe", recipe, TRAIN]):
        assert_bad(run_ftrun(args, timeout=30), f"{recipe}:2", needle)
    _nothing_started(ftrun_home)


@pytest.mark.parametrize("var,value,needle", [
    ("PET_MAX_RESTARTS", "1e9", "whole number"), ("PET_SHUTDOWN_TIMEOUT", "nan", "NaN"),
    ("PET_MONITOR_INTERVAL", "inf", "finite"), ("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "-inf", "finite"),
    ("PET_RDZV_ID", "../x", "PET_RDZV_ID"), ("PET_NODE_RANK", "2", "--node-rank 2"),
    ("FTRUN_VERBOSE", "yes", "FTRUN_VERBOSE='yes' must be 0 or 1"),
    ("FTRUN_NODE_TIMEOUT", "abc", "FTRUN_NODE_TIMEOUT='abc' is not a number of seconds"),
    ("FTRUN_NODE_TIMEOUT", "nan", "FTRUN_NODE_TIMEOUT='nan' is not a number of seconds"),
    ("FTRUN_STORE_MOVES", "no", "FTRUN_STORE_MOVES='no' must be 0 or 1"),
])
def test_numbers_and_names_from_the_environment(ftrun_home, var, value, needle):
    assert_bad(run_ftrun([TRAIN], timeout=30, env={var: value}), needle)
    _nothing_started(ftrun_home)


@pytest.mark.parametrize("value", ["0", "abc", "1e9", "2000"])
def test_steps_per_ft_round_from_the_environment(ftrun_home, value):
    assert_bad(run_ftrun(["--ft", TRAIN], timeout=30, env={"FTRUN_FT_ROUND_STEPS": value}),
                f"FTRUN_FT_ROUND_STEPS={value!r} is not a whole number of steps from 1 to 1024")
    _nothing_started(ftrun_home)


# --------------------------------------------------------------------------- 2. paths ftrun must write
def test_paths_ftrun_must_write(ftrun_home, tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    cases = [
        (["--log-dir", a_file], [f"--log-dir {a_file}", "is a file"]),
        (["--log-dir", a_file / "logs"], ["cannot be created", f"{a_file} is a file"]),
        (["--log-dir", tmp_path / ("n" * 300)], ["--log-dir", "longer than 255"]),
        (["--run-id", LONG_ID], ["--run-id", "300 characters", "1 to 128"]),
        (["--run-id", "a/b"], ["--run-id 'a/b'"]),
        (["--run-id", ".."], ["--run-id '..'"]),
        (["--run-id", "../../etc"], ["--run-id"]),
        (["--run-id", "-rf"], ["--run-id '-rf'"]),
        (["--run-id", "ün"], ["--run-id", "ASCII"]),
    ]
    for args, needles in cases:
        assert_bad(run_ftrun(args + [TRAIN], timeout=30), *needles)
    _nothing_started(ftrun_home)
    # The runs folder itself (FTRUN_HOME) under a regular file.
    assert_bad(run_ftrun([TRAIN], timeout=30, env={"FTRUN_HOME": str(a_file / "home")}), "FTRUN_HOME",
                f"{a_file} is a file")


# --------------------------------------------------------------------------- 3. options that would do nothing
@pytest.mark.parametrize("args,needles", [
    (["--hook", "fp16", "--no-python", "true"], ["--hook fp16", "--no-python"]),
    (["--hook", "powersgd", "--start-iter", "5", "--no-python", "true"], ["--hook powersgd", "--no-python"]),
    (["--step-timeout", "30", "--no-python", "true"], ["--step-timeout", "--no-python"]),
    (["--min-replicas", "2", TRAIN], ["--min-replicas 2", "--ft"]),
    (["--rank", "2", TRAIN], ["--rank", "without a hook"]),
    (["--wrap", "fp16", TRAIN], ["--wrap", "without a hook"]),
    (["--hook", "fp16", "--period", "4", TRAIN], ["--period", "does not apply"]),
    (["--quiet", "--ranks", "0", TRAIN], ["--ranks", "--quiet"]),
    (["--quiet", "--local-ranks-filter", "0", TRAIN], ["--local-ranks-filter", "--quiet"]),
    (["--quiet", "--verbose", TRAIN], ["--verbose", "--quiet"]),
    (["--tee", "3:3", "--nproc", "2", TRAIN], ["--tee", "local rank 3", "0..1"]),
    (["--redirects", "0:1,2:1", "--nproc", "2", TRAIN], ["--redirects", "local rank 2"]),
    (["--ranks", "5", "--nproc", "2", TRAIN], ["--ranks 5", "0..1"]),
    (["--ranks", "7", "--nproc", "1", "--nnodes", "1:2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
      "localhost:29400", TRAIN], ["--ranks 7", "0..1"]),
    (["--node-rank", "1", TRAIN], ["--node-rank 1", "one-node"]),
])
def test_options_that_would_do_nothing(ftrun_home, args, needles):
    assert_bad(run_ftrun(args, timeout=30), *needles)
    _nothing_started(ftrun_home)


# --------------------------------------------------------------------------- 4. validate = every check of a run
def test_validate_refuses_what_a_run_refuses(ftrun_home, tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    broken = tmp_path / "broken.py"
    broken.write_text("def f(:\n    pass\n")
    good = tmp_path / "good.py"
    good.write_text("print('ok')\n")
    cases = {
        "missing_script": (f"script: {tmp_path / 'nope.py'}\n", ["nope.py", "not found"]),
        "syntax": (f"script: {broken}\n", [f"{broken}:1", "SyntaxError"]),
        "log_dir_file": (f"script: {good}\nlog_dir: {a_file}\n", ["log_dir", "is a file"]),
        "log_dir_under_file": (f"log_dir: {a_file}/x\n", ["log_dir", f"{a_file} is a file"]),
        "nproc": (f"script: {good}\nnproc: 100000\n", ["nproc", "at most"]),
        "master_addr": ("master_addr: 192.0.2.7\n", ["master_addr", "not an address of this machine"]),
        "silent": ("min_replicas: 2\n", ["min_replicas", "--ft"]),
        "no_python_hook": ("no_python: true\nhook: fp16\n", ["--no-python"]),
    }
    for i, (name, (text, needles)) in enumerate(cases.items()):
        recipe = tmp_path / f"{name}.yaml"
        recipe.write_text(text)
        assert_bad(run_ftrun(["validate", recipe], timeout=30), str(recipe), *needles)
        if i < 4:  # the first four through `ftrun --recipe` too: a run refuses what validate refused
            run_args = ["--recipe", recipe] + ([] if "script:" in text else [good])
            assert_bad(run_ftrun(run_args, timeout=30), *needles)
    _nothing_started(ftrun_home)
    ok = tmp_path / "ok.yaml"
    ok.write_text(f"script: {good}\nnproc: 2\nlog_dir: {tmp_path / 'logs'}\n")
    r = run_ftrun(["validate", ok], timeout=30)
    assert r.returncode == 0 and r.stdout.startswith("ok "), r
    assert not (tmp_path / "logs").exists(), "validate created the log folder"
    _nothing_started(ftrun_home)


def test_validate_with_new_checks_never_imports_torch(tmp_path):
    good = tmp_path / "good.py"
    good.write_text("import torch\n")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"script: {good}\nnproc: 2\nlog_dir: {tmp_path / 'logs'}\n")
    code = ("import sys\nfrom ftrun.cli import main\n"
            f"try:\n    main(['validate', {str(recipe)!r}])\nexcept SystemExit as e:\n    assert e.code == 0, e.code\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60,
                       env=dict(os.environ, FTRUN_HOME=str(tmp_path / "home")))
    assert r.returncode == 0, r.stderr


# --------------------------------------------------------------------------- 5. master address elsewhere
def test_one_node_master_addr_elsewhere(ftrun_home):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # 192.0.2.0/24 is TEST-NET-1: never an address of this machine.
    for args in (["--master-addr", "192.0.2.7"], ["--master-addr", "192.0.2.7", "--master-port", port],
                 ["--rdzv-backend", "c10d", "--rdzv-endpoint", "192.0.2.7:0"], ["--master-addr", "no-such-host.invalid"]):
        t0 = time.monotonic()
        assert_bad(run_ftrun(args + [TRAIN], timeout=30), args[1].split(":")[0] if args[0] != "--rdzv-backend"
                    else "192.0.2.7", "one-node")
        assert time.monotonic() - t0 < 20
    assert_bad(run_ftrun([TRAIN], timeout=30, env={"PET_MASTER_ADDR": "192.0.2.7", "PET_MASTER_PORT": str(port)}),
                "192.0.2.7 (from PET_MASTER_ADDR)")
    _nothing_started(ftrun_home)


def test_one_node_master_addr_of_this_machine_runs(ftrun_home, tmp_path):
    script = tmp_path / "hello.py"
    script.write_text("import os\nprint('master', os.environ['MASTER_ADDR'], flush=True)\n")
    r = run_ftrun(["--master-addr", "127.0.0.1", "--nproc", "1", script], timeout=120)
    assert r.returncode == 0, r.stderr
    assert "master " in r.stdout


# --------------------------------------------------------------------------- 6. a script that cannot compile
@pytest.mark.quick
def test_script_that_cannot_compile(ftrun_home, tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n\nprint('x'\nx = 1\n")
    assert_bad(run_ftrun(["--max-restarts", "5", bad], timeout=30), f"{bad}:3", "SyntaxError")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("raise SystemExit('__init__ ran in the launcher')\n")
    (tmp_path / "pkg" / "train.py").write_text("for i in range(3)\n    pass\n")
    (tmp_path / "pkg" / "__main__.py").write_text("\tx = 1\n  y = 2\n")
    assert_bad(run_ftrun(["-m", "pkg.train"], timeout=30, cwd=tmp_path), "pkg/train.py:1", "SyntaxError")
    assert_bad(run_ftrun(["-m", "pkg"], timeout=30, cwd=tmp_path), "pkg/__main__.py:1", "IndentationError")
    nul = tmp_path / "nul.py"
    nul.write_bytes(b"print(1)\x00\n")
    assert_bad(run_ftrun([nul], timeout=30), str(nul), "--no-python")
    _nothing_started(ftrun_home)


# --------------------------------------------------------------------------- 7. more workers than the machine
def test_nproc_beyond_this_machine(ftrun_home):
    from ftrun.machine import max_workers

    limit, why = max_workers()
    t0 = time.monotonic()
    assert_bad(run_ftrun(["--nproc", "100000", TRAIN], timeout=30), "--nproc 100000", f"at most {limit}",
                "lower --nproc")
    assert_bad(run_ftrun(["--nproc", str(limit + 1), TRAIN], timeout=30), f"at most {limit}")
    assert time.monotonic() - t0 < 20
    _nothing_started(ftrun_home)


# --------------------------------------------------------------------------- 10. torch floor
def test_torch_too_old_is_one_line(ftrun_home, tmp_path):
    # A distribution record ahead of the real one on the path: what importlib.metadata reports first.
    fake = tmp_path / "site" / "torch-2.3.1.dist-info"
    fake.mkdir(parents=True)
    (fake / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.3.1\n")
    env = {"PYTHONPATH": str(tmp_path / "site")}
    assert_bad(run_ftrun([TRAIN], timeout=30, env=env), "torch 2.3.1 is too old", "torch>=2.10")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("nproc: 1\n")
    assert_bad(run_ftrun(["validate", recipe], timeout=30, env=env), "torch>=2.10")
    _nothing_started(ftrun_home)


def test_pyproject_states_the_torch_floor():
    from ftrun.preflight import TORCH_FLOOR

    text = (ROOT / "pyproject.toml").read_text()
    assert f'"torch>={TORCH_FLOOR[0]}.{TORCH_FLOOR[1]}"' in text


# --------------------------------------------------------------------------- 8. damaged state files
def _read_until(fd: int, needle: bytes, timeout: float) -> str:
    """What a terminal showed until `needle` appeared (or `timeout` passed)."""
    buf = b""
    deadline = time.monotonic() + timeout
    while needle not in buf and time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # the other end closed
            break
        if not chunk:
            break
        buf += chunk
    return buf.decode(errors="replace")


def _state(run_id: str, sup_pid: int, **over) -> dict:
    now = time.time()
    d = {"run_id": run_id, "script": "train.py", "argv": ["ftrun", "train.py"], "started": now - 1, "pid": sup_pid,
         "hook": None, "policy": "group restart", "max_restarts": 0, "nproc": 1, "updated": now,
         "replicas": [{"rank": 0, "local_rank": 0, "pid": sup_pid, "state": "running", "last_heartbeat": now}]}
    d.update(over)
    return d


def test_status_with_damaged_state_files(ftrun_home):
    sup = subprocess.Popen(["sleep", "60"])
    try:
        damaged = {
            "bad-replicas": json.dumps(_state("bad-replicas", sup.pid, replicas="x")),
            "bad-started": json.dumps(_state("bad-started", sup.pid, started="yesterday")),
            "bad-rank": json.dumps(_state("bad-rank", sup.pid, replicas=[{"rank": "zero", "local_rank": 0}])),
            "bad-nan": json.dumps(_state("bad-nan", sup.pid, started=float("nan"))),
            "bad-missing": json.dumps({"run_id": "bad-missing"}),
            "bad-list": "[1, 2]",
            "bad-torn": '{"run_id": "bad-torn", ',
            "bad-binary": b"\xff\xfe\x00garbage",
            "bad-pid": json.dumps(_state("bad-pid", sup.pid, pid="123")),
        }
        ftrun_home.mkdir(mode=0o700)
        for name, text in damaged.items():
            (ftrun_home / name).mkdir(mode=0o700)
            path = ftrun_home / name / "state.json"
            path.write_bytes(text if isinstance(text, bytes) else text.encode())
        (ftrun_home / "good-run").mkdir(mode=0o700)
        (ftrun_home / "good-run" / "state.json").write_text(json.dumps(_state("good-run", sup.pid)))
        (ftrun_home / "bad-dir" / "state.json").mkdir(parents=True)

        r = run_ftrun(["status"], timeout=30, env={"COLUMNS": "300"})
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
        for name in list(damaged) + ["bad-dir"]:
            lines = [line for line in r.stdout.splitlines() if line.startswith(name + " ")]
            assert len(lines) == 1 and "unreadable" in lines[0], (name, r.stdout)
        assert "'replicas' is \"x\"" in r.stdout and "'started' is \"yesterday\"" in r.stdout
        assert "good-run" in r.stdout and "1 run alive" in r.stdout and "10 unreadable" in r.stdout

        r = run_ftrun(["status", "--json"], timeout=30)
        assert r.returncode == 0, r.stderr
        runs = {x["run_id"]: x for x in json.loads(r.stdout)}
        assert runs["good-run"]["phase"] == "running"
        assert all(runs[n]["phase"] == "unreadable" and runs[n]["problem"] for n in damaged)
        r = run_ftrun(["status", "bad-started"], timeout=30)
        assert r.returncode == 0 and "unreadable" in r.stdout and "yesterday" in r.stdout, r

        # --watch as a person sees it (a terminal: rich redraws in place) and as JSON lines: Ctrl-C ends it.
        master, slave = pty.openpty()
        p = subprocess.Popen(FTRUN + ["status", "--watch"], stdout=slave, stderr=subprocess.PIPE, text=True,
                             env=dict(os.environ, COLUMNS="300", LINES="200"))
        os.close(slave)
        try:
            out = _read_until(master, b"bad-torn", 30)
        finally:
            p.send_signal(signal.SIGINT)
            err = p.communicate(timeout=30)[1]
            os.close(master)
        assert "bad-torn" in out and "unreadable" in out and p.returncode == 0 and "Traceback" not in err, (out, err)
        p = start_ftrun(["status", "--watch", "--json"])
        first = json.loads(wait_for_line(p, '"run_id"', 30))
        p.send_signal(signal.SIGINT)
        err = p.communicate(timeout=30)[1]
        assert p.returncode == 0 and "Traceback" not in err, err
        assert {x["run_id"] for x in first if x["phase"] == "unreadable"} == set(damaged) | {"bad-dir"}
    finally:
        sup.kill()
        sup.wait()


# --------------------------------------------------------------------------- 9 and 2: a live run


def _record(run_id: str):
    """`ftrun status RUN_ID --json`'s record of the run; None while it has none to give (starting)."""
    try:
        return status_record(run_id)
    except AssertionError:
        return None


def test_stalled_rank_and_a_second_run_of_the_same_id(ftrun_home, tmp_path):
    script = tmp_path / "loop.py"
    script.write_text(STEP_LOOP)
    stop = tmp_path / "stop"
    sup = start_ftrun(["--nproc", "2", "--run-id", "twin", "--quiet", script, stop], cwd=tmp_path)
    stopped = None
    try:
        run = wait_for(lambda: (r := _record("twin")) and all(x["state"] == "running" and x["step"] > 0
                                                              for x in r["replicas"]) and r,
                       120, "2 running replicas", sup, poll=0.2)
        # 2. the same run id while it runs: refused, nothing of the first touched.
        twin = run_ftrun(["--nproc", "1", "--run-id", "twin", script, stop], timeout=60, cwd=tmp_path)
        assert_bad(twin, "--run-id twin", "already running", f"pid {sup.pid}")
        assert sup.poll() is None

        # 9. SIGSTOP one worker: it is shown as stalled, the other stays running.
        stopped = run["replicas"][1]["pid"]
        os.kill(stopped, signal.SIGSTOP)
        run = wait_for(lambda: (r := _record("twin")) and r["replicas"][1]["state"] == "stalled" and r,
                       60, "rank 1 stalled", sup, poll=0.2)
        assert run["replicas"][1]["recorded_state"] == "running" and run["replicas"][0]["state"] == "running"
        assert run["replicas"][1]["heartbeat_age_s"] > 3
        r = run_ftrun(["status", "twin"], timeout=30, env={"COLUMNS": "200"})
        assert "stalled" in r.stdout, r.stdout
        os.kill(stopped, signal.SIGCONT)
        stopped = None
        wait_for(lambda: (r := _record("twin")) and all(x["state"] == "running" for x in r["replicas"]),
                 60, "rank 1 running again", sup, poll=0.2)

        stop.write_text("")
        assert sup.wait(timeout=120) == 0, sup.stderr.read()
        # Once it ended, the name is free again.
        r = run_ftrun(["--nproc", "1", "--run-id", "twin", "--quiet", script, stop], timeout=120, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
    finally:
        if stopped is not None:
            try:
                os.kill(stopped, signal.SIGCONT)
            except ProcessLookupError:
                pass
        if sup.poll() is None:
            sup.kill()
            sup.wait()
