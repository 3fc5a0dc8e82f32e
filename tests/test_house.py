"""The house's own rules, read from the source (ast), no process started.

- No class name is defined twice in ftrun/: a reader who meets `Decision` knows which one it is.
- No import circle between modules of ftrun/ (any import: module-level, in a function,
  under TYPE_CHECKING): a circle means two modules that cannot be read, tested or moved apart.
- The layers: which part of ftrun/ may import which (the table LAYERS below), and the parts the
  command line and the supervisor load never import torch when they are imported.
- One rule, one place (ONE_PLACE below): the heal's source, the zygote decision and the replica
  size are each decided in one module, and every other part reads what it decided.
- The supervisor reads a member's reports (ftrun.wire's MemberReport, SurvivorReport) by their
  typed fields, never by a string key: the codec is the one place their format is written down.
- The tests' shared helpers (SHARED_HELPERS below: the bounded wait, starting ftrun, the
  replicas' reports and the check that they ended identical) are defined in tests/helpers.py
  or tests/conftest.py only, never again in a test file.

The size of a module (about 500 lines at most) is kept by review.
"""

from __future__ import annotations

import ast
import collections
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "ftrun"

# ---------------------------------------------------------------------------
# Pending, for the coordinator to remove at the end of issue 41: each entry names a thing still
# being rebuilt in another owner's files. Nothing may be added here: a new duplicate or circle fails.

# Class names still defined twice (the files that define them are being rebuilt right now).
PENDING_DUPLICATES: Set[str] = set()
# Import circles still there, each named by the prefix every module of the circle starts with.
PENDING_CIRCLES: Set[str] = set()

# ---------------------------------------------------------------------------
# The layers. A module belongs to the first row that names it ("X" names module X, "X.*" the
# package X and everything under it); a module may import (anywhere in it) only modules of the
# layers its row allows. TORCH_FREE layers never load torch when imported
# (torch is imported only inside the functions that need it, off the command line's path).
LAYERS: List[Tuple[str, Tuple[str, ...], Set[str]]] = [
    # layer       modules                                                          may import
    # both sides' vocabulary: the store's keys, votes, pacing and exit codes, files' formats, errors
    ("shared",     ("ftrun", "ftrun.keys", "ftrun.votes", "ftrun.pacing", "ftrun.exits", "ftrun.wire",
                    "ftrun.poll", "ftrun.errors", "ftrun.hookspec", "ftrun.envvars", "ftrun.prctl"), {"shared"}),
    # in the training processes: the ft API, the bootstrap, the member
    ("worker",     ("ftrun.worker.*", "ftrun.ft", "ftrun.lightning", "ftrun.hf", "ftrun.accelerate",
                    "ftrun.fabric"),                                                 {"shared", "worker"}),
    # the launcher's process: it reads the run's config and writes its status
    ("supervisor", ("ftrun.supervisor.*",),                                          {"shared", "cli", "supervisor"}),
    # the simulator runs the product's own parts in one process; the product never imports it
    ("sim",        ("ftrun.sim.*",),                                                 {"shared", "worker", "supervisor", "sim"}),
    # the command line: options, config and its checks, recipes, --dry-run, status, report
    ("cli",        ("ftrun.*",),                                                     {"shared", "cli", "supervisor"}),
]
TORCH_FREE = {"shared", "cli", "supervisor", "sim"}
# The one import across the layers, with its reason: the supervisor imports torch once and forks
# the zygote from itself (spawn.start_zygote_early), which then runs the zygote's own code.
CROSSINGS = {("ftrun.supervisor.workers.spawn", "ftrun.worker.zygote")}


def _modules() -> Dict[str, Path]:
    mods = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    assert len(mods) > 40, sorted(mods)  # the package was found, whole
    return mods


MODULES = _modules()
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def layer_of(module: str) -> str:
    for name, patterns, _ in LAYERS:
        for pattern in patterns:
            package = pattern[:-2] if pattern.endswith(".*") else None
            if module == pattern or (package and (module == package or module.startswith(package + "."))):
                return name
    raise AssertionError(f"{module} is in no layer")


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _at_import(body: List[ast.stmt]) -> Iterator[ast.stmt]:
    """The import statements run when the module is imported (not in functions, not for type checkers)."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            if not _is_type_checking(node):
                yield from _at_import(node.body)
            yield from _at_import(node.orelse)
        elif isinstance(node, ast.Try):
            for block in [node.body, node.orelse, node.finalbody] + [h.body for h in node.handlers]:
                yield from _at_import(block)
        elif isinstance(node, (ast.With, ast.ClassDef)):
            yield from _at_import(node.body)


def _targets(module: str, node: ast.stmt) -> List[str]:
    """Full names an import statement of `module` loads (ftrun's as module names, others as written)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    assert isinstance(node, ast.ImportFrom)
    base = node.module or ""
    if node.level:  # relative: from the module's package
        package = module.split(".")
        if MODULES[module].name != "__init__.py":
            package = package[:-1]
        package = package[:len(package) - node.level + 1]
        base = ".".join(package + ([base] if base else []))
    names = [f"{base}.{a.name}" for a in node.names]
    return [n if n in MODULES else base for n in names]


def _ftrun_module(name: str) -> str:
    """The module of ftrun/ a name is in ('' if none)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def imports(module: str, at_import_only: bool = False) -> Set[str]:
    tree = TREES[module]
    nodes = _at_import(tree.body) if at_import_only else \
        (n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)))
    return {t for node in nodes for t in _targets(module, node)}


def ftrun_graph(at_import_only: bool = False) -> Dict[str, Set[str]]:
    graph = {}
    for module in MODULES:
        found = {_ftrun_module(t) for t in imports(module, at_import_only) if t.split(".")[0] == "ftrun"}
        graph[module] = found - {"", module}
    return graph


def circles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan, without recursion)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _pending_circle(component: List[str]) -> bool:
    return any(all(m.startswith(prefix) for m in component) for prefix in PENDING_CIRCLES)


# ---------------------------------------------------------------------------


@pytest.mark.quick
def test_no_class_name_is_defined_twice():
    where: Dict[str, List[str]] = collections.defaultdict(list)
    for module, tree in TREES.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                where[node.name].append(module)
    twice = {name: mods for name, mods in where.items() if len(mods) > 1 and name not in PENDING_DUPLICATES}
    assert not twice, f"rename one of each (a class name says which thing it is, once in ftrun/): {twice}"


@pytest.mark.quick
def test_no_import_circles():
    found = circles(ftrun_graph())
    assert all(len(c) > 1 for c in found)
    new = [c for c in found if not _pending_circle(c)]
    assert not new, ("cut these import circles (move what both use into a module both import, or "
                     f"invert the dependency): {new}")


def test_the_circle_finder_finds_a_circle_and_nothing_else():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"d"}}
    assert circles(graph) == [["a", "b", "c"]]


@pytest.mark.quick
def test_layers():
    """Each module imports only what its layer's row of LAYERS allows, wherever the import is."""
    broken = []
    for module, targets in ftrun_graph().items():
        allowed = next(row[2] for row in LAYERS if row[0] == layer_of(module))
        broken += [f"{module} ({layer_of(module)}) imports {t} ({layer_of(t)})"
                   for t in sorted(targets) if layer_of(t) not in allowed and (module, t) not in CROSSINGS]
    assert not broken, "imports across the layers (see LAYERS in tests/test_house.py):\n" + "\n".join(broken)


def _loaded_at_import(module: str, graph: Dict[str, Set[str]]) -> Dict[str, str]:
    """Every module importing `module` loads (ftrun's and others'), each with the ftrun module that imports it."""
    seen: Dict[str, str] = {}
    todo = [module]
    while todo:
        current = todo.pop()
        # Importing a.b.c runs a/__init__.py and a/b/__init__.py first.
        parents = [".".join(current.split(".")[:i]) for i in range(1, current.count(".") + 1)]
        for target in sorted(imports(current, at_import_only=True)) + parents:
            inside = _ftrun_module(target) if target.split(".")[0] == "ftrun" else ""
            key = inside or target
            if key not in seen:
                seen[key] = current
                if inside:
                    todo.append(inside)
    return seen


@pytest.mark.quick
def test_the_command_line_and_the_supervisor_never_import_torch_at_import():
    """`ftrun --help`, status, recipes, validate and the supervisor's start stay torch-free.

    Checked through every import run at import time, transitively; torch is imported only inside
    the functions that need it (tests/test_cli_input.py checks the same of a real `--help` run).
    """
    graph = ftrun_graph(at_import_only=True)
    loads_torch = []
    for module in sorted(MODULES):
        if layer_of(module) in TORCH_FREE:
            loaded = _loaded_at_import(module, graph)
            loads_torch += [f"{module}: {name} (imported by {by})" for name, by in loaded.items()
                            if name.split(".")[0] == "torch"]
    assert not loads_torch, "torch is loaded at import by:\n" + "\n".join(loads_torch)


# ---------------------------------------------------------------------------
# One rule, one place: each decision by the module that owns it; any other place that decides it
# again is a second definition, which drifts from the first.
ONE_PLACE = {
    # the heal's source: the lowest replica holding the state, one rank per shard (Quorum.sources)
    "heal source": "ftrun.supervisor.ft.keeper.core",
    # whether workers fork from the zygote (RunConfig.use_zygote)
    "zygote": "ftrun.config",
    # --replica-size in a worker, parsed once (Settings.replica_size: int)
    "replica size": "ftrun.worker.settings",
}
# The registry of environment variables names every one (it reads none); the supervisor's worker
# environment writes FTRUN_REPLICA_SIZE from cfg.replica_size (it reads none either).
ENV_NAMED = {"FTRUN_ZYGOTE": {"ftrun.envvars"},
             "FTRUN_REPLICA_SIZE": {"ftrun.envvars", "ftrun.supervisor.workers.env"}}


def _names(node: ast.AST, *names: str) -> bool:
    """Whether `node` is the name, or an attribute by that name (`x.healers`)."""
    return (isinstance(node, ast.Name) and node.id in names) or (isinstance(node, ast.Attribute) and node.attr in names)


def second_definitions(trees: Dict[str, ast.AST]) -> List[str]:
    """Each place outside ONE_PLACE's owner that decides one of its rules again."""
    found = []
    for module, tree in trees.items():
        for node in ast.walk(tree):
            line = f"{module}:{getattr(node, 'lineno', '?')}"
            if module != ONE_PLACE["heal source"]:
                # The holders, from the healers (the first step of choosing the source), or a source written.
                if isinstance(node, ast.Compare) and any(isinstance(op, ast.NotIn) for op in node.ops) \
                        and any(_names(c, "healers") for c in node.comparators):
                    found.append(f"{line}: the heal source (holders taken from the healers): read quorum.source(shard)")
                if isinstance(node, ast.keyword) and node.arg == "sources":
                    found.append(f"{line}: the heal source (a Quorum's sources written)")
                if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in ("feeder_of", "source_replica"):
                    found.append(f"{line}: the heal source ({node.name} defined)")
            if module != ONE_PLACE["zygote"]:
                if isinstance(node, ast.Constant) and node.value == "FTRUN_ZYGOTE" \
                        and module not in ENV_NAMED["FTRUN_ZYGOTE"]:
                    found.append(f"{line}: the zygote decision (FTRUN_ZYGOTE read): read cfg.use_zygote")
                if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) \
                        and node.slice.value == "use_zygote":
                    found.append(f"{line}: the zygote decision (use_zygote set)")
            if module != ONE_PLACE["replica size"]:
                if isinstance(node, ast.Constant) and node.value == "FTRUN_REPLICA_SIZE" \
                        and module not in ENV_NAMED["FTRUN_REPLICA_SIZE"]:
                    found.append(f"{line}: the replica size (FTRUN_REPLICA_SIZE read): read settings.current().replica_size")
                if isinstance(node, ast.Call) and _names(node.func, "int") \
                        and any(_names(n, "replica_size") for a in node.args for n in ast.walk(a)):
                    found.append(f"{line}: the replica size (parsed again; it is an int)")
                if isinstance(node, ast.Compare) and _names(node.left, "replica_size") \
                        and any(isinstance(c, ast.Constant) and isinstance(c.value, str) for c in node.comparators):
                    found.append(f"{line}: the replica size (compared as text; it is an int)")
    return found


@pytest.mark.quick
def test_each_rule_has_one_definition():
    """The heal source is the keeper core's (workers read Quorum.source), the zygote decision is
    build_config's (RunConfig.use_zygote), the replica size is the worker settings'
    (Settings.replica_size): nothing else in ftrun/ decides them again."""
    found = second_definitions(TREES)
    assert not found, "a rule decided a second time (see ONE_PLACE in tests/test_house.py):\n" + "\n".join(found)


def test_the_one_place_rule_finds_second_definitions():
    samples = {
        "ftrun.worker.ft.heal.feed": "holders = [r for r in members if r not in healers]",
        "ftrun.worker.ft.member.core": "holders = [r for r in q.ranks if r not in q.healers]",
        "ftrun.cli": "z = os.environ.get('FTRUN_ZYGOTE', '1') != '0'",
        "ftrun.worker.ft.manager": "k = int(os.environ.get('FTRUN_REPLICA_SIZE', '1'))",
        "ftrun.worker.frameworks.fabric": "bad = s.replica_size != '1'",
        "ftrun.worker.frameworks.script_loop": "k = max(1, int(s.replica_size or '1'))",
    }
    found = second_definitions({m: ast.parse(src) for m, src in samples.items()})
    assert [f.split(":")[0] for f in found] == list(samples), found
    owners = {ONE_PLACE["heal source"]: "q = Quorum(1, (), sources=(0,)); h = [r for r in m if r not in healers]",
              ONE_PLACE["zygote"]: "kw['use_zygote'] = environ.get('FTRUN_ZYGOTE', '1') != '0'",
              ONE_PLACE["replica size"]: "k = int(env.get('FTRUN_REPLICA_SIZE') or 1)"}
    assert second_definitions({m: ast.parse(src) for m, src in owners.items()}) == []


# ---------------------------------------------------------------------------
# A member's reports are read by attribute (report.quorum_id), never by string key
# (info.get("quorum_id"), info["round"], "round" in info): a key read past the codec is a second
# definition of the format, which drifts from the writer's (the quorum id was once read as
# "epoch" in five places). The codecs' fields are read from ftrun/wire.py itself.
REPORTS = ("MemberReport", "SurvivorReport")
REPORT_READERS = "ftrun.supervisor"
# Words the supervisor's other payloads use too (a checkpoint's record has a "step"): a string-key
# read of one is flagged only in the keeper and its views, which read no other payload by it.
SHARED_WORDS = {"step"}
KEEPER = "ftrun.supervisor.ft"


def report_fields(wire: ast.AST) -> Set[str]:
    """The fields of the report codecs in ftrun/wire.py, and the quorum id's old word."""
    found = {"epoch"}
    for node in ast.walk(wire):
        if isinstance(node, ast.ClassDef) and node.name in REPORTS:
            found |= {n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    return found


def _key_read(node: ast.AST) -> object:
    """The constant key `node` reads by (x["k"], x.get("k"), x.pop("k"), "k" in x), else None."""
    if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and isinstance(node.slice, ast.Constant):
        return node.slice.value
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("get", "pop") \
            and node.args and isinstance(node.args[0], ast.Constant):
        return node.args[0].value
    if isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant) \
            and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
        return node.left.value
    return None


def report_key_reads(trees: Dict[str, ast.AST], names: Set[str]) -> List[str]:
    """Each string-key read of a report field in the supervisor."""
    found = []
    for module, tree in trees.items():
        if module != REPORT_READERS and not module.startswith(REPORT_READERS + "."):
            continue
        keeper = module == KEEPER or module.startswith(KEEPER + ".")
        for node in ast.walk(tree):
            key = _key_read(node)
            if isinstance(key, str) and key in names and (keeper or key not in SHARED_WORDS):
                found.append(f"{module}:{node.lineno}: {ast.unparse(node)}")
    return found


# The member's state is the driver's (ftrun/worker/ft/member/driver.py): its parts (entry, heal,
# stop, moves, as `self.d`) and the script's side (the Manager and ftrun.ft's classes, as `member`)
# read it and call the driver's methods; a write from elsewhere is a second owner of a field.
MEMBER_OWNER = "ftrun.worker.ft.member.driver"
WORKER = "ftrun.worker"
DRIVER_ATTRS = {"d", "member"}  # self.d, mgr.member
DRIVER_NAMES = {"driver"}


def _names_driver(node: ast.AST, names: Set[str]) -> bool:
    """`node` (what an assignment writes into) is the driver or a part it holds: a chain through
    `.d` or `.member` (`self.d`, `self.d.iteration`, `mgr.member.layout`), or a local name bound
    to one (`d = self.d`)."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        if isinstance(node, ast.Attribute) and node.attr in DRIVER_ATTRS:
            return True
        node = node.value
    return isinstance(node, ast.Name) and node.id in names


def member_state_writes(trees: Dict[str, ast.AST]) -> List[str]:
    """Each assignment into the member driver's state in a worker-side module other than the driver's."""
    found = []
    for module, tree in trees.items():
        if module == MEMBER_OWNER or not (module == WORKER or module.startswith(WORKER + ".")):
            continue
        for scope in [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
            body = [n for stmt in scope.body for n in ast.walk(stmt)]
            names = set(DRIVER_NAMES) | {t.id for n in body if isinstance(n, ast.Assign) and _names_driver(n.value, set())
                                         for t in n.targets if isinstance(t, ast.Name)}
            for node in body:
                targets = (node.targets if isinstance(node, ast.Assign) else
                           [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
                for target in targets:
                    for t in (target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target]):
                        if isinstance(t, (ast.Attribute, ast.Subscript)) and _names_driver(t.value, names):
                            found.append(f"{module}:{node.lineno}: {ast.unparse(node)[:100]}")
    return sorted(set(found), key=found.index)


@pytest.mark.quick
def test_only_the_driver_writes_the_members_state():
    found = member_state_writes(TREES)
    assert not found, ("the member driver's state written outside member/driver.py: call a method of the "
                       "driver (or return what it should do) instead:\n" + "\n".join(found))


def test_the_member_state_rule_finds_writes_and_nothing_else():
    flagged = {
        "ftrun.worker.ft.member.heal": "self.d.in_sync = True",
        "ftrun.worker.ft.member.stop": "d = self.d\nd.step += 1",
        "ftrun.worker.ft.member.entry": "self.d.iteration.done, x = 2, 3",
        "ftrun.worker.ft.api.data": "self.mgr.member.layout.round = False",
        "ftrun.worker.ft.manager": "self.member.looping = True",
    }
    found = member_state_writes({m: ast.parse(src) for m, src in flagged.items()})
    assert [f.split(":")[0] for f in found] == list(flagged), found
    passed = {
        "ftrun.worker.ft.member.driver": "self.step += 1; self.iteration.done = 0",  # the owner
        "ftrun.worker.ft.member.heal": "self.d = driver; self.count = 0; n = self.d.step",
        "ftrun.worker.ft.heal.feed": "def f(v):\n    d = {}\n    d['k'] = v",  # a dict of its own
        "ftrun.worker.ft.manager": "self.member = MemberDriver(); self.member.set_looping(True)",
        "ftrun.sim.worker": "self.driver.step = 3",  # the simulator, not a part of the worker
    }
    assert member_state_writes({m: ast.parse(src) for m, src in passed.items()}) == []


# The member core's commands that act (member/core.py) are carried out in one place,
# MemberDriver.execute: a part that branched on one would be a second interpreter, with its own
# idea of what a Restart means (whether it is charged to --max-restarts, what it says). The two
# questions (AskEntryRound, MoveState) are answered by the part that asked.
ACTIONS = {"Join", "Switch", "TakeStep", "Backoff", "ReadFinished", "Finish", "Restart", "Rejoin", "SitOut",
           "EndRun"}
EXECUTOR = "ftrun.worker.ft.member.driver"


def command_branches(trees: Dict[str, ast.AST]) -> List[str]:
    """Each isinstance() test against a member command that acts, outside the driver."""
    found = []
    for module, tree in trees.items():
        if module == EXECUTOR or not module.startswith("ftrun."):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance" \
                    and len(node.args) == 2:
                kinds = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
                if any(isinstance(k, ast.Name) and k.id in ACTIONS for k in kinds):
                    found.append(f"{module}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_members_commands_are_carried_out_by_the_driver_alone():
    found = command_branches(TREES)
    assert not found, ("a member command branched on outside MemberDriver.execute: hand the commands to "
                       "driver.execute instead:\n" + "\n".join(found))
    planted = {"ftrun.worker.ft.member.entry": "for c in cs:\n    if isinstance(c, Restart): pass",
               "ftrun.worker.ft.member.heal": "any(isinstance(c, (Backoff, Finish)) for c in cs)"}
    assert [f.split(":")[0] for f in command_branches({m: ast.parse(t) for m, t in planted.items()})] == list(planted)
    passed = {"ftrun.worker.ft.member.entry": "any(isinstance(c, AskEntryRound) for c in cs)",
              EXECUTOR: "isinstance(c, Restart)", "ftrun.sim.world": "isinstance(e, Died)"}
    assert command_branches({m: ast.parse(t) for m, t in passed.items()}) == []


# The tests' shared helpers, each defined once in tests/helpers.py or tests/conftest.py: a test
# file's own copy drifts from it, and a weaker copy (a wait with no bound, a comparison of the
# parameters alone) lets a test pass with its feature missing. Name: what to use instead.
TESTS = Path(__file__).resolve().parent
SHARED_HELPERS = {
    "_wait": "helpers.wait_for, wait_state or wait_replica",
    "_wait_for": "helpers.wait_for",
    "_wait_replica": "helpers.wait_replica",
    "wait_for": "helpers.wait_for",
    "wait_state": "helpers.wait_state",
    "wait_replica": "helpers.wait_replica",
    "_assert_identical": "helpers.assert_identical",
    "assert_identical": "helpers.assert_identical",
    "start_ftrun": "conftest.start_ftrun (files=... for its output in files)",
    "_reports": "helpers.read_reports",
    "read_reports": "helpers.read_reports",
    "start_logged": "conftest.start_ftrun(..., files=(\"stderr\",))",
}
HELPER_HOMES = {"helpers.py", "conftest.py"}


def helper_copies(trees: Dict[str, ast.AST]) -> List[str]:
    """Each definition of a SHARED_HELPERS name in a file of `trees` ({absolute path: tree}) other than
    the helpers' homes, at any depth (a copy nested in a test is a copy too)."""
    found = []
    for path, tree in trees.items():
        if Path(path).name in HELPER_HOMES and Path(path).parent == TESTS:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in SHARED_HELPERS:
                found.append(f"{path}:{node.lineno}: {node.name} defined again: use {SHARED_HELPERS[node.name]}")
    return found


@pytest.mark.quick
def test_the_supervisor_reads_member_reports_by_their_fields():
    names = report_fields(TREES["ftrun.wire"])
    assert {"inc", "quorum_id", "round", "phase", "step", "discarded", "in_sync", "latest", "version"} <= names
    found = report_key_reads(TREES, names)
    assert not found, ("a member report read by string key: read its field (ftrun.wire MemberReport, "
                       "SurvivorReport):\n" + "\n".join(found))


def test_the_report_rule_finds_key_reads_and_nothing_else():
    names = report_fields(TREES["ftrun.wire"])
    flagged = {
        "ftrun.supervisor.ft.keeper.core": "live = info.get('epoch')",
        "ftrun.supervisor.ft.keeper.dead": "r = int(info['round'])",
        "ftrun.supervisor.ft.keeper.spares": "ok = 'phase' in info",
        "ftrun.supervisor.ft.quorum_view": "n = d.get('step') or 0",
        "ftrun.supervisor.accounting.waits": "since = d.get('phase_since')",
    }
    found = report_key_reads({m: ast.parse(src) for m, src in flagged.items()}, names)
    assert [f.split(":")[0] for f in found] == list(flagged), found
    passed = {
        "ftrun.supervisor.ft.keeper.core": "word = {'step': 3, 'ok': False}; w = info.quorum_id; p = status['ft_phase']",
        "ftrun.supervisor.accounting.checkpoints": "s = ck.get('step'); t = ck['time']",
        "ftrun.supervisor.ft.keeper.dead": "info['round'] = 3",  # a write, not a read
        "ftrun.status.render": "q = r.get('in_quorum')",  # the state file's fields, outside the supervisor
        "ftrun.sim.world": "x = info.get('epoch')",
    }
    assert report_key_reads({m: ast.parse(src) for m, src in passed.items()}, names) == []


@pytest.mark.quick
def test_test_files_never_define_the_shared_helpers_again():
    trees = {str(p): ast.parse(p.read_text(), str(p)) for p in sorted(TESTS.rglob("*.py"))}
    found = helper_copies(trees)
    assert not found, "a shared test helper defined again (see SHARED_HELPERS in tests/test_house.py):\n" + "\n".join(found)


def test_the_helper_rule_finds_copies():
    samples = {
        str(TESTS / "test_a.py"): "def _wait(pred, timeout):\n    pass\n",
        str(TESTS / "test_b.py"): "def test_x():\n    def _assert_identical(out, world):\n        pass\n",
        str(TESTS / "test_c.py"): "def start_ftrun(args, env=None):\n    pass\n",
        str(TESTS / "test_d.py"): "async def _reports(out):\n    pass\n",
        str(TESTS / "sub" / "helpers.py"): "def _wait():\n    pass\n",  # only tests/helpers.py is a home
    }
    found = helper_copies({p: ast.parse(src) for p, src in samples.items()})
    assert [f.split(":")[0] for f in found] == list(samples), found
    homes = {str(TESTS / "helpers.py"): "def wait_for(pred, timeout, what):\n    pass\n",
             str(TESTS / "conftest.py"): "def start_ftrun(args):\n    pass\n",
             str(TESTS / "test_e.py"): "def _wait_printed(proc):\n    pass\ndef _run(x):\n    pass\n"}
    assert helper_copies({p: ast.parse(src) for p, src in homes.items()}) == []
