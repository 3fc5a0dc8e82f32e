"""Refresh tests/durations.txt, the order the suite deals its tests out in (tests/conftest.py),
from a record of a whole-suite run: `FTRUN_TEST_TIMES=/tmp/times bash scripts/test.sh`, then
`python scripts/test_durations.py /tmp/times`. Tests under a second are left out (they count
as 2 s). Must never run tests itself."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

HEADER = """\
# Seconds each test took (setup, call and teardown) in a whole-suite run on 2 cores: the
# order the suite deals its tests out in (tests/conftest.py). Refresh with
# scripts/test_durations.py after a run of scripts/test.sh; a test not listed counts as 2 s.
"""


def main(record: str) -> None:
    seconds: Counter = Counter()
    for line in Path(record).read_text().splitlines():
        nodeid, wall, _cpu = line.rsplit(" ", 2)
        seconds[nodeid] = float(wall)  # the last run of a test, if the record holds several
    rows = [f"{t:.1f} {nodeid}\n" for nodeid, t in sorted(seconds.items(), key=lambda kv: (-kv[1], kv[0])) if t >= 1.0]
    out = Path(__file__).resolve().parent.parent / "tests" / "durations.txt"
    out.write_text(HEADER + "".join(rows))
    print(f"{out}: {len(rows)} tests of {len(seconds)}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python scripts/test_durations.py FTRUN_TEST_TIMES-FILE")
    main(sys.argv[1])
