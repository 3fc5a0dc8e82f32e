"""ftrun's Slurm host-list expansion agrees with python-hostlist (the reference parser Slurm
sites use; a test-only dependency: it is GPL, ftrun's own parser ships instead)."""

from __future__ import annotations

import random

import pytest

from ftrun.slurm import expand_hostlist

hostlist = pytest.importorskip("hostlist", reason="python-hostlist (the test extra) is not installed")

FIXED = ["node1", "node[1-3]", "node[01-03]", "n[1-2],m[3,5-6]", "gpu-[001-004]-ib", "a[1-2]b[3-4]",
         "rack[1-2]-node[01-02]", "x[9-11]", "node[1,3,5]", "c[0-1]n[0-1],d7", "n[08-10]", "nid[00001-00003]",
         "node[01-03,7],gpu5", "r[1-2]n[08-09]", "a.b-c[1-2].example.org"]


def _random_pattern(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randint(1, 3)):
        name = rng.choice(["node", "gpu-", "n", "rack", "c"])
        for _ in range(rng.randint(0, 2)):
            width = rng.choice([1, 2, 3, 5])
            items = []
            for _ in range(rng.randint(1, 3)):
                lo = rng.randint(0, 20)
                hi = lo + rng.randint(0, 4)
                fmt = f"{{:0{width}d}}"
                items.append(fmt.format(lo) if lo == hi else f"{fmt.format(lo)}-{fmt.format(hi)}")
            name += "[" + ",".join(items) + "]" + rng.choice(["", "-ib", "x"])
        parts.append(name)
    return ",".join(parts)


@pytest.mark.quick
def test_hostlists_expand_as_python_hostlist_does():
    rng = random.Random(7)
    for pattern in FIXED + [_random_pattern(rng) for _ in range(500)]:
        assert expand_hostlist(pattern) == hostlist.expand_hostlist(pattern), pattern
