"""Every `ftrun ...` command line of the README and of the site (its code blocks, and the whole lines
written inline) is a line ftrun takes.

Each run line goes through `ftrun --dry-run` in a temporary folder holding stand-ins for the
scripts, modules, recipes and folders it names (with the few host names and shell variables
the docs use mapped to values that resolve here); a documented `$ ftrun ...` followed by its
`ftrun: error: ...` line must fail with exit 2 and that very line. Lines of the other commands
(status, recipes, validate) must parse: every flag they give is one their --help lists.
Multi-node and c10d lines dry-run too: a dry run never connects to another node.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import pytest

from conftest import FTRUN, ROOT

DOCS = ROOT / "docs"
# The shell variables and host names the docs use for a cluster, as values that work here.
SHELL_VARIABLES = {"SLURM_JOB_ID": "77", "SLURM_JOB_NAME": "job", "head": "localhost"}
HOSTS = {"node0": "localhost", "host": "localhost", "node01": "localhost"}
# Commands that do not run a script: checked by their --help instead.
OTHER_COMMANDS = ("status", "recipes", "validate")


@dataclass
class Line:
    where: str                      # file:line
    argv: List[str]                 # after `ftrun`
    env: Dict[str, str] = field(default_factory=dict)
    error: Optional[str] = None     # the documented `ftrun: error: ...` line that follows it


def _blocks(path: Path):
    """(first line number, lines) of every fenced code block of a Markdown file."""
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        if lines[i].lstrip().startswith("```"):
            start = i + 1
            j = start
            while j < len(lines) and not lines[j].lstrip().startswith("```"):
                j += 1
            yield start + 1, lines[start:j]
            i = j + 1
        else:
            i += 1


COMMAND = re.compile(r"(?:^|^\$ |#\s*\w[\w ]*:\s+)((?:[A-Z_][A-Z0-9_]*=\S+\s+)*(?:srun\s+)?(?:python -m )?ftrun\s.*)$")


def _command_lines(path: Path) -> List[Line]:
    out = []
    for first, block in _blocks(path):
        joined: List[tuple] = []
        for k, raw in enumerate(block):
            if joined and joined[-1][1].endswith("\\"):
                joined[-1] = (joined[-1][0], joined[-1][1][:-1] + " " + raw.strip())
            else:
                joined.append((first + k, raw.strip()))
        for idx, (n, text) in enumerate(joined):
            k8s = re.search(r'command:\s*(\["ftrun".*\])', text)
            if k8s:
                out.append(Line(f"{path.relative_to(ROOT)}:{n}", json.loads(k8s.group(1))[1:]))
                continue
            m = COMMAND.search(text)
            if not m:
                continue
            cmd = re.sub(r"\s+#.*$", "", m.group(1))  # a shell comment after the line
            error = None
            if idx + 1 < len(joined) and joined[idx + 1][1].startswith("ftrun: error:"):
                error = joined[idx + 1][1]
            out.append(_parse(f"{path.relative_to(ROOT)}:{n}", cmd, error))
    return out


def _parse(where: str, cmd: str, error: Optional[str]) -> Line:
    def var(m):
        name = m.group(1) or m.group(2)
        if name not in SHELL_VARIABLES:
            raise AssertionError(f"{where}: the docs use ${name}; give it a value in SHELL_VARIABLES")
        return SHELL_VARIABLES[name]

    words = shlex.split(re.sub(r"\$\{?(\w+)\}?|\$\((\w+)\)", var, cmd))
    env = {}
    while "=" in words[0] and not words[0].startswith("-"):
        k, v = words.pop(0).split("=", 1)
        env[k] = v
    if words[0] == "srun":
        words.pop(0)
    if words[:3] == ["python", "-m", "ftrun"]:
        words = ["ftrun"] + words[3:]
    assert words[0] == "ftrun", (where, cmd)
    return Line(where, words[1:], env, error)


INLINE = re.compile(r"`((?:srun |python -m )?ftrun [^`]+)`")


def _inline_lines(path: Path) -> List[Line]:
    """Whole run lines written inline in the prose and tables (`ftrun --nproc 4 train.py`): those
    that name a script or a module, without a placeholder (FILE, ARGS, ...) or an elision."""
    out = []
    inside = False
    for n, text in enumerate(path.read_text().splitlines(), 1):
        if text.lstrip().startswith("```"):
            inside = not inside
            continue
        if inside:
            continue
        for cmd in INLINE.findall(text):
            words = cmd.split()
            if "..." in cmd or "[" in cmd or any(re.fullmatch(r"[A-Z][A-Z_]+", w) for w in words):
                continue
            if any(w.endswith((".py", ".sh")) for w in words) or "-m" in words:
                out.append(_parse(f"{path.relative_to(ROOT)}:{n}", cmd, None))
    return out


def documented_lines() -> List[Line]:
    files = [ROOT / "README.md"] + sorted(DOCS.rglob("*.md"))
    return [line for f in files for line in _command_lines(f) + _inline_lines(f)]


# ---------------------------------------------------------------- stand-ins


def _takes_value() -> Dict[str, bool]:
    from ftrun.options import HOOK_OPTIONS, OPTIONS

    out = {"--recipe": True, "--dry-run": False, "-h": False, "--help": False}
    for opt in list(OPTIONS.values()) + list(HOOK_OPTIONS.values()):
        for flag in opt.flags:
            out[flag] = not opt.is_flag
    return out


def _stand_ins(line: Line, tmp: Path) -> List[str]:
    """Make what the line names in `tmp`, and return its argv as it will run there."""
    takes = _takes_value()
    argv = list(line.argv)
    if argv and argv[0] == "run":
        argv.pop(0)
    out: List[str] = []
    module = no_python = False
    i = 0
    while i < len(argv):
        word = argv[i]
        if word.startswith("-") and word != "--":
            name, eq, value = word.partition("=")
            module = module or name in ("-m", "--module")
            no_python = no_python or name in ("--no-python", "--no_python")
            if takes.get(name) and not eq:  # an unknown option is left for ftrun to refuse
                i += 1
                value = argv[i]
            if takes.get(name):
                value = _value(name, value, tmp)
                out.append(f"{name}={value}" if eq else name)
                if not eq:
                    out.append(value)
            else:
                out.append(word)
            i += 1
            continue
        script = word
        if not (line.error and ("not found" in line.error or "no module" in line.error)):
            _make_script(script, module, no_python, tmp)
        out += [script] + argv[i + 1:]
        break
    return out


def _value(name: str, value: str, tmp: Path) -> str:
    if name in ("--rdzv-endpoint", "--rdzv_endpoint", "--master-addr", "--master_addr"):
        host, sep, port = value.rpartition(":") if ":" in value else (value, "", "")
        return HOSTS.get(host, host) + sep + port
    if name in ("--checkpoint-dir", "--checkpoint_dir", "--log-dir", "--log_dir") and value.startswith("/"):
        return str(tmp / value.lstrip("/"))
    if name == "--recipe" and value.endswith((".yaml", ".yml")):
        recipe = tmp / value
        if not recipe.exists():
            recipe.parent.mkdir(parents=True, exist_ok=True)
            # A stand-in that lets the lines around it run: a hook (for hook flags) and a script.
            recipe.write_text("description: a stand-in\nhook: {name: powersgd}\nscript: train.py\n")
            (tmp / "train.py").write_text("print('a stand-in')\n")
    return value


def _make_script(script: str, module: bool, no_python: bool, tmp: Path) -> None:
    if module:
        parts = script.split(".")
        for k in range(1, len(parts)):
            pkg = tmp.joinpath(*parts[:k])
            pkg.mkdir(parents=True, exist_ok=True)
            (pkg / "__init__.py").touch()
        tmp.joinpath(*parts[:-1], parts[-1] + ".py").write_text("print('a stand-in')\n")
        return
    path = tmp / script
    path.parent.mkdir(parents=True, exist_ok=True)
    if no_python:
        path.write_text("#!/bin/sh\necho a stand-in\n")
        path.chmod(0o755)
    else:
        path.write_text("print('a stand-in')\n")


# ---------------------------------------------------------------- the tests


def _run_docs_line(argv: List[str], env: Dict[str, str], cwd: Path, home: Path) -> subprocess.CompletedProcess:
    """A command of the docs, with only the environment its line sets (no PET_/SLURM_ of ours)."""
    full = dict(os.environ, FTRUN_HOME=str(home), COLUMNS="200", **env)
    for name in [k for k in full if k.startswith(("PET_", "SLURM_"))]:
        if name not in env:
            del full[name]  # the docs' lines, not the environment of whoever runs the tests
    return subprocess.run(FTRUN + argv, capture_output=True, text=True, timeout=60, env=full, cwd=cwd)


def _check(line: Line, tmp: Path) -> Optional[str]:
    """None if the line is one ftrun takes as documented, else what went wrong."""
    work = tmp / "work"
    work.mkdir()
    if line.argv[:1] and line.argv[0] in OTHER_COMMANDS or line.argv[:1] in (["--version"], ["--help"]):
        sub = line.argv[:1] if line.argv[0] in OTHER_COMMANDS else []
        proc = _run_docs_line(sub + ["--help"], {}, work, tmp / "home")
        if proc.returncode != 0:
            return f"ftrun {' '.join(sub)} --help exited {proc.returncode}"
        flags = [w.split("=")[0] for w in line.argv[1:] if w.startswith("-")]
        missing = [f for f in flags if not re.search(rf"(?<![\w-]){re.escape(f)}\b", proc.stdout)]
        return f"not options of ftrun {sub[0]}: {missing}" if missing else None
    argv = _stand_ins(line, work)
    argv = (["run"] if line.argv[:1] == ["run"] else []) + ["--dry-run"] + argv
    held = None
    if line.error and "already in use" in line.error:
        port = int(re.search(r"--master-port (\d+)", line.error).group(1))
        held = socket.socket()
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind(("0.0.0.0", port))
        held.listen()
    try:
        proc = _run_docs_line(argv, line.env, work, tmp / "home")
    finally:
        if held is not None:
            held.close()
    if line.error is None:
        if proc.returncode != 0 or "nothing was started" not in proc.stdout:
            return f"ftrun {' '.join(argv)} exited {proc.returncode}: {proc.stderr.strip()}"
        return None
    got = proc.stderr.strip()
    want = line.error.replace("/home/me/project", str(work))
    if proc.returncode != 2 or got.split(" (bundled: ")[0] != want.split(" (bundled: ")[0].replace("(...)", "") \
            and not _same_but_elided(got, want):
        return f"ftrun {' '.join(argv)}: documented\n  {want}\ngot (exit {proc.returncode})\n  {got}"
    return None


def _same_but_elided(got: str, want: str) -> bool:
    """A documented error may elide part of the line with '(...)' or '...'."""
    pattern = ".*".join(re.escape(p) for p in re.split(r"\(\.\.\.\)|\.\.\.", want))
    return re.fullmatch(pattern, got) is not None


LINES = documented_lines()


def test_the_docs_have_command_lines_to_check():
    where = {line.where.split(":")[0] for line in LINES}
    assert len(LINES) >= 60 and "README.md" in where and "docs/guides/several-machines.md" in where, len(LINES)
    assert any(line.error for line in LINES)


@pytest.mark.parametrize("line", [pytest.param(line, id=line.where) for line in LINES
                                  if line.where.startswith("README")])
@pytest.mark.quick
def test_readme_command_line(line, tmp_path):
    problem = _check(line, tmp_path)
    assert problem is None, f"{line.where}: {problem}"


@pytest.mark.parametrize("line", [pytest.param(line, id=line.where) for line in LINES
                                  if not line.where.startswith("README")])
def test_site_command_line(line, tmp_path):
    problem = _check(line, tmp_path)
    assert problem is None, f"{line.where}: {problem}"


def test_the_check_fails_a_wrong_line(tmp_path):
    """The check is not one that passes anything: a misspelt option, a wrong error line and a
    flag another command does not have all fail it."""
    wrong = [Line("x:1", ["--nprocs", "2", "train.py"]),
             Line("x:2", ["--nproc", "0", "train.py"], error="ftrun: error: command line: --nproc is fine"),
             Line("x:3", ["status", "--nope"])]
    for k, line in enumerate(wrong):
        (tmp_path / str(k)).mkdir()
        assert _check(line, tmp_path / str(k)) is not None, line
