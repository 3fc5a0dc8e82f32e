"""Typed codecs for the payloads ftrun's processes exchange through the store.

ftrun.keys names every key; this module says what the values of the reports
and of a quorum look like, once, as small dataclasses with encode() and
decode() (a Quorum: to_json() and from_json()), so the writer and the readers
can never disagree on a field's position. Kept apart from keys.py so each
stays one idea (key names there, payload formats here); a round's votes and
decision are ftrun.votes'.
Must never import torch nor anything else of ftrun's: both the worker and
the torch-free supervisor path import it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

Raw = Union[bytes, str, None]


# A message line longer than this is no sentence a person reads (a tensor's repr, a dump): only
# such a line is cut, so that a log or a report never carries megabytes of it.
LINE_LIMIT = 4000


def first_line(text: str, limit: int = LINE_LIMIT) -> str:
    """The first non-blank line of `text`, whole: every refusal's fix is at its end. Only a line
    over `limit` characters is cut, at a space, and says so."""
    line = next((part.strip() for part in text.strip().splitlines() if part.strip()), "")
    if len(line) <= limit:
        return line
    cut = line.rfind(" ", 0, limit)
    return line[:cut if cut > limit // 2 else limit] + f" ... ({len(line)} characters in all)"


def one_line(e: BaseException) -> str:
    """An error in one line: torch's store errors carry C++ frames after the first line; people need only the first."""
    return first_line(str(e)) or type(e).__name__


def _text(raw: Raw) -> str:
    if raw is None:
        return ""
    return raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)


@dataclass(frozen=True)
class ProgressReport:
    """A worker's progress report (keys.progress_key), rewritten every HEARTBEAT_S by
    ftrun.worker.progress and read by the supervisor (health, hangs, goodput).

    On the wire: space-separated fields, in this order. Readers must accept a report
    with only the first five fields (the key's seed, written before the worker starts)."""

    incarnation: int           # TORCHELASTIC_RESTART_COUNT of the writer; -1: no report yet
    steps: int                 # optimizer steps (under --ft: the global committed step)
    last_step_time: float = 0.0
    time: float = 0.0          # when the report was written (the heartbeat)
    pid: int = 0
    activity: int = 0          # forward passes and torch.save/load calls (--step-timeout)
    first_step_time: float = 0.0
    saved_steps: int = -1      # the step count at the script's last save; -1: none yet
    next_sync: int = -1        # --hook diloco or localsgd: the step of its next sync; -1: none

    def encode(self) -> str:
        return (f"{self.incarnation} {self.steps} {self.last_step_time:.3f} {self.time:.3f} {self.pid} "
                f"{self.activity} {self.first_step_time:.3f} {self.saved_steps} {self.next_sync}")

    @classmethod
    def decode(cls, raw: Raw) -> Optional["ProgressReport"]:
        """The report in `raw`; None when it is not one (empty, damaged, too short)."""
        parts = _text(raw).split()
        if len(parts) < 5:
            return None
        try:
            return cls(incarnation=int(parts[0]), steps=int(parts[1]), last_step_time=float(parts[2]),
                       time=float(parts[3]), pid=int(parts[4]),
                       activity=int(parts[5]) if len(parts) > 5 else 0,
                       first_step_time=float(parts[6]) if len(parts) > 6 else 0.0,
                       saved_steps=int(parts[7]) if len(parts) > 7 else -1,
                       next_sync=int(parts[8]) if len(parts) > 8 else -1)
        except ValueError:
            return None


# What a progress key holds before its worker first reports: every key exists from the start,
# so the supervisor's multi_get never waits for one.
NO_PROGRESS = ProgressReport(incarnation=-1, steps=0)


# The member reports' format (MemberReport, SurvivorReport). Both ends are this package: a
# report of another version comes from another ftrun on some node, and is refused (never
# guessed at), with one line saying so.
WIRE_VERSION = 2
WIRE_FIX = "run the same ftrun on every node"


def _int(v: Any, default: Optional[int] = 0) -> Optional[int]:
    return v if isinstance(v, int) and not isinstance(v, bool) else default


def _float(v: Any) -> Optional[float]:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _obj(raw: Raw) -> Any:
    try:
        return json.loads(_text(raw) or "null")
    except ValueError:
        return None


@dataclass(frozen=True)
class MemberReport:
    """Under --ft, a member's report (keys.info_key), rewritten every HEARTBEAT_S by
    ftrun.worker.progress from the member's own state (member/driver.py info) and read by the
    keeper (ftrun.supervisor.ft.quorum_status) for its decisions and `ftrun status`.

    On the wire: a JSON object of these fields by their names. A field missing or of the wrong
    type reads as its default; a report of another `version` reads as that version alone (its
    reader refuses it: accepts_version)."""

    inc: Optional[int] = None          # the writer's incarnation (None: not a report of anyone)
    quorum_id: Optional[int] = None    # the quorum it is in (None: none yet, joining)
    replicas: int = 0                  # that quorum's replicas (ft.num_replicas())
    in_quorum: bool = False            # in a quorum and holding its state
    healing: bool = False              # receiving the state from a peer
    step: int = 0                      # the global committed step it holds
    round: Optional[int] = None        # the round it is in or waits for (None: none yet)
    committed: int = 0                 # rounds it saw committed (this incarnation)
    discarded: int = 0                 # rounds it saw voted down (this incarnation)
    last_heal_s: Optional[float] = None  # seconds its last heal took
    phase: Optional[str] = None        # "join", "heal", "compute", "vote", "done", ... (member/driver.py)
    phase_since: Optional[float] = None  # wall time it entered the phase
    heals: int = 0                     # heals it received
    last_transfer: Optional[Mapping[str, Any]] = None  # its last heal's figures (bytes, s, gbps, ...)
    beat: int = 0                      # changes with every report: a live report from a stale one
    version: int = WIRE_VERSION

    def encode(self) -> str:
        return json.dumps({f: getattr(self, f) for f in _MEMBER_FIELDS})

    @classmethod
    def decode(cls, raw: Raw) -> Optional["MemberReport"]:
        """The report in `raw`; None when empty or not a JSON object."""
        return cls.from_object(_obj(raw))

    @classmethod
    def from_object(cls, obj: Any) -> Optional["MemberReport"]:
        """The report in an already parsed JSON value (a node relays its workers' reports so);
        None when it is not an object, never an error."""
        if not isinstance(obj, dict):
            return None
        version = _int(obj.get("version"), 0)
        if version != WIRE_VERSION:  # another ftrun's format: nothing of it is read but its version
            return cls(version=version)
        phase = obj.get("phase")
        transfer = obj.get("last_transfer")
        return cls(inc=_int(obj.get("inc"), None), quorum_id=_int(obj.get("quorum_id"), None),
                   replicas=_int(obj.get("replicas")), in_quorum=obj.get("in_quorum") is True,
                   healing=obj.get("healing") is True, step=_int(obj.get("step")),
                   round=_int(obj.get("round"), None), committed=_int(obj.get("committed")),
                   discarded=_int(obj.get("discarded")), last_heal_s=_float(obj.get("last_heal_s")),
                   phase=phase if isinstance(phase, str) else None, phase_since=_float(obj.get("phase_since")),
                   heals=_int(obj.get("heals")), last_transfer=transfer if isinstance(transfer, dict) else None,
                   beat=_int(obj.get("beat")))

    def of(self, inc: Optional[int]) -> bool:
        """Whether this is incarnation `inc`'s report (a live worker's own, not its predecessor's)."""
        return inc is not None and self.inc == inc


_MEMBER_FIELDS = tuple(f.name for f in fields(MemberReport))
# What the keeper reads for a replica that has not reported (or whose report it refused).
NO_REPORT = MemberReport()


def version_refused(rank: int, version: int) -> str:
    """The one line for a member report of another wire version."""
    said = f"in wire version {version}" if version else "without a wire version"
    return (f"rank {rank}'s ftrun.ft reports {said}, and this ftrun reads version {WIRE_VERSION}: "
            f"they are ignored; {WIRE_FIX}")


@dataclass(frozen=True)
class SurvivorReport:
    """What a member holds as it rejoins after the run's store moved (keys.survivor_key),
    written once by member/driver.py moved_store and read by the keeper on the new store
    (keeper/core.py survivors_source, survivors_latest). A JSON object of these fields."""

    inc: Optional[int] = None
    step: int = 0
    in_sync: bool = False        # it held the committed state (no heal left it tainted)
    decided: bool = False        # its last round's decision had left it (no vote in flight)
    latest: int = 0              # the newest quorum of the lost store it saw
    sub_steps: int = 0           # optimizer steps of the next step it holds (several ft.Optimizers)
    version: int = WIRE_VERSION

    def encode(self) -> str:
        return json.dumps({f: getattr(self, f) for f in _SURVIVOR_FIELDS})

    @classmethod
    def decode(cls, raw: Raw) -> Optional["SurvivorReport"]:
        """The report in `raw`; None when it is none, damaged, or of another wire version (a
        survivor of another ftrun says nothing this keeper can trust)."""
        obj = _obj(raw)
        if not isinstance(obj, dict) or _int(obj.get("version"), 0) != WIRE_VERSION:
            return None
        return cls(inc=_int(obj.get("inc"), None), step=_int(obj.get("step")), in_sync=obj.get("in_sync") is True,
                   decided=obj.get("decided") is True, latest=_int(obj.get("latest")),
                   sub_steps=_int(obj.get("sub_steps")))


_SURVIVOR_FIELDS = tuple(f.name for f in fields(SurvivorReport))


@dataclass(frozen=True)
class WorkerError:
    """A worker's uncaught exception, in TORCHELASTIC_ERROR_FILE (LOG_DIR/rank<N>/error.json).

    The format is torch elastic's (what its @record writes): {"message": {"message":
    "<Type>: <text>", "extraInfo": {"py_callstack": "<traceback>", "timestamp": "<s>"}}}, so a
    script's own @record and ftrun's bootstrap write the same file, and the supervisor reads the
    failure from it instead of from the worker's stderr. `where` is the innermost frame of the
    script's own code ('File "x.py", line 12, in f'): with `message`, what identifies a failure
    across restarts."""

    message: str
    where: str = ""
    callstack: str = ""
    timestamp: int = 0

    def encode(self) -> str:
        return json.dumps({"message": {"message": self.message,
                                       "extraInfo": {"py_callstack": self.callstack, "where": self.where,
                                                     "timestamp": str(self.timestamp)}}})

    @classmethod
    def decode(cls, raw: Raw) -> Optional["WorkerError"]:
        """The error in `raw` (either of torch's formats: the message an object or a string);
        None when it holds none."""
        try:
            obj = json.loads(_text(raw) or "null")
        except ValueError:
            return None
        msg = obj.get("message") if isinstance(obj, dict) else None
        if isinstance(msg, str):
            return cls(first_line(msg)) if msg.strip() else None
        if not isinstance(msg, dict) or not isinstance(msg.get("message"), str) or not msg["message"].strip():
            return None
        extra = msg.get("extraInfo") if isinstance(msg.get("extraInfo"), dict) else {}
        stack = extra.get("py_callstack") if isinstance(extra.get("py_callstack"), str) else ""
        where = extra.get("where") if isinstance(extra.get("where"), str) else ""
        if not where:  # torch's @record: the innermost frame of its traceback
            frames = [line.strip() for line in stack.splitlines() if line.lstrip().startswith('File "')]
            where = frames[-1] if frames else ""
        try:
            ts = int(extra.get("timestamp") or 0)
        except (TypeError, ValueError):
            ts = 0
        return cls(first_line(msg["message"]), where, stack, ts)

    @property
    def signature(self) -> str:
        """The same failure, restart after restart: the exception and where it was raised."""
        return f"{self.message} | {self.where}"


# The `where` of the error a --ft worker records as it restarts (exits.EXIT_REPLICA_RESTART)
# because the others' decision of a round contradicts what it did: another replica's failure
# caused it, and no budget pays for it (ftrun.supervisor.policy.peer_restarts).
PEERS_DECIDED = "ftrun.ft: a round its peers decided otherwise"


@dataclass(frozen=True)
class FirstFailure:
    """The first failure of a group attempt, as the nodes agree on it (keys.NodeKeys.fail,
    compare-and-set: the first writer wins): every node decides from the same one."""

    node: int
    rank: int
    reason: str = "failed"
    code: int = 1                     # the failure's exit status
    signature: Optional[str] = None   # ftrun.supervisor.policy.restart: the same failure twice in a row

    def encode(self) -> str:
        return json.dumps({"node": self.node, "rank": self.rank, "reason": self.reason, "code": self.code,
                           "signature": self.signature})

    @classmethod
    def decode(cls, raw: Raw) -> "FirstFailure":
        """The failure in `raw`; a damaged one is still a failure, of an unknown rank."""
        try:
            obj = json.loads(_text(raw) or "null")
            return cls(int(obj["node"]), int(obj["rank"]), str(obj.get("reason") or "failed"),
                       int(obj.get("code") or 1), obj.get("signature") if isinstance(obj.get("signature"), str)
                       else None)
        except (ValueError, TypeError, KeyError, AttributeError):
            return UNKNOWN_FAILURE


UNKNOWN_FAILURE = FirstFailure(node=-1, rank=-1)


# A line ftrun.ft writes into a worker's stderr for the rank's log file only: the console
# filter (ftrun/supervisor/workers/logs.py) keeps it off the console unless --verbose.
DETAIL_PREFIX = "ftrun.ft: detail: "


@dataclass(frozen=True)
class Quorum:
    """Who takes part from a round on: (rank, incarnation) pairs, which of them must heal, and
    from whom. Written by the keeper's core (supervisor/ft/keeper/core.py) alone; a member reads
    it and never recomputes what it says."""

    id: int
    members: Tuple[Tuple[int, int], ...]
    healers: Tuple[int, ...] = ()
    # No member holds committed state (the first quorum, or every holder died):
    # the lowest rank's state is sent to the others.
    fresh: bool = False
    # Every member is new (no member of the previous quorum is alive): they start at
    # this round. Otherwise (-1) the continuing members switch by their votes; the
    # first to enter writes its round into start_key, where every other member and
    # every joiner begins.
    start_round: int = -1
    # Steps per round (one vote each round), the same for every member: a member that ended its
    # round after a different count would wait for a decision while its peers wait for its
    # collective. Sharded replicas and layout rounds take one step a round whatever this says.
    round_steps: int = 1
    # A stop signal with --checkpoint-dir: at the switch to this quorum every member stops (no
    # group, no step), the workers of replica `writer` save the step they hold (-1: no replica
    # holds the trained state, nothing is saved), and all wait to be stopped.
    stop: bool = False
    writer: int = -1
    # Steps between the guard's periodic checks (a round begins at each multiple), the same for
    # every member; 0: none (after a heal the members check once all the same).
    check_steps: int = 0
    # The heal's source, one rank per shard (worker i of one replica for shard i, so that every
    # shard comes from the same step): the keeper's choice, the lowest replica holding the state.
    # A heal's transfer and a spare's feed both start there. Empty: nobody heals (a stop quorum).
    sources: Tuple[int, ...] = ()

    @property
    def ranks(self) -> List[int]:
        return sorted(r for r, _ in self.members)

    def source(self, shard: int = 0) -> Optional[int]:
        """The rank that sends shard `shard` (rank % --replica-size) of the committed state, or None."""
        return self.sources[shard] if shard < len(self.sources) else None

    def incarnation(self, rank: int) -> int:
        return dict(self.members)[rank]

    def to_json(self) -> str:
        d = {"id": self.id, "members": [list(m) for m in self.members], "healers": list(self.healers),
             "fresh": self.fresh, "start_round": self.start_round, "round_steps": self.round_steps}
        if self.stop:
            d.update(stop=True, writer=self.writer)
        if self.check_steps:
            d["check_steps"] = self.check_steps
        if self.sources:
            d["sources"] = list(self.sources)
        return json.dumps(d)

    @classmethod
    def from_json(cls, text) -> "Quorum":
        """The quorum `text` says. A member reads one quorum's text again at every poll while it
        joins or watches (the simulator's runs parse little else): the same text gives the same
        (immutable) Quorum, parsed once."""
        q = _PARSED_QUORUMS.get(text)
        if q is None or type(q) is not cls:
            q = cls._parse(text)
            if len(_PARSED_QUORUMS) >= _PARSED_QUORUMS_MAX:
                _PARSED_QUORUMS.clear()  # a run keeps few quorums: the newest are parsed again
            _PARSED_QUORUMS[text] = q
        return q

    @classmethod
    def _parse(cls, text) -> "Quorum":
        d = json.loads(text)
        return cls(d["id"], tuple(sorted((int(r), int(k)) for r, k in d["members"])), tuple(d.get("healers", ())),
                   bool(d.get("fresh", False)), int(d.get("start_round", -1)), int(d.get("round_steps", 1)),
                   bool(d.get("stop", False)), int(d.get("writer", -1)), int(d.get("check_steps", 0)),
                   tuple(int(r) for r in d.get("sources", ())))


_PARSED_QUORUMS: Dict[Raw, Quorum] = {}  # a quorum's text -> the Quorum it says (Quorum.from_json)
_PARSED_QUORUMS_MAX = 256
