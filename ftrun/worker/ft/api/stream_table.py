"""Who reads which shard of a stream, and where each shard is: the table every replica carries
for an ft.DataLoader over a stream (ft/api/stream.py), and the rule that moves it on.

A stream is read in shards, each by one replica at a time. The table holds, for the current pass
over the stream, every shard's position (its reader's state after the batches committed steps
trained, opaque bytes; None at the pass's start), its reader (a replica id) and, once its reader
found it empty, the draw from which it has nothing (`done_at`). Draws are counted per pass, the
same on every replica (every replica's loop draws alike): `drawn` is how many of them committed
steps consumed. After each step every member reports its shard's position and whether it has a
batch for the next draw (a small collective of the step, ft/api/stream.py), and `advance()`
gives every member the same next table:
- A splittable stream (one ftrun splits itself: any replica can read any shard) has one shard
  per training replica. A member whose shard is done, or that holds none (a promoted spare, a
  replica that came back after its shard was taken), takes the lowest shard that is not done and
  whose reader is not among the step's members (a replica away, or given up): nothing of a
  shard is skipped while a member can read it. The pass ends once every shard is done.
- A fixed stream (one the script splits itself, e.g. by RANK: only replica r can read shard r)
  has one shard per replica id, spares included. The pass ends once every member's shard is done;
  the rest of a shard whose replica was away then is not read in this pass (said in one line).
`ended_at` is the draw at which the pass ends: the loop's draw of that index raises StopIteration
on every replica, the same draw however late a replica learned it.
Pure: no torch, no store, no clock. Must never decide a step's fate.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Tuple

# (replica, shard held or -1, whether it has a batch for the next draw, its draws so far, the
# draws its step consumed, the count of positions that follow), then each (shard, length, bytes)
_HEAD = struct.Struct("<iiBqqi")
_POS = struct.Struct("<ii")
MIN_CAPACITY = 256  # bytes of an exchange's buffer, at least


@dataclass(frozen=True)
class Shard:
    pos: Optional[bytes]  # the reader's state after the committed batches; None: the pass's start
    holder: Optional[int]  # the replica that reads it (or last read it)
    done_at: Optional[int] = None  # the draw from which it has nothing, once its reader found that


@dataclass(frozen=True)
class ShardTable:
    pass_no: int
    drawn: int  # draws of this pass that committed steps consumed
    shards: Tuple[Shard, ...]
    splittable: bool
    ended_at: Optional[int] = None  # the draw at which the pass ends (StopIteration), once known

    @staticmethod
    def fresh(pass_no: int, count: int, splittable: bool) -> "ShardTable":
        """A pass's start: shard s is read by replica s."""
        return ShardTable(pass_no, 0, tuple(Shard(None, s) for s in range(count)), splittable)

    def reading(self, replica: int) -> Optional[int]:
        """The shard `replica` reads now (None: none, it gives empty batches)."""
        if not self.splittable:
            ok = replica < len(self.shards) and self.shards[replica].done_at is None
            return replica if ok else None
        return next((i for i, s in enumerate(self.shards) if s.holder == replica and s.done_at is None), None)

    def ends_at(self, draw: int) -> bool:
        """The loop's draw `draw` of this pass ends it (StopIteration on every replica)."""
        return self.ended_at is not None and draw >= self.ended_at

    def capacity(self) -> int:
        """An exchange's buffer per member: what every member agrees on from this table alone (the
        largest position it holds, room for the header), so a replica that healed sends the same."""
        need = _HEAD.size + _POS.size + max((len(s.pos) for s in self.shards if s.pos), default=0)
        cap = MIN_CAPACITY
        while cap < 2 * need:
            cap *= 2
        return cap

    def to_dict(self) -> Dict[str, object]:
        return {"pass": self.pass_no, "drawn": self.drawn, "splittable": self.splittable, "ended_at": self.ended_at,
                "shards": [[s.pos, s.holder, s.done_at] for s in self.shards]}

    @staticmethod
    def from_dict(d: Dict[str, object]) -> "ShardTable":
        shards = tuple(Shard(p, h, done) for p, h, done in d["shards"])  # type: ignore[union-attr]
        return ShardTable(int(d["pass"]), int(d["drawn"]), shards, bool(d["splittable"]),  # type: ignore[arg-type]
                          d.get("ended_at"))  # type: ignore[arg-type]


@dataclass(frozen=True)
class Report:
    """One member's part of a step's exchange."""
    replica: int
    holding: Optional[int]  # the shard it reads now
    has_next: bool  # its shard has a batch for its next draw
    drawn: int  # its draws of the pass so far (the committed ones and this step's)
    used: int  # draws this step consumed
    positions: Dict[int, bytes] = field(default_factory=dict)  # shard -> its position after the step

    def encode(self) -> bytes:
        head = _HEAD.pack(self.replica, -1 if self.holding is None else self.holding, int(self.has_next), self.drawn,
                          self.used, len(self.positions))
        return head + b"".join(_POS.pack(s, len(p)) + p for s, p in sorted(self.positions.items()))

    @staticmethod
    def decode(raw: bytes) -> "Report":
        replica, holding, has_next, drawn, used, count = _HEAD.unpack_from(raw)
        at, positions = _HEAD.size, {}
        for _ in range(count):
            shard, n = _POS.unpack_from(raw, at)
            at += _POS.size
            positions[shard] = bytes(raw[at:at + n])
            at += n
        return Report(replica, None if holding < 0 else holding, bool(has_next), drawn, used, positions)


def advance(table: ShardTable, reports: List[Report]) -> Tuple[ShardTable, List[str]]:
    """The table after a step whose members made `reports`, and what changed hands (lines to say)."""
    shards = list(table.shards)
    members = {r.replica for r in reports}
    for r in reports:
        for s, pos in r.positions.items():
            if 0 <= s < len(shards):
                shards[s] = replace(shards[s], pos=pos)
        if r.holding is not None and 0 <= r.holding < len(shards):
            shards[r.holding] = replace(shards[r.holding], holder=r.replica,
                                        done_at=None if r.has_next else r.drawn)
    # Every member consumed the same draws (one loop); the least, should one differ.
    used = min((r.used for r in reports), default=0)
    lines: List[str] = []
    ended = None
    if table.splittable:
        holding = {s.holder for s in shards if s.done_at is None and s.holder in members}
        wanting = sorted(m for m in members if m not in holding)
        free = [i for i, s in enumerate(shards) if s.done_at is None and s.holder not in members]
        for m, i in zip(wanting, free):
            left = shards[i].holder
            if shards[i].pos is not None:  # a shard nobody began (more shards than replicas) is taken quietly
                lines.append(f"replica {m} reads shard {i} of the stream on, where replica {left} left it (replica "
                             f"{left} is away: restarting, or given up)")
            shards[i] = replace(shards[i], holder=m)
        if shards and all(s.done_at is not None for s in shards):
            ended = max(s.done_at for s in shards)  # type: ignore[type-var]
    elif table.ended_at is None:  # (said once: members that read ahead learn the end a step early)
        mine = [shards[m] for m in members if m < len(shards)]
        if mine and all(s.done_at is not None for s in mine):
            ended = max(s.done_at for s in mine)  # type: ignore[type-var]
            left = [i for i, s in enumerate(shards) if s.done_at is None]
            if left:
                lines.append(f"pass {table.pass_no} over the stream ends without the rest of shard"
                             f"{'s' if len(left) > 1 else ''} {', '.join(map(str, left))}: "
                             f"{'their replicas were' if len(left) > 1 else 'its replica was'} away, and the script "
                             f"splits the stream itself, so no other replica can read "
                             f"{'them' if len(left) > 1 else 'it'}; those samples are not trained in this pass")
    return ShardTable(table.pass_no, table.drawn + used, tuple(shards), table.splittable,
                      table.ended_at if table.ended_at is not None else ended), lines
