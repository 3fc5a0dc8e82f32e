"""The benchmark pages' plots, drawn at build time from the tables on those pages.

A plot reads its numbers from a Markdown table of its page (found by the
table's first header cell), so the table stays the one record of a result and
the plot cannot disagree with it. Each plot is an SVG that scripts/docs_gen.py
puts next to the page (benchmarks/plots/NAME.svg). Uses matplotlib (the docs
extra); never imports torch or ftrun.
"""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Dict, List, Optional

FTRUN, OTHER, THIRD, FLOOR = "#3f51b5", "#9e9e9e", "#ff9800", "#4caf50"


def tables(text: str) -> List[List[List[str]]]:
    """Every Markdown table of a page, as rows of cells (the header first, the rule left out)."""
    out: List[List[List[str]]] = []
    current: List[List[str]] = []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not all(re.fullmatch(r":?-+:?", c) for c in cells):
                current.append(cells)
        elif current:
            out.append(current)
            current = []
    return out


def table(text: str, first_header: str, nth: int = 0) -> List[Dict[str, str]]:
    """The nth table whose first header cell is `first_header`, as one dict per row."""
    found = [t for t in tables(text) if t and t[0][0].strip("`* ") == first_header]
    if len(found) <= nth:
        raise ValueError(f"no table #{nth + 1} headed {first_header!r} on the page")
    header, *rows = found[nth]
    return [dict(zip(header, row)) for row in rows]


def number(cell: str) -> Optional[float]:
    """The first number in a cell ('1.82 s', '**7.78 ms**', '39.87 MB'), or None."""
    m = re.search(r"-?\d+(?:\.\d+)?", cell.replace(",", ""))
    return float(m.group(0)) if m else None


def _figure(width: float = 7.0, height: float = 3.2, ncols: int = 1):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"svg.fonttype": "none", "svg.hashsalt": "ftrun", "font.size": 9,
                         "axes.spines.top": False, "axes.spines.right": False})
    fig, axes = plt.subplots(1, ncols, figsize=(width, height))
    return plt, fig, axes


def _svg(plt, fig) -> str:
    buf = io.StringIO()
    fig.tight_layout()
    fig.savefig(buf, format="svg", metadata={"Date": None})
    plt.close(fig)
    return buf.getvalue()


def _hbars(ax, labels: List[str], series: List[tuple], unit: str, floor: float = 0.0) -> None:
    """Horizontal grouped bars: series = [(name, values, colour)], one group per label; a value
    under `floor` (a log scale's zero) is drawn at the floor and labelled with its own value."""
    n = len(series)
    h = 0.8 / n
    for i, (name, values, colour) in enumerate(series):
        ys = [j + (i - (n - 1) / 2) * h for j in range(len(labels))]
        bars = ax.barh(ys, [max(v or 0, floor) for v in values], height=h, color=colour, label=name)
        for bar, v in zip(bars, values):
            if v is not None:
                ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {v:g}", va="center", fontsize=8)
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels(labels)
    ax.invert_yaxis()
    ax.set_xlabel(unit)
    if n > 1:
        ax.legend(frameon=False, loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=n)


# ---------------------------------------------------------------- one function per plot


def launch(page: str) -> str:
    rows = [r for r in table(page, "measure") if number(r["torchrun"]) is not None]
    plt, fig, ax = _figure(height=2.8)
    labels = [r["measure"].split(",")[0] for r in rows]
    _hbars(ax, labels, [("ftrun", [number(r["ftrun"]) for r in rows], FTRUN),
                        ("torchrun", [number(r["torchrun"]) for r in rows], OTHER)], "seconds (median)")
    return _svg(plt, fig)


def status(page: str) -> str:
    rows = table(page, "situation")
    plt, fig, ax = _figure(height=3.0)
    labels = [f"{r['situation']}: {r['command'].strip('`')}" for r in rows]
    _hbars(ax, labels, [("median", [number(r["median wall ms"]) for r in rows], FTRUN)],
           "milliseconds, a fresh process (interpreter start included)")
    ax.axvline(300, color=THIRD, linestyle="--", linewidth=1)
    ax.text(300, -0.6, " target 300 ms", color=THIRD, fontsize=8)
    return _svg(plt, fig)


def hooks(page: str) -> str:
    rows = table(page, "run")
    plt, fig, (left, right) = _figure(width=8.0, height=3.4, ncols=2)
    labels = [r["run"] for r in rows]
    sent = [number(r["bytes sent / step"]) for r in rows]
    _hbars(left, labels, [("MB", sent, FTRUN)], "MB one rank sends per step (log scale)", floor=0.001)
    left.set_xscale("log")
    _hbars(right, labels, [("ms", [number(r["median step (ms)"]) for r in rows], OTHER)], "median step, ms")
    right.set_yticklabels([])
    return _svg(plt, fig)


def _chaos(page: str, title: str) -> str:
    rows = table(page, "mode")
    modes = []
    for r in rows:
        if r["mode"] not in modes:
            modes.append(r["mode"])
    free = {r["mode"]: number(r["samples/s"]) for r in rows if r["T (s)"] == "failure-free"}
    kills = {r["mode"]: number(r["samples/s"]) for r in rows if r["T (s)"] == "10"}
    plt, fig, ax = _figure(height=2.6)
    _hbars(ax, modes, [("failure-free", [free.get(m) for m in modes], OTHER),
                       ("a SIGKILL every 10 s", [kills.get(m) for m in modes], FTRUN)],
           "committed samples/s")
    ax.set_title(title, fontsize=9, pad=22)
    return _svg(plt, fig)


def chaos(page: str) -> str:
    return _chaos(page, "0.26M parameters, 3 workers on 2 cores (the middle of three runs)")


def chaos_at_size(page: str) -> str:
    return _chaos(page, "21M parameters with Adam, 3 workers on 2 cores (the middle of three runs)")


def ft_overhead(page: str) -> str:
    rows = table(page, "model")
    plt, fig, ax = _figure(height=2.4)
    labels = [r["model"].split(" (")[0] for r in rows]
    _hbars(ax, labels, [("plain DDP / --ft", [number(r["DDP / --ft (median)"]) for r in rows], FTRUN),
                        ("DDP with a Python hook / --ft",
                         [number(r["Python-hook DDP / --ft (median)"]) for r in rows], OTHER)],
           "the other's step time over --ft's, median of runs (1.0: --ft costs nothing)")
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlim(0.9, 1.06)
    return _svg(plt, fig)


def quorum(page: str) -> str:
    rows = table(page, "replicas")
    n = [number(r["replicas"]) for r in rows]
    plt, fig, (left, right) = _figure(width=8.0, height=3.0, ncols=2)
    left.plot(n, [number(r["commit latency median"]) for r in rows], "o-", color=FTRUN, label="median")
    left.plot(n, [number(r["p99"]) for r in rows], "o--", color=OTHER, label="p99")
    left.set_xscale("log", base=2)
    left.set_xticks(n, [f"{x:g}" for x in n])
    left.set_yscale("log")
    left.set_xlabel("replicas (one store, on 2 cores)")
    left.set_ylabel("commit latency, ms")
    left.legend(frameon=False)
    per = [float(re.search(r"\(([\d.]+)\)", r["store requests per round: members (per member)"]).group(1))
           for r in rows]
    right.plot(n, per, "o-", color=FTRUN)
    right.set_xscale("log", base=2)
    right.set_xticks(n, [f"{x:g}" for x in n])
    right.set_ylim(0, 4)
    right.set_xlabel("replicas")
    right.set_ylabel("store requests per replica per round")
    return _svg(plt, fig)


def heal(page: str) -> str:
    rows = table(page, "model")
    plt, fig, ax = _figure(height=2.4)
    labels = [f"{r['model']} ({r['state sent']})" for r in rows]
    _hbars(ax, labels, [("heal transfer", [number(r["transfer"]) for r in rows], FTRUN),
                        ("plain broadcast (floor)", [number(r["floor (plain broadcast)"]) for r in rows], FLOOR)],
           "seconds (median of 3)")
    return _svg(plt, fig)


def checkpoints(page: str) -> str:
    rows = table(page, "params")
    plt, fig, ax = _figure(height=2.2)
    labels = [f"{r['params']} ({r['state']})" for r in rows]
    _hbars(ax, labels, [("the loop's pause per save", [number(r["pause per save"]) for r in rows], FTRUN),
                        ("torch.save, synchronous", [number(r["torch.save (sync)"]) for r in rows], OTHER)],
           "seconds (log scale)")
    ax.set_xscale("log")
    ax.set_xlim(1e-4, None)
    return _svg(plt, fig)


PLOTS: Dict[str, tuple] = {
    "launch": ("launch.md", launch),
    "status": ("status.md", status),
    "hooks": ("hooks.md", hooks),
    "chaos": ("chaos.md", chaos),
    "chaos-at-size": ("chaos-at-size.md", chaos_at_size),
    "ft-overhead": ("ft-overhead.md", ft_overhead),
    "quorum": ("quorum.md", quorum),
    "heal": ("heal.md", heal),
    "checkpoints": ("checkpoints.md", checkpoints),
}


def plots(docs: Path) -> Dict[str, str]:
    """{site path: SVG} for every plot, from the benchmark pages under `docs`."""
    out = {}
    for name, (page, draw) in PLOTS.items():
        text = (docs / "benchmarks" / page).read_text()
        try:
            out[f"benchmarks/plots/{name}.svg"] = draw(text)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            # A page whose table changed shape: say which, so the build fails with the reason.
            raise RuntimeError(f"plot {name}: the table on benchmarks/{page} does not read as expected: "
                               f"{type(e).__name__}: {e}") from None
    return out
