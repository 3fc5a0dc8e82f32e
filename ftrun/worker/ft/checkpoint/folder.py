"""The checkpoint folder's layout and upkeep: where a save is written, how it is published, what is pruned.

- DIR/.step-N.RUN.partial/ is a save being written. Once it is complete
  (DCP's `.metadata` last), ftrun.json is written and fsynced into it, and
  one rename publishes it as DIR/step-N/; the folder's entry is fsynced
  after the rename, and the written files leave the page cache.
- pruned: the newest `keep` checkpoints that verify are kept
  (ft/checkpoint/read.py: checksums); a damaged one is moved aside to
  step-N.damaged, never counted and never deleted; the only good one is
  never deleted. Partial folders older than the newest published one go.
  A step-N folder without ftrun.json is not ftrun's: neither counted nor removed.
- checkpoints this process published or verified are remembered (by the
  identity of their ftrun.json), so a prune checks each one once.

Must never write tensors (DCP does), never communicate, never touch the
store, never load a partial folder, and never import the supervisor.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable, Dict, Optional, Tuple

from ftrun.worker.ft.checkpoint import read as disk
from ftrun.worker.ft.checkpoint import names
from ftrun.worker.ft.checkpoint.names import PARTIAL_DIR
from ftrun.worker.ft.checkpoint.read import DAMAGED_SUFFIX, META, Damaged, complete_checkpoints, one_line


class Folder:
    """One per Checkpointer: the checkpoint folder of the run (--checkpoint-dir)."""

    def __init__(self, root: Path, keep: int, verify: bool, rank: int, log: Callable[[str], None]) -> None:
        self.root, self.keep = root, keep
        self.verify = verify  # checks before pruning (and at load)
        self.rank = rank
        self._log = log
        # Checkpoints this process knows to be good (it published or verified them): folder ->
        # the identity of its ftrun.json, so a folder replaced since is judged again.
        self._good: Dict[str, Tuple[int, int]] = {}

    def partial(self, step: int, run_id: str) -> Path:
        """Where the save of `step` is written before it is published."""
        return self.root / names.partial_name(step, run_id)

    def final(self, step: int) -> Path:
        return self.root / names.step_name(step)

    def publish(self, partial: Path, step: int, meta: bytes) -> Path:
        """Add ftrun.json to a complete partial folder and publish it as step-N (durably)."""
        final = self.final(step)
        write_synced(partial / META, meta)
        if final.exists():  # damaged, or of an earlier attempt at this step: this one replaces it
            shutil.rmtree(final, ignore_errors=True)
        os.rename(partial, final)
        fsync_dir(self.root)
        self.remember(final)
        return final

    def prune(self, newest: int) -> None:
        """Keep the newest `keep` checkpoints that verify; move damaged ones aside (never counted,
        never deleted); drop partial folders older than the newest published one (a killed
        write, or one superseded by a newer writer). A step-N folder without ftrun.json is not
        ftrun's: it is neither counted nor removed."""
        good = 0
        for step, path in complete_checkpoints(self.root):
            if not (path / META).is_file():
                continue
            if good >= self.keep:
                shutil.rmtree(path, ignore_errors=True)
                continue
            verdict = self._judge(path, step)
            if verdict is None:
                good += 1
            elif not verdict.io_error:
                self.move_aside(path, verdict.why)
        try:
            entries = list(os.scandir(self.root))
        except OSError:
            return
        for e in entries:
            m = PARTIAL_DIR.fullmatch(e.name)
            if m and int(m.group(1)) < newest:
                shutil.rmtree(e.path, ignore_errors=True)

    def _judge(self, path: Path, step: int) -> Optional[Damaged]:
        """None if the checkpoint is good: known to this process, or checked now (once)."""
        if self._known_good(path):
            return None
        verdict = disk.check(path, step, checksums=self.verify)
        if isinstance(verdict, Damaged):
            return verdict
        self.remember(path)
        return None

    def _known_good(self, path: Path) -> bool:
        try:
            st = (path / META).stat()
        except OSError:
            return False
        return self._good.get(str(path)) == (st.st_ino, st.st_mtime_ns)

    def remember(self, path: Path) -> None:
        """`path` is good (published or verified by this process)."""
        try:
            st = (path / META).stat()
            self._good[str(path)] = (st.st_ino, st.st_mtime_ns)
        except OSError:
            pass

    def move_aside(self, path: Path, why: str) -> None:
        """A damaged checkpoint: out of the way of every later resume and prune, kept for a look."""
        # A fresh name each time (step-N.damaged, step-N.damaged.2, ...): one of an earlier run,
        # damaged at the same step, is kept too. rename() onto an existing empty folder would
        # replace it, so the name is taken only if nothing has it.
        aside, n = path.with_name(path.name + DAMAGED_SUFFIX), 1
        while os.path.lexists(aside):
            n += 1
            aside = path.with_name(f"{path.name}{DAMAGED_SUFFIX}.{n}")
        try:
            os.rename(path, aside)
        except OSError as e:
            self._log(f"rank {self.rank}: checkpoint {path} is damaged ({why}); it could not be moved aside "
                      f"({one_line(e)}), so it is skipped")
            return
        self._log(f"rank {self.rank}: checkpoint {path} is damaged ({why}); moved aside to {aside} (never read "
                  f"again: remove it once you have looked)")


def write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def drop_cached(path: Path) -> int:
    """Take a written (and fsynced) file out of the page cache; its size. A checkpoint is read
    back only after a loss: its pages would push out data the training reads, and their
    memory, freed now, is the cheapest for the next write to take."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return 0
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except (OSError, AttributeError):
        pass
    finally:
        size = os.fstat(fd).st_size
        os.close(fd)
    return size


def fsync_dir(path: Path) -> None:
    """Make a rename in `path` durable (the folder's entry, not just the files)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
