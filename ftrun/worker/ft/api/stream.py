"""ft.DataLoader over a stream: each replica reads its own shard, and every replica holds every
shard's position after each committed step, so a restarted replica goes on exactly where its last
committed step left its shard, and a checkpoint holds every shard's position.

What each replica holds is a ShardTable (ft/api/stream_table.py): per shard, its reader and its
position (a few hundred bytes: the loader's state_dict(), ft/api/stream_sources.py). It is
registered state, so a heal gives it to a restarted replica (which then reads its own shard from
its position) and a checkpoint saves it whole. It moves on at every step by one small collective
over the step's group, before the member votes (Manager.vote_listeners): every member sends its
shard's position after the batches its step consumed and whether its shard has one more batch
(read one ahead), and all members apply the same rule to the same reports. The collective is one
of the step's: a step is committed only if every member's went through, so whoever dies after a
committed step, its peers hold that step's position of its shard. A collective that fails votes
the round down, as a gradient's does.

A discarded step gives the same batches again: the batches a replica drew and no committed step
consumed are kept (`given`) and given again, in order, whatever the membership (a replica's
batches are its shard's, whoever else is there). The pass ends at the same draw on every replica
(ShardTable.ended_at), once no shard a member can read has a batch; until then a replica whose
shard is done gets empty batches (the stream's structure, no samples).

The script's loop drives it (`next_batch()`): each batch drawn in a step is consumed by it. A
framework's loop (Lightning's, ftrun/worker/frameworks/streams.py) may draw ahead of the step that
trains a batch (its fetcher reads one ahead, to know the last batch): it draws with `draw()` and
says which draws each step trains with `consume()`; a redone step trains the same batches (the
framework keeps them), and `given` keeps the window's earlier ones for it. Each exchange reads
`ahead` batches past those handed (the draws the loop makes before the next exchange: a window of
k batches, and the fetcher's one ahead), so that every member knows the pass's end by the draw
that meets it: a shard's end is the first draw that found it empty.
Must never decide a step's fate (the vote does), and never import the supervisor.
"""

from __future__ import annotations

import io
import sys
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

from ftrun.worker import settings
from ftrun.worker.ft.api.stream_sources import ShardReader, StreamSource
from ftrun.worker.ft.api.stream_table import Report, ShardTable, advance
from ftrun.worker.ft.manager import Manager

Given = Tuple[Any, Optional[int], Optional[bytes]]  # (batch, its shard or None: empty, the shard's position after it)


def exchange(pg: dist.ProcessGroup, mine: bytes, capacity: int) -> List[bytes]:
    """Every member's `mine`, over `pg`: one all-gather of `capacity` bytes each (the capacity
    every member derives from the same table), and a second, larger, only when a report does not
    fit (every member sees the same lengths, so all make it)."""
    from ftrun.worker.ft.member.group import group_device

    device = group_device()

    def gather(cap: int) -> torch.Tensor:
        buf = torch.zeros(8 + cap, dtype=torch.uint8)
        buf[:8] = torch.frombuffer(bytearray(len(mine).to_bytes(8, "little")), dtype=torch.uint8)
        if len(mine) <= cap:
            buf[8:8 + len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
        buf = buf.to(device)
        out = [torch.empty_like(buf) for _ in range(pg.size())]
        dist.all_gather(out, buf, group=pg)
        return torch.stack(out).cpu()

    got = gather(capacity)
    lengths = [int.from_bytes(bytes(row[:8].numpy()), "little") for row in got]
    if max(lengths) > capacity:
        cap = capacity
        while cap < max(lengths):
            cap *= 2
        got = gather(cap)
    return [bytes(row[8:8 + n].numpy()) for row, n in zip(got, lengths)]


class Stream:
    """One stream's reading on this replica (see the module's docstring)."""

    def __init__(self, mgr: Manager, source: StreamSource, register: bool = True, ahead: int = 1,
                 framework: bool = False, name: str = "") -> None:
        """`register`: the position is registered state of its own (False: the framework carries
        `state_dict()` in its own, as Lightning's loops do a resumable loader's). `ahead`: the
        batches each exchange reads past those handed (see the module's docstring). `framework`:
        the loop draws with draw() and consume(), not next_batch(). `name`: what its lines call it
        (ft.DataLoader #i by default)."""
        self.mgr = mgr
        self.source = source
        self.replica = mgr.replica
        self.table = ShardTable.fresh(0, source.count, source.splittable)
        self.ahead = max(1, int(ahead))
        self.framework = framework
        self._reader: Optional[ShardReader] = None
        self._reader_of: Optional[Tuple[int, int]] = None  # (pass, shard) the reader reads
        self._exhausted = False  # the reader found its shard empty
        self._exhausted_at = 0  # then: the draw (of the pass) that found it so
        self.given: List[Given] = []  # batches drawn that no committed step consumed, in order
        self.handed = 0  # of `given`, handed to the loop since the last commit
        self.used = 0  # of those, consumed by the open step
        self._serial = -1  # the step whose draws `handed` counts (next_batch)
        self._exchanged = -1  # the step whose exchange was made
        self._pending: Optional[Tuple[int, ShardTable, List[str]]] = None  # (step, next table, lines)
        self._template: Any = None
        self._first: Any = None  # the stream's first sample as a batch (filler())
        self.ended = False  # the loop was told the pass is over (StopIteration)
        self.index = len(mgr.loaders)
        self.name = name or f"ft.DataLoader #{self.index}"
        mgr.loaders.append(self)
        if register:
            mgr.register_state(f"ftrun.data.{self.index}", self)
        mgr.step_listeners.append(self._took_step)
        mgr.vote_listeners.append(self._before_vote)

    # ------------------------------------------------------------ the loop's side
    def start(self) -> None:
        """iter(): a pass that was over gives way to the next one (an ft.steps() loop, a framework's epoch)."""
        if self.ended:
            self._new_pass(self.table.pass_no + 1)

    def on_epoch(self, epoch: int) -> None:
        """ft.epochs() moved on to `epoch`: its pass over the stream."""
        if epoch != self.table.pass_no:
            self._new_pass(epoch)

    def next_batch(self) -> Any:
        """The script's loop asks for its next batch: the open step's (given again on a redo)."""
        mgr = self.mgr
        mgr.begin_step()
        if self._serial != mgr.step_serial:  # a new step, or a redo: from the committed position
            self._serial = mgr.step_serial
            self.handed = self.used = 0
        return self._hand()

    # ------------------------------------------------------------ a framework's loop
    def draw(self) -> Any:
        """The framework's loader asks for its next batch: maybe ahead of the step that trains it
        (consume()); StopIteration at the draw that ends the pass, the same on every replica."""
        return self._hand(count_used=False)

    def consume(self) -> None:
        """The open step trains the oldest batch drawn that no step has consumed (a framework's
        batch top, once a batch: a redone step trains the batches it consumed again)."""
        if self.used < self.handed:
            self.used += 1

    def align(self, draw: int) -> None:
        """Before a framework's first draw after a heal: its loop goes on at draw `draw` of the
        pass (a replica that healed inside an accumulation window, at its last batch): the
        window's earlier batches are drawn and consumed by the open step without being handed to
        the loop (the framework trains them again from `given`)."""
        while self.table.drawn + self.handed < draw and not self.table.ends_at(self.table.drawn + self.handed):
            self._hand(count_used=False)
            self.used += 1

    def empty_at(self, k: int) -> bool:
        """The open step's k-th batch (in the order consumed) is one of no samples."""
        return k < len(self.given) and self.given[k][1] is None

    def window(self) -> List[Any]:
        """The batches the open step consumed, in order (a framework's redone window)."""
        return [batch for batch, _, _ in self.given[:self.used]]

    def _hand(self, count_used: bool = True) -> Any:
        if self.table.ends_at(self.table.drawn + self.handed):
            self.ended = True
            raise StopIteration
        if self.handed >= len(self.given):
            self._pull(empty_too=True)
        batch = self.given[self.handed][0]
        self.handed += 1
        if count_used:
            self.used = self.handed
        return batch

    # ------------------------------------------------------------ this replica's shard
    def _shard_reader(self) -> Tuple[Optional[int], Optional[ShardReader]]:
        shard = self.table.reading(self.replica)
        if shard is None:
            return None, None
        if self._reader_of != (self.table.pass_no, shard):
            self._reader = None
            self._reader = self.source.open(shard, self.table.pass_no, self.table.shards[shard].pos)
            self._reader_of, self._exhausted = (self.table.pass_no, shard), False
        return shard, self._reader

    def _pull(self, empty_too: bool) -> bool:
        """Read this replica's shard's next batch into `given`; True if there was one (else, with
        `empty_too`, an empty batch goes there)."""
        shard, reader = self._shard_reader()
        if reader is not None and not self._exhausted:
            try:
                batch = reader.next()
            except StopIteration:
                self._exhausted = True
                self._exhausted_at = self.table.drawn + len(self.given)
            else:
                self.given.append((batch, shard, reader.position()))
                return True
        if empty_too:
            self.given.append((self._empty(), None, None))
        return False

    def _empty(self) -> Any:
        """A batch of no samples, of the stream's structure."""
        if self._template is None:
            try:
                first = self.source.first_batch()
            except StopIteration:
                self.mgr._misused(f"{self.name}: the stream is empty: the loop would train nothing; "
                                  f"check what it reads (a path, a filter, a split)")
            self._first = first
            self._template = tree_map(lambda t: t[:0] if isinstance(t, torch.Tensor) else t, first)
        return self._template

    def is_empty(self, batch: Any) -> bool:
        """`batch` is one this stream gave a replica with nothing to read (a batch of no samples)."""
        return self._template is not None and batch is self._template

    def is_filler(self, batch: Any) -> bool:
        return self._first is not None and batch is self._first

    def filler(self) -> Any:
        """The stream's first sample as a batch: what a framework's step trains at zero weight in
        place of a batch of no samples (a model's loss over no samples is often 0/0: NaN, which
        the replicas' average would spread), so the step's collectives run alike on every replica."""
        self._empty()
        return self._first

    # ------------------------------------------------------------ each step
    def _report(self) -> Report:
        # `ahead` past the draws handed: does this replica's shard have a batch for each draw the
        # loop makes before the next exchange? (Batches read ahead are all of its shard: only a
        # draw the loop makes adds an empty one.) Its end is the draw that found it empty.
        while len(self.given) < self.handed + self.ahead and self._pull(empty_too=False):
            pass
        has_next = len(self.given) >= self.handed + self.ahead
        drawn = self.table.drawn + self.handed
        if not has_next and self._exhausted:
            drawn = self._exhausted_at
        positions = {shard: pos for _, shard, pos in self.given[:self.used] if shard is not None and pos is not None}
        return Report(self.replica, self.table.reading(self.replica), has_next, drawn, self.used, positions)

    def _before_vote(self) -> None:
        """Before this member votes on a step its loop drew from this stream: the exchange."""
        mgr = self.mgr
        serial = mgr.step_serial
        if self._exchanged == serial or (self.used == 0 if self.framework else self._serial != serial):
            return
        self._exchanged = serial
        self._pending = None
        mine = self._report()
        mgr.before_collective()
        pg = mgr.pg
        if pg is None or not (mgr.round_ok and mgr.in_sync):
            return  # this member's vote fails anyway; its peers' exchange fails as its group is dropped
        try:
            raw = exchange(pg, mine.encode(), self.table.capacity())
        except RuntimeError as e:  # torch's collective errors: a peer left mid-exchange
            mgr.fail_round(str(e))
            return
        table, lines = advance(self.table, [Report.decode(r) for r in raw])
        self._pending = (serial, table, lines)

    def _took_step(self) -> None:
        """This member takes the step: the exchange's table is the committed one, and the batches
        the step consumed are gone."""
        pending, self._pending = self._pending, None
        if pending is None or pending[0] != self.mgr.step_serial:
            return
        _, self.table, lines = pending
        if lines and self.mgr.replica_index == 0:
            for line in lines:
                sys.stderr.write(f"ftrun.ft: rank {settings.current().rank_text}: {self.name}: "
                                 f"{line}\n")
            sys.stderr.flush()
        del self.given[:self.used]
        self.handed -= self.used
        self.used = 0

    def _new_pass(self, pass_no: int) -> None:
        self.table = ShardTable.fresh(pass_no, self.source.count, self.source.splittable)
        self._forget()

    def _forget(self) -> None:
        """Drop what this replica read ahead of the table (a new pass, or a table from a peer)."""
        self._reader, self._reader_of, self._exhausted, self._exhausted_at = None, None, False, 0
        self.given, self.handed, self.used = [], 0, 0
        self._serial = self._exchanged = -1
        self._pending = None
        self.ended = False

    # ------------------------------------------------------------ state (heals, checkpoints)
    def state_dict(self) -> Dict[str, Any]:
        buf = io.BytesIO()
        torch.save({"table": self.table.to_dict(), "kind": self.source.kind, "count": self.source.count}, buf)
        return {"stream": buf.getvalue()}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        got = torch.load(io.BytesIO(sd["stream"]), weights_only=True)
        if (got["kind"], got["count"]) != (self.source.kind, self.source.count):
            self.mgr._misused(f"{self.name}: the run's position (from a peer, or the checkpoint) is "
                              f"of a stream of {got['count']} shards read as {got['kind']}, this replica's is of "
                              f"{self.source.count} read as {self.source.kind}: every replica, and a run resumed "
                              f"from a checkpoint, must read the same stream over the same replicas")
        self.table = ShardTable.from_dict(got["table"])
        self._forget()
