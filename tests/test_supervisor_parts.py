"""The supervisor's parts own their state: no field of the Supervisor or the NodeCoordinator is
written in two modules, neither is built of mixins, no field of the quorum keeper is written outside
its modules, the node watch works from what it is sent, the store's moves are decided from a view,
the supervisor's packages keep their layers, and the failure policy
(ftrun.supervisor.policy.failure_policy) decides in-process, from tables of events."""

from __future__ import annotations

import ast
import pathlib
from typing import Dict, Set

import pytest

SUPERVISOR = pathlib.Path(__file__).resolve().parent.parent / "ftrun" / "supervisor"


def _classes() -> Dict[str, tuple]:
    """Every class of ftrun/supervisor: name -> (module path, its ast node)."""
    out = {}
    for path in sorted(SUPERVISOR.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                out.setdefault(node.name, (path, node))
    return out


def _field_roots(target: ast.AST):
    """The `self.X` a target writes: `self.X = `, `self.X[k] = `, `self.X.y = `, tuples of them."""
    if isinstance(target, (ast.Tuple, ast.List)):
        for e in target.elts:
            yield from _field_roots(e)
        return
    if isinstance(target, ast.Starred):
        yield from _field_roots(target.value)
        return
    while isinstance(target, (ast.Attribute, ast.Subscript)):
        if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
            yield target.attr
            return
        target = target.value


def _writes(name: str) -> Dict[str, Set[str]]:
    """Field of class `name` (with every base class defined in ftrun/supervisor) -> the modules
    where a method of the class or of a base assigns it."""
    classes = _classes()
    out: Dict[str, Set[str]] = {}
    todo, seen = [name], set()
    while todo:
        cls = todo.pop()
        if cls in seen or cls not in classes:
            continue
        seen.add(cls)
        path, node = classes[cls]
        todo += [b.id for b in node.bases if isinstance(b, ast.Name)]
        for sub in ast.walk(node):
            targets = (sub.targets if isinstance(sub, ast.Assign) else
                       [sub.target] if isinstance(sub, (ast.AugAssign, ast.AnnAssign)) else [])
            for t in targets:
                for field in _field_roots(t):
                    out.setdefault(field, set()).add(str(path.relative_to(SUPERVISOR)))
    return out


@pytest.mark.quick
@pytest.mark.parametrize("name", ["Supervisor", "NodeCoordinator"])
def test_no_field_written_in_two_modules(name):
    twice = {f: sorted(m) for f, m in _writes(name).items() if len(m) > 1}
    assert not twice, f"{name}'s fields written in two modules or more: {twice}"


@pytest.mark.quick
@pytest.mark.parametrize("name", ["Supervisor", "NodeCoordinator"])
def test_no_mixins(name):
    _, node = _classes()[name]
    assert not node.bases, f"{name} is built of mixins: {[ast.unparse(b) for b in node.bases]}"


@pytest.mark.quick
def test_node_watch_works_from_what_it_is_sent():
    """The watch thread never holds the coordinator: it is sent a plan, the coordinator reads a snapshot."""
    src = (SUPERVISOR / "nodes" / "node_watch.py").read_text()
    assert "NodeCoordinator" not in src and "self.coord" not in src and "nodes.coordinator" not in src
    assert "WatchPlan" in src and "def view(" in src


@pytest.mark.quick
def test_no_module_writes_the_coordinators_fields():
    """Only nodes/coordinator.py writes a field of the NodeCoordinator (the loop holds it as `self.nodes`)."""
    for path in sorted(SUPERVISOR.rglob("*.py")):
        if path.name == "coordinator.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = (node.targets if isinstance(node, ast.Assign) else
                       [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            for t in targets:
                while isinstance(t, ast.Subscript):
                    t = t.value
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Attribute):
                    assert t.value.attr != "nodes", f"{path.name}:{node.lineno} writes the coordinator's {t.attr}"


@pytest.mark.quick
def test_node_modules_import_no_circle():
    """nodes/coordinator.py builds on node_*.py; none of them imports it back (not even for type hints).
    node_decisions.py is the loop's, which holds the coordinator."""
    for path in sorted(p for p in (SUPERVISOR / "nodes").glob("node_*.py") if p.name != "node_decisions.py"):
        tree = ast.parse(path.read_text())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        names += [f"{n.module}.{a.name}" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names]
        assert "ftrun.supervisor.nodes.coordinator" not in names, f"{path.name} imports nodes/coordinator.py"



@pytest.mark.quick
def test_store_moves_are_decided_from_a_view():
    """node_moves.py's functions are given a MoveView (and what they write to), never the coordinator."""
    tree = ast.parse((SUPERVISOR / "nodes" / "node_moves.py").read_text())
    for fn in [n for n in tree.body if isinstance(n, ast.FunctionDef)]:
        assert fn.args.args[0].arg == "v" and ast.unparse(fn.args.args[0].annotation) == "MoveView", fn.name


def _moves(me=1, host=0, size=3, others=(0, 2), lost=(), can_move=True, elastic=False, ft=True, has_store=True):
    from ftrun.supervisor.nodes.node_moves import MoveView
    return MoveView(me, host, size, tuple(sorted({me, *others})), others, lost, can_move, elastic, ft, has_store)


MOVES_TABLE = [
    # (why, view, may_move, may_move_between_rounds, majority_kept)
    ("a node beside the host, three nodes, --ft: it may move the store", _moves(), True, False, True),
    ("two nodes: no majority can move the store", _moves(size=2, others=(0,)), False, False, True),
    ("the host itself never moves it", _moves(me=0, others=(1, 2)), False, False, True),
    ("no standby store here", _moves(has_store=False), False, False, True),
    ("c10d without --ft: the rounds move it", _moves(can_move=False, ft=False, elastic=True), False, True, True),
    ("the host that lost one of three keeps half or more: it goes on",
     _moves(me=0, others=(1, 2), lost=(2,)), False, False, True),
    ("the host that lost two of three stops: the others may move the store",
     _moves(me=0, others=(1, 2), lost=(1, 2)), False, False, False),
    ("elastic: the host needs more than half (two of four is not enough)",
     _moves(me=0, size=4, others=(1, 2, 3), lost=(2, 3), elastic=True), False, False, False),
    ("static: two of four is half, enough", _moves(me=0, size=4, others=(1, 2, 3), lost=(2, 3)), False, False, True),
]


@pytest.mark.quick
@pytest.mark.parametrize("why,view,move,between,kept", MOVES_TABLE, ids=[row[0] for row in MOVES_TABLE])
def test_store_move_rules_table(why, view, move, between, kept):
    from ftrun.supervisor.nodes import node_moves
    assert (node_moves.may_move(view), node_moves.may_move_between_rounds(view), node_moves.majority_kept(view)) == \
        (move, between, kept)


def _supervisor_imports():
    """(module, imported module) for every import of ftrun.supervisor.* in ftrun/supervisor (any
    level: in functions and for type checkers too), both as paths under ftrun/supervisor."""
    for path in sorted(SUPERVISOR.rglob("*.py")):
        me = str(path.relative_to(SUPERVISOR))
        for n in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in n.names] if isinstance(n, ast.Import) else
                     [f"{n.module}.{a.name}" for a in n.names] if isinstance(n, ast.ImportFrom) and n.module else [])
            for name in names:
                parts = name.split(".")[2:] if name.startswith("ftrun.supervisor.") else []
                while parts and not (SUPERVISOR.joinpath(*parts).with_suffix(".py").exists()
                                     or SUPERVISOR.joinpath(*parts).is_dir()):
                    parts.pop()
                if parts:
                    yield me, "/".join(parts)


# Who may import the loop from outside: the c10d rendezvous, which runs it once per round.
# The supervisor's packages, top floor first: each imports only its own floor and those below it (any
# level of import, for type checkers too), so no arrow runs back up. The ground holds the run's store
# and the node relays' routes, which the keeper and the loop both use.
FLOORS = ["loop", "nodes", "ft", "policy", "accounting", "workers", "ground"]


def _floor(module: str) -> int:
    top = module.split("/")[0]
    return FLOORS.index(top if top in FLOORS else "ground")


@pytest.mark.quick
def test_the_supervisors_packages_keep_their_floors():
    """loop/ over nodes/ over ft/ over policy/ over accounting/ over workers/ over the store: a
    module imports only its own package and those below it. So no component imports the loop that
    applies its actions, accounting/ (which tells) imports nothing that decides, and workers/ is the base."""
    bad = [f"{me} imports {it}: {FLOORS[_floor(it)]}/ is above {FLOORS[_floor(me)]}/"
           for me, it in _supervisor_imports() if _floor(it) < _floor(me)]
    assert not bad, bad
    mods = {m for m, _ in _supervisor_imports()}
    assert mods >= {"loop/run.py", "loop/c10d.py", "policy/failures.py", "nodes/coordinator.py", "ft/quorum.py"}
    assert {FLOORS[_floor(m)] for m in mods} == set(FLOORS) - {"workers"}  # workers/ imports none of them


# The keeper's own modules: its shell and components (quorum*.py) and its core (keeper/).
KEEPER_MODULES = tuple(f"supervisor/ft/{m}" for m in ("quorum.py", "quorum_status.py", "quorum_votes.py", "keeper/"))
MUTATORS = {"update", "add", "append", "extend", "clear", "pop", "popitem", "discard", "remove",
            "setdefault", "insert"}


def _keeper_fields() -> Set[str]:
    """The QuorumKeeper's fields and properties (what `self.X` names in its class)."""
    _, node = _classes()["QuorumKeeper"]
    props = {f.name for f in node.body if isinstance(f, ast.FunctionDef)
             and any(isinstance(d, ast.Name) and d.id == "property" for d in f.decorator_list)}
    return set(_writes("QuorumKeeper")) | props


def _keeper_holders(func: ast.AST) -> Set[str]:
    """The local names through which a function holds a keeper: a parameter annotated QuorumKeeper,
    a name bound to a new keeper, or to another holder (`q = self.quorum`)."""
    names = {"quorum", "keeper"}
    args = func.args.args + func.args.kwonlyargs if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)) else []
    names |= {a.arg for a in args if a.annotation is not None and "QuorumKeeper" in ast.unparse(a.annotation)}
    for _ in range(2):
        for n in ast.walk(func):
            if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name):
                v = n.value
                if (isinstance(v, ast.Call) and "QuorumKeeper" in ast.unparse(v.func)) or _holds_keeper(v, names):
                    names.add(n.targets[0].id)
    return names


def _holds_keeper(e: ast.AST, names: Set[str]) -> bool:
    return (isinstance(e, ast.Name) and e.id in names) or (isinstance(e, ast.Attribute) and e.attr == "quorum")


def _keeper_field_written(target: ast.AST, names: Set[str], fields: Set[str]):
    """The keeper's field a target (`quorum.X = `, `quorum.X[k] = `, `self.quorum.X.y = `) writes, if any."""
    while isinstance(target, (ast.Attribute, ast.Subscript)):
        if isinstance(target, ast.Attribute) and _holds_keeper(target.value, names) and target.attr in fields:
            return target.attr
        target = target.value
    return None


def keeper_writes_outside(root: pathlib.Path) -> list:
    """'module:line field' for each write of a keeper's field outside the keeper's own modules."""
    fields, found = _keeper_fields(), []
    for path in sorted(root.rglob("*.py")):
        rel = str(path.relative_to(SUPERVISOR.parent))
        if rel.startswith(KEEPER_MODULES):
            continue
        tree = ast.parse(path.read_text())
        for func in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
            names = _keeper_holders(func)
            for n in ast.walk(func):
                targets = (n.targets if isinstance(n, ast.Assign) else
                           [n.target] if isinstance(n, (ast.AugAssign, ast.AnnAssign)) else
                           [n.func.value] if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                           and n.func.attr in MUTATORS else [])
                for t in targets:
                    field = _keeper_field_written(t, names, fields)
                    if field:
                        found.append(f"{rel}:{n.lineno} {field}")
    return sorted(set(found))


@pytest.mark.quick
def test_no_field_of_the_keeper_is_written_outside_its_modules():
    """The keeper (quorum.QuorumKeeper) owns its fields: the loop and the node news ask it through a
    method (store_moved) instead of setting its books from outside."""
    assert "fresh_start" in _keeper_fields() and "alive" in _keeper_fields()
    found = keeper_writes_outside(SUPERVISOR) + keeper_writes_outside(SUPERVISOR.parent / "sim")
    assert not found, f"fields of the QuorumKeeper written outside its modules: {found}"


# ---------------------------------------------------------------- the failure policy, in-process
from ftrun.supervisor.policy.failure_policy import (OTHERS_FINISHED, REPEATED, WHILE_SAVING, FailurePolicy,  # noqa: E402
                                     GroupFailed, ReplicaFailed, RestartAction, RestartVerdict)
from ftrun.supervisor.policy.restart import Repeats  # noqa: E402

V = RestartVerdict


def _run(policy: FailurePolicy, events) -> list:
    return [policy.on_replica_failure(e) if isinstance(e, ReplicaFailed) else policy.on_group_failure(e)
            for e in events]


REPLICA_TABLE = [
    # (max_restarts, min_replicas, events, expected actions)
    ("restart within the budget, then drop, then give up below --min-replicas",
     2, 2,
     [ReplicaFailed(1, 3), ReplicaFailed(1, 3), ReplicaFailed(1, 3), ReplicaFailed(2, 1)],
     [RestartAction(V.RESTART_REPLICA, 1, 1), RestartAction(V.RESTART_REPLICA, 1, 2),
      RestartAction(V.DROP_REPLICA, 1, 2), RestartAction(V.RESTART_REPLICA, 2, 1)]),
    ("each replica has its own budget",
     1, 1,
     [ReplicaFailed(0, 2), ReplicaFailed(1, 2), ReplicaFailed(0, 2), ReplicaFailed(1, 0)],
     [RestartAction(V.RESTART_REPLICA, 0, 1), RestartAction(V.RESTART_REPLICA, 1, 1),
      RestartAction(V.DROP_REPLICA, 0, 1), RestartAction(V.GIVE_UP, 1, 1)]),
    ("a restart the peers forced is charged to no budget",
     1, 1,
     [ReplicaFailed(0, 1, by_peers=True), ReplicaFailed(0, 1, by_peers=True), ReplicaFailed(0, 1)],
     [RestartAction(V.RESTART_REPLICA, 0, 0, counted=False), RestartAction(V.RESTART_REPLICA, 0, 0, counted=False),
      RestartAction(V.RESTART_REPLICA, 0, 1)]),
    ("the same early failure twice in a row is not retried, whatever budget is left",
     5, 1,
     [ReplicaFailed(0, 1, "E at x.py:3"), ReplicaFailed(0, 1, "E at x.py:3")],
     [RestartAction(V.RESTART_REPLICA, 0, 1), RestartAction(V.DROP_REPLICA, 0, 1, why=REPEATED)]),
    ("a failure after a step breaks the run of repeats",
     5, 1,
     [ReplicaFailed(0, 1, "E"), ReplicaFailed(0, 1), ReplicaFailed(0, 1, "E")],
     [RestartAction(V.RESTART_REPLICA, 0, 1), RestartAction(V.RESTART_REPLICA, 0, 2),
      RestartAction(V.RESTART_REPLICA, 0, 3)]),
    ("nothing restarts while the run saves, or once others finished; no budget is spent",
     1, 1,
     [ReplicaFailed(0, 1, saving=True), ReplicaFailed(0, 1, others_done=True), ReplicaFailed(0, 1)],
     [RestartAction(V.NOT_RESTARTED, 0, why=WHILE_SAVING), RestartAction(V.NOT_RESTARTED, 0, why=OTHERS_FINISHED),
      RestartAction(V.RESTART_REPLICA, 0, 1)]),
    ("no budget: the replica is dropped at once, or the run gives up",
     0, 2,
     [ReplicaFailed(3, 2), ReplicaFailed(2, 1)],
     [RestartAction(V.DROP_REPLICA, 3, 0), RestartAction(V.GIVE_UP, 2, 0)]),
]


@pytest.mark.quick
@pytest.mark.parametrize("why,max_restarts,min_replicas,events,expected", REPLICA_TABLE,
                         ids=[row[0] for row in REPLICA_TABLE])
def test_replica_policy_table(why, max_restarts, min_replicas, events, expected):
    policy = FailurePolicy(True, max_restarts, min_replicas)
    assert not policy.group and policy.name == "replica restart (ft)"
    assert _run(policy, events) == expected


GROUP_TABLE = [
    ("restart the group within the budget, then give up",
     2, [GroupFailed(0), GroupFailed(3), GroupFailed(1)],
     [RestartAction(V.RESTART_GROUP, restarts=1), RestartAction(V.RESTART_GROUP, restarts=2),
      RestartAction(V.GIVE_UP, restarts=2)]),
    ("c10d without --ft: a failure past the round's budget ends the round, for the nodes to re-form",
     0, [GroupFailed(0, can_reform=True)], [RestartAction(V.END_ROUND)]),
    ("the same early failure twice in a row gives up, even where the round could re-form",
     3, [GroupFailed(0, "E at x.py:3"), GroupFailed(1, "E at x.py:3", can_reform=True)],
     [RestartAction(V.RESTART_GROUP, restarts=1), RestartAction(V.GIVE_UP, restarts=1, why=REPEATED)]),
]


@pytest.mark.quick
@pytest.mark.parametrize("why,max_restarts,events,expected", GROUP_TABLE, ids=[row[0] for row in GROUP_TABLE])
def test_group_policy_table(why, max_restarts, events, expected):
    policy = FailurePolicy(False, max_restarts)
    assert policy.group and policy.name == "group restart"
    assert _run(policy, events) == expected
    assert policy.group_restarts == expected[-1].restarts


@pytest.mark.quick
def test_repeats_span_the_rounds_of_a_c10d_run():
    """Each c10d round has its own policy; the repeats they share end a run whose script fails alike."""
    repeats = Repeats()
    first = FailurePolicy(False, 0, repeats=repeats).on_group_failure(GroupFailed(0, "E", can_reform=True))
    second = FailurePolicy(False, 0, repeats=repeats).on_group_failure(GroupFailed(0, "E", can_reform=True))
    assert (first.verdict, second.verdict, second.why) == (V.END_ROUND, V.GIVE_UP, REPEATED)


@pytest.mark.quick
def test_plain_script_under_ft_turns_to_group_restarts_afresh():
    policy = FailurePolicy(True, 1, 1)
    assert policy.on_replica_failure(ReplicaFailed(0, 1)).verdict is V.RESTART_REPLICA
    policy.to_group_restarts()
    assert policy.group and policy.name == "group restart"
    assert [a.verdict for a in _run(policy, [GroupFailed(0), GroupFailed(0)])] == [V.RESTART_GROUP, V.GIVE_UP]


# ------------------------------------------------------------ the quorum's view: what the console says
class _Keeper:
    """The fields and calls of ftrun.supervisor.ft.quorum.QuorumKeeper that QuorumView reads, set
    by the test from tick to tick (the keeper's own decisions are tested in test_keeper_core)."""

    def __init__(self) -> None:
        self.quorum_id, self.fresh_quorums, self.fresh_start = 2, set(), "resuming from the newest checkpoint"
        self.history, self.info, self.members_in = [], {}, set()
        self.booked_in_place: list = []  # what take_rejoined hands over at the next tick

    def poll(self, now: float) -> None:
        pass

    def take_rejoined(self) -> list:
        taken, self.booked_in_place = self.booked_in_place, []
        return taken

    def take_history(self) -> list:
        taken, self.history = self.history, []
        return taken

    def in_quorum(self, rank: int) -> bool:
        return rank in self.members_in


@pytest.mark.quick
@pytest.mark.parametrize("fresh_seen", [True, False])
def test_a_replica_back_from_a_checkpoint_is_said_so_even_after_a_re_paced_quorum(capsys, fresh_seen):
    """Every holder died; the restarted replica enters the fresh quorum 3, and a re-paced quorum 4 of
    the same members may follow before a tick sees it training (a zygote-started replica resumes a
    small checkpoint in 0.2 s). Either way the console says it came back from the checkpoint, never
    'healed from a peer' (which the quorum current when it was seen training alone made it say)."""
    from ftrun.supervisor.accounting.progress_reader import ProgressReader
    from ftrun.supervisor.ft.quorum_view import QuorumView
    from ftrun.supervisor.workers.logs import ConsoleOut
    from ftrun.supervisor.workers.worker import Failure, Worker, WorkerSpec, WorkerState

    view, q = QuorumView(ConsoleOut(), 1), _Keeper()
    w = Worker(WorkerSpec(0, 0), state=WorkerState.RECOVERING, incarnation=1)
    w.last_failure = Failure(0, None, None, 9, "killed by SIGKILL", when=100.0)
    progress = ProgressReader(lambda: None)
    view.poll(q, None, [w], progress, 100.1, False, q.quorum_id)  # restarted, not in a quorum yet
    q.quorum_id, q.fresh_quorums, q.members_in = 3, {3}, {0}
    if not fresh_seen:
        q.quorum_id = 4  # re-paced before the next tick
    news = view.poll(q, None, [w], progress, 100.3, False, q.quorum_id)
    err = capsys.readouterr().err
    assert news.training == (0,)  # the loop's table marks it running
    assert "rank 0 is training again 0.30 s after it failed; no replica held the trained state" in err, err
    assert "healed from a peer" not in err


@pytest.mark.quick
def test_a_replica_healed_from_a_peer_is_said_so(capsys):
    from ftrun.supervisor.accounting.progress_reader import ProgressReader
    from ftrun.supervisor.ft.quorum_view import QuorumView
    from ftrun.supervisor.workers.logs import ConsoleOut
    from ftrun.supervisor.workers.worker import Failure, Worker, WorkerSpec, WorkerState

    view, q = QuorumView(ConsoleOut(), 1), _Keeper()
    q.fresh_quorums = {1}  # the run's first quorum: before the failure
    w = Worker(WorkerSpec(0, 0), state=WorkerState.RECOVERING, incarnation=1)
    w.last_failure = Failure(0, None, None, 9, "killed by SIGKILL", when=100.0)
    progress = ProgressReader(lambda: None)
    view.poll(q, None, [w], progress, 100.1, False, q.quorum_id)
    q.quorum_id, q.members_in = 3, {0}
    view.poll(q, None, [w], progress, 100.5, False, q.quorum_id)
    assert "rank 0 is training again, healed from a peer 0.50 s after it failed" in capsys.readouterr().err


# The worker table (loop/table.py) is the one place that sets a worker's state and signals workers;
# the worker record resets itself at a new incarnation (workers/worker.py), which only the table asks
# for; the spawners (workers/spawn.py) own their processes' starts and ends.
STATE_OWNERS = {"loop/table.py", "workers/worker.py"}
SIGNAL_OWNERS = {"loop/table.py", "workers/spawn.py"}
SIGNAL_CALLS = {"signal_group", "os.kill", "os.killpg", "signal.pthread_kill"}


def worker_state_and_signals_outside_owners(root: pathlib.Path) -> list:
    """'module:line what' for each write of a worker's state (`X.state = ...` of anything but a
    status record's word), each new incarnation begun, and each signal sent, outside their owners."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = str(path.relative_to(root))
        for n in ast.walk(ast.parse(path.read_text())):
            if rel not in STATE_OWNERS and isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = n.targets if isinstance(n, ast.Assign) else [n.target]
                for t in targets:
                    if (isinstance(t, ast.Attribute) and t.attr == "state"
                            and not (isinstance(n.value, ast.Constant) and isinstance(n.value.value, str))):
                        found.append(f"{rel}:{n.lineno} sets {ast.unparse(t)}")
            if isinstance(n, ast.Call):
                name = ast.unparse(n.func)
                if rel not in STATE_OWNERS and name.endswith(".begin_incarnation") and rel != "loop/table.py":
                    found.append(f"{rel}:{n.lineno} {name}")
                if rel not in SIGNAL_OWNERS and (name.split(".")[-1] in SIGNAL_CALLS or name in SIGNAL_CALLS
                                                 or name.endswith((".send_signal", ".terminate"))
                                                 or (name.endswith(".kill") and not n.args)):
                    found.append(f"{rel}:{n.lineno} signals: {name}")
    return found


@pytest.mark.quick
def test_only_the_worker_table_sets_a_workers_state_or_signals_it(tmp_path):
    """The components decide and return actions; the loop hands them to its table, which alone writes
    a worker's state and alone sends signals. A planted write and a planted signal are both found."""
    assert worker_state_and_signals_outside_owners(SUPERVISOR) == []
    planted = tmp_path / "policy"
    planted.mkdir()
    (planted / "rogue.py").write_text("import os\nfrom x import signal_group\n\ndef f(w):\n"
                                      "    w.state = WorkerState.FAILED\n    signal_group(w.pid, 9)\n    os.kill(w.pid, 9)\n")
    assert worker_state_and_signals_outside_owners(tmp_path) == [
        "policy/rogue.py:5 sets w.state", "policy/rogue.py:6 signals: signal_group", "policy/rogue.py:7 signals: os.kill"]


def _module_attribute_uses(root: pathlib.Path):
    """(module file, line, imported ftrun module, attribute) for each `alias.attr` where alias is a
    module of ftrun imported by name (`from ftrun.x import y as alias`, `import ftrun.x as alias`)."""
    import importlib.util

    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        aliases = {}
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("ftrun"):
                for a in n.names:
                    full = f"{n.module}.{a.name}"
                    if importlib.util.find_spec(n.module) and _is_module(full):
                        aliases[a.asname or a.name] = full
            elif isinstance(n, ast.Import):
                for a in n.names:
                    if a.name.startswith("ftrun.") and a.asname:
                        aliases[a.asname] = a.name
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in aliases:
                yield path, n.lineno, aliases[n.value.id], n.attr


def _is_module(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


@pytest.mark.quick
def test_every_attribute_read_of_a_supervisor_module_exists():
    """`nodes.NAME` for a module imported as `nodes` names something that module has: a name moved
    away (one_line went to ftrun.wire) must not be found only when the path that reads it runs."""
    import importlib

    missing = []
    for path, line, mod, attr in _module_attribute_uses(SUPERVISOR):
        if not hasattr(importlib.import_module(mod), attr):
            missing.append(f"{path.relative_to(SUPERVISOR)}:{line} {mod}.{attr}")
    assert missing == []


# ------------------------------------------------------------ the reactions the simulator runs too
def test_a_failed_replicas_running_mates_are_stopped_and_it_restarts_past_every_record():
    """ftrun.supervisor.workers.replica: the worker table and the simulator's supervisor stop the
    same mates and give a restart the same incarnation (one past the newest record, a rejoin
    booked in place included)."""
    from ftrun.supervisor.workers import replica

    running = {4, 6, 7}
    assert list(replica.ranks_of(1, 4)) == [4, 5, 6, 7]
    assert replica.stopped_with(1, 4, 6, running.__contains__) == [4, 7]  # 5 is gone, 6 failed
    assert replica.stopped_with(2, 1, 2, running.__contains__) == []
    assert replica.next_incarnation([3, 5, 3]) == 6


def test_the_stop_save_outcome_waits_only_while_a_word_may_still_come():
    from ftrun.supervisor.accounting.checkpoints import stop_outcome

    assert stop_outcome(None, 5.0, 0.0, 10.0, True) is None  # no word yet, in time, a writer lives
    assert "no worker is left" in stop_outcome(None, 5.0, 0.0, 10.0, False)[0]
    assert "within --shutdown-timeout (10 s" in stop_outcome(None, 10.0, 0.0, 10.0, True)[0]
    line, style = stop_outcome({"ok": True, "step": 40, "path": "/ck/step_40"}, 2.5, 0.0, 10.0, True)
    assert "checkpoint of step 40 written to /ck/step_40 in 2.5 s" in line and style == "bold yellow"
    assert "failed before stopping: disk full" in stop_outcome({"step": 40, "why": "disk full"}, 1, 0, 10, True)[0]
    assert "no checkpoint before stopping: the loop had ended" in stop_outcome(
        {"nothing": True, "why": "the loop had ended"}, 1, 0, 10, True)[0]
    assert stop_outcome({}, 1.0, 0.0, 10.0, True) is not None  # a damaged word ends the wait too


def test_every_node_turns_to_the_same_next_host():
    """nodes/failover.next_host: the first candidate that is this node or answers; with the same
    candidates answering, every survivor turns to one host."""
    from ftrun.supervisor.nodes import failover

    cands = failover.candidates([3, 0, 1, 2], {0, 2}, {0, 1, 2, 3})
    assert cands == [1, 3]
    assert failover.candidates([0, 1, 2], {0}, {2}) == [2]  # node 1 has no standby store
    asked = []

    def answers(c: int) -> bool:
        asked.append(c)
        return c != 1
    assert failover.next_host(cands, 3, answers) == 3 and asked == [1]  # 1 does not answer: itself
    assert {failover.next_host(cands, me, lambda c: True) for me in cands} == {1}
    assert failover.next_host([1], 3, lambda c: False) is None
