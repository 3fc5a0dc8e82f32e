"""Chaos benchmark (issue 5): training throughput and recovery under periodic SIGKILLs.

    .venv/bin/python scripts/bench_chaos.py                          # full run, ~10 min
    .venv/bin/python scripts/bench_chaos.py --duration 20 --periods 5  # smoke run, < 3 min
    .venv/bin/python scripts/bench_chaos.py --markdown               # also print the markdown table

Three ways to run the same 3-worker training (same model: by default Linear(256,
1024) - ReLU - Linear(1024, 1), --depth adds HIDDEN x HIDDEN layers and --optim
picks Adam(W); same data volume: 96 synthetic samples per step, split 32 per
worker; SGD with momentum by default; gloo on CPU):

  (a) ftrun --ft      `ftrun --nproc 3 --ft --max-restarts 1000 scripts/train_ft.py`: a dead replica
                      is restarted alone and healed from a peer, the others keep training.
  (b) ftrun group     `ftrun --nproc 3 --max-restarts 100 scripts/train_ddp.py --ckpt F --ckpt-every N`:
                      any death restarts all three workers, which resume from the snapshot.
  (c) torchrun        `torchrun --standalone --nproc-per-node 3 --max-restarts 100` on the same
                      train_ddp.py with the same snapshots.

Each mode runs as one launcher: first a failure-free window (the reference
of its chaos rows), then, for each T of --periods, a window of --duration
seconds with a SIGKILL of a random worker (seeded RNG, the same victims in
every mode) every T seconds. Between windows the bench waits until the
replica killed last is training again. Keeping the reference and the chaos
windows of a mode in one run, minutes apart at most, keeps their ratio
honest on a machine whose background load drifts, and saves a start-up
(10-20 s on a loaded 2-core machine) per row.

torchrun note: with torch 2.13, `torchrun --standalone` (c10d rendezvous)
shares its rendezvous TCPStore with the workers and reuses it across
restarts without a per-attempt prefix, so the restarted workers' gloo
rendezvous reads the previous attempt's addresses ("Gloo connectFullMesh
failed ... Connection refused") and every restart fails or hangs (pytorch
issue 135712 describes the same sharing problem). The bench therefore runs
torchrun with torch's opt-out TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1;
--torchrun-shared-store runs it as it comes, to see the failure.

How it is measured (the launcher's stdout/stderr are read
line by line in threads and time-stamped on arrival):

- Progress: every worker prints `step S` after each step (--print-every 1) and
  `[announce] rank R pid P first step S t TIME` after the first step of each
  process (the scripts' optional --announce flag; TIME is the worker's own
  clock). The failure-free window starts when the run has made --warmup
  steps, each chaos window once the previous kill's replica is back;
  committed steps are the progress at a window's end minus the progress at
  its start (steps/s x 96 = samples/s: with --ft the global batch is split
  over the live replicas, so a step is always 96 samples). With --ft the global step never goes back.
  Without --ft a kill throws away the steps since the last snapshot: from the
  kill on, progress is the step the restarted group resumes from (read from
  its first announce line), so redone steps are never counted twice.
- The scripts run with a huge --steps and the bench stops the launcher with
  SIGTERM after the last window (once the replica killed last is back, so
  that the step a group restart resumed from is known). No --until option is needed: progress is read from
  the time-stamped step lines, so the run need not stop at a step boundary,
  and stopping the launcher is what a user does too.
- Kills: kill k is planned at (k + 1/2) T + U(-T/4, T/4) after the window
  starts (seeded RNG), so there are duration/T kills, T apart on average, not
  all at the same phase of the snapshot period; its victim is a random rank
  (the same sequence in every mode). A kill waits until its victim's current
  process has completed its first step (announce line), so only training
  workers are killed; a kill that had to wait pushes the next one to at
  least T/2 after it. Victim pids come from the launcher's own view:
  `$FTRUN_HOME/<run-id>/state.json` for ftrun, the torchrun process's
  children running train_ddp.py (their RANK) for torchrun, checked against
  the announce lines and against the launcher's process tree. The launcher
  itself is never killed.
- Detection: ftrun prints `ftrun: rank N (pid P) killed by SIGKILL` when it
  notices; torchrun logs `failed (exitcode: -9) local_rank: N (pid: P)`. Note
  that torchrun logs it only after it has stopped the surviving workers.
- Back: the time from the kill until the killed replica takes part again.
  --ft: kill-to-detection plus the supervisor's `rank N is training again,
  healed from a peer X s after it failed`. Without --ft: the first completed
  step of the restarted worker of that rank (its announce line).
  `1st step` is the announce-based figure for every mode.
- 5 s spread: (max - min) / mean of the steps/s of the 5 s slices of a
  failure-free window: how noisy the machine was. load: 1-minute load average.
- Survivor restarts (--ft): ftrun's restart lines ("rank N (pid P) ...; restarting") of a pid the
  bench never killed: a replica that left its process because of another's failure (a round it
  stepped past, voted down after a peer died mid-collective). Printed per window, with the lines,
  and in --json; the goal is 0.
- Lost steps per failure: --ft: rounds discarded (state.json's
  steps_discarded over the window) per kill. Without --ft: the highest step
  reached before the failure was detected minus the step resumed from.

Everything runs with FTRUN_HOME in a temporary folder, so `ftrun status`
of the user never sees these runs. The table goes to stdout and to
docs/benchmarks/chaos.md (between the markers; text outside them is kept).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple
import scratch

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
NPROC = 3
BEGIN = "<!-- bench_chaos:begin -->"
END = "<!-- bench_chaos:end -->"

MODES = ("ft", "group", "torchrun")
LABELS = {"ft": "(a) ftrun --ft", "group": "(b) ftrun group restart", "torchrun": "(c) torchrun"}

STEP_RE = re.compile(r"step (\d+) loss")
ANNOUNCE_RE = re.compile(r"\[announce\] rank (\d+) pid (\d+) first step (\d+) t ([\d.]+)")
FTRUN_DETECT_RE = re.compile(r"ftrun: rank (\d+) \(pid (\d+)\) killed by SIGKILL")
TORCHRUN_DETECT_RE = re.compile(r"exitcode: -9\) local_rank: (\d+) \(pid: (\d+)\)")
REJOIN_RE = re.compile(r"rank (\d+) is training again, healed from a peer ([\d.]+) s after it failed")
# ftrun's line for every replica it restarts: a survivor's is one whose pid was never killed
RESTART_RE = re.compile(r"ftrun: rank (\d+) \(pid (\d+)\) (.*); restarting")
# A survivor whose steps went past what its peers decided, healed again in its own process
INPLACE_RE = re.compile(r"rank (\d+): (.*); taking the committed state from a peer in place")


# --------------------------------------------------------------------------- one launcher run


class Lines:
    """Every line of the launcher's stdout and stderr, time-stamped on arrival by one thread per pipe."""

    def __init__(self, proc: subprocess.Popen, log_path: Path) -> None:
        self.lock = threading.Lock()
        self.lines: List[Tuple[float, str, str]] = []
        self.announced: Dict[int, Tuple[int, float]] = {}  # pid -> (rank, worker time)
        self.max_step = -1
        self.max_step_t = 0.0
        self.log = open(log_path, "w")
        self.threads = [threading.Thread(target=self._pump, args=(proc.stdout, "out"), daemon=True),
                        threading.Thread(target=self._pump, args=(proc.stderr, "err"), daemon=True)]
        for t in self.threads:
            t.start()

    def _pump(self, pipe, name: str) -> None:
        for raw in iter(pipe.readline, b""):
            now = time.time()
            line = raw.decode(errors="replace").rstrip("\n")
            with self.lock:
                self.lines.append((now, name, line))
                self.log.write(f"{now:.6f} {name} {line}\n")
                for s in STEP_RE.findall(line):
                    if int(s) > self.max_step:
                        self.max_step, self.max_step_t = int(s), now
                for m in ANNOUNCE_RE.finditer(line):
                    self.announced[int(m.group(2))] = (int(m.group(1)), float(m.group(4)))

    def snapshot(self) -> List[Tuple[float, str, str]]:
        with self.lock:
            return list(self.lines)

    def close(self) -> None:
        for t in self.threads:
            t.join(5)
        self.log.close()


@dataclass
class Kill:
    t: float
    rank: int
    pid: int
    planned: float
    detect_t: Optional[float] = None
    back_s: Optional[float] = None
    first_step_s: Optional[float] = None
    lost: Optional[int] = None
    old_pids: List[int] = field(default_factory=list)  # the workers alive when it was killed


@dataclass
class Result:
    mode: str
    period: Optional[float]
    t0: float = 0.0
    t1: float = 0.0
    steps: int = 0
    steps_per_s: float = 0.0
    samples_per_s: float = 0.0
    segment_rates: List[float] = field(default_factory=list)
    kills: List[Kill] = field(default_factory=list)
    discarded: Optional[int] = None
    load: float = 0.0
    startup_s: float = 0.0
    launcher_rc: Optional[int] = None
    anomalies: List[str] = field(default_factory=list)
    # --ft: ftrun's restart lines for ranks that were not killed (a survivor left its process)
    survivor_restarts: List[str] = field(default_factory=list)
    # --ft: survivors that took the committed state again in place (their process lives on)
    survivor_rejoins: List[str] = field(default_factory=list)


def command(mode: str, args: argparse.Namespace, run_id: str, ckpt: Path) -> List[str]:
    work = ["--steps", str(10 ** 9), "--dim", str(args.dim), "--hidden", str(args.hidden), "--depth", str(args.depth),
            "--optim", args.optim, "--lr", str(args.lr), "--print-every", "1", "--announce"]
    if mode == "ft":
        return [str(VENV_BIN / "ftrun"), "--nproc", str(NPROC), "--ft", "--max-restarts", "1000", "--run-id", run_id,
                str(ROOT / "scripts" / "train_ft.py"), "--batch", str(args.batch), "--data", "step"] + work
    ddp = [str(ROOT / "scripts" / "train_ddp.py"), "--batch", str(args.batch // NPROC), "--ckpt", str(ckpt),
           "--ckpt-every", str(args.ckpt_every)] + work
    if mode == "group":
        return [str(VENV_BIN / "ftrun"), "--nproc", str(NPROC), "--max-restarts", "100", "--run-id", run_id] + ddp
    return [str(VENV_BIN / "torchrun"), "--standalone", "--nproc-per-node", str(NPROC), "--max-restarts", "100"] + ddp


def read_state(home: Path, run_id: str) -> Optional[dict]:
    try:
        return json.loads((home / run_id / "state.json").read_text())
    except (OSError, ValueError):
        return None


def launcher_pids(mode: str, proc: subprocess.Popen, home: Path, run_id: str) -> Dict[int, int]:
    """rank -> pid of the worker the launcher currently runs for it (never the launcher itself)."""
    out: Dict[int, int] = {}
    if mode == "torchrun":
        import psutil

        try:
            children = psutil.Process(proc.pid).children()
        except psutil.Error:
            return out
        for c in children:
            try:
                if any("train_ddp.py" in a for a in c.cmdline()):
                    out[int(c.environ()["RANK"])] = c.pid
            except (psutil.Error, KeyError, ValueError):
                continue
        return out
    st = read_state(home, run_id)
    for r in (st or {}).get("replicas", []):
        if r.get("pid") and r.get("state") in ("running", "starting", "recovering"):
            out[r["rank"]] = r["pid"]
    return out


def is_descendant(pid: int, ancestor: int) -> bool:
    import psutil

    try:
        return pid != ancestor and any(c.pid == pid for c in psutil.Process(ancestor).children(recursive=True))
    except psutil.Error:
        return False


def kill_loop(res: Result, mode: str, proc: subprocess.Popen, lines: "Lines", home: Path, run_id: str,
              rng: random.Random) -> None:
    """Until res.t1: SIGKILL a random training worker about every res.period seconds."""
    period = res.period
    duration = res.t1 - res.t0
    # Kill k is planned at (k + 1/2) T after the window starts, shifted by a seeded random
    # U(-T/4, T/4), so kills do not all land at the same phase of the snapshot period.
    plan = [res.t0 + (k + 0.5 + rng.uniform(-0.25, 0.25)) * period for k in range(int(duration // period))] \
        if period else []
    victims = [rng.randrange(NPROC) for _ in plan]
    next_kill = plan.pop(0) if plan else None
    victim = victims.pop(0) if victims else None
    while time.time() < res.t1:
        if proc.poll() is not None:
            res.anomalies.append(f"launcher exited {proc.returncode} during the window")
            return
        if next_kill is not None and time.time() >= next_kill:
            current = launcher_pids(mode, proc, home, run_id)
            pid = current.get(victim)
            with lines.lock:
                training = pid is not None and pid in lines.announced
                seen = set(lines.announced)
            if training and is_descendant(pid, proc.pid):
                t_kill = time.time()
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass  # it died on its own in between: the next check picks its successor
                else:
                    res.kills.append(Kill(t_kill, victim, pid, next_kill,
                                          old_pids=sorted(set(current.values()) | seen)))
                    # a kill that had to wait for its victim pushes the next one back (at least T/2 later)
                    next_kill = max(plan.pop(0), t_kill + period / 2) if plan else None
                    victim = victims.pop(0) if victims else None
                    if next_kill is not None and next_kill >= res.t1:
                        next_kill = None
            time.sleep(0.005)
            continue
        time.sleep(min(0.02, max(0.0, res.t1 - time.time())))


def settled(mode: str, kills: List[Kill], lines: "Lines") -> bool:
    """Has the replica of the last kill taken part again (and, for --ft, has ftrun said so)?"""
    if not kills:
        return True
    last = kills[-1]
    with lines.lock:
        back = any(rank == last.rank and pid not in last.old_pids for pid, (rank, _t) in lines.announced.items())
    if not back or mode != "ft":
        return back
    return any(REJOIN_RE.search(l) and t > last.t for t, _, l in lines.snapshot())


def run_mode(mode: str, args: argparse.Namespace, tmp: Path, ref_duration: float, console) -> List[Result]:
    """One launcher for the mode: a failure-free window, then one chaos window per period."""
    rdir = tmp / mode
    rdir.mkdir()
    home = rdir / "home"
    run_id = f"chaos-{mode}"
    env = dict(os.environ, FTRUN_HOME=str(home), PYTHONUNBUFFERED="1")
    if mode == "torchrun" and not args.torchrun_shared_store:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # see the docstring: restarts fail without it
    argv = command(mode, args, run_id, rdir / "ckpt.pt")
    console.print(f"[bold]{LABELS[mode]}[/]: {' '.join(Path(argv[0]).name if i == 0 else a for i, a in enumerate(argv))}")
    windows = [Result(mode, None)] + [Result(mode, t) for t in args.periods]
    started = time.time()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, env=env,
                            start_new_session=True)
    lines = Lines(proc, rdir / "launcher.log")
    all_kills: List[Kill] = []
    done: List[Result] = []
    try:
        # warm-up: the first window starts at the line that shows --warmup steps
        while lines.max_step + 1 < args.warmup:
            if proc.poll() is not None:
                raise RuntimeError(f"{mode}: launcher exited {proc.returncode} before the warm-up was over; "
                                   f"see {rdir / 'launcher.log'}")
            if time.time() - started > args.start_timeout:
                raise RuntimeError(f"{mode}: no {args.warmup} steps within {args.start_timeout} s")
            time.sleep(0.01)
        startup = lines.max_step_t - started
        for res in windows:
            if res.period is None:
                res.t0 = lines.max_step_t
            else:
                # settle: the replica killed last is back before the next window starts
                deadline = time.time() + args.settle_timeout
                while not settled(mode, all_kills, lines) and time.time() < deadline and proc.poll() is None:
                    time.sleep(0.02)
                if not settled(mode, all_kills, lines):
                    res.anomalies.append(f"the replica killed last was not back {args.settle_timeout:g} s after "
                                         f"the previous window")
                time.sleep(0.5)
                res.t0 = time.time()
            if proc.poll() is not None:
                res.anomalies.append(f"launcher exited {proc.returncode} before the window")
                break
            res.startup_s = startup
            res.t1 = res.t0 + (ref_duration if res.period is None else args.duration)
            st0 = read_state(home, run_id) if mode == "ft" else None
            load0 = os.getloadavg()[0]
            rng = random.Random(args.seed * 1000 + int(res.period * 10)) if res.period else None
            kill_loop(res, mode, proc, lines, home, run_id, rng)
            res.load = (load0 + os.getloadavg()[0]) / 2
            if mode == "ft":
                st1 = read_state(home, run_id)
                if st0 and st1 and st1.get("steps_discarded") is not None:
                    res.discarded = int(st1["steps_discarded"]) - int(st0.get("steps_discarded") or 0)
            all_kills += res.kills
            done.append(res)
            console.print(f"  {'failure-free' if res.period is None else f'T = {res.period:g} s'}: window over, "
                          f"{len(res.kills)} kills, load {res.load:.1f}")
        # The last kill's restart: wait for it, so that the step it resumes from is known.
        deadline = time.time() + args.settle_timeout
        while not settled(mode, all_kills, lines) and time.time() < deadline and proc.poll() is None:
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                (done or windows)[-1].anomalies.append("launcher still running 30 s after SIGTERM: killed its session")
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        lines.close()
    snap = lines.snapshot()
    progress = analyse(mode, all_kills, snap, done)
    for res in done:
        res.launcher_rc = proc.returncode
        window_figures(res, progress, args)
    return done


# --------------------------------------------------------------------------- analysis of one launcher run


def analyse(mode: str, kills: List[Kill], lines: List[Tuple[float, str, str]], windows: List[Result]):
    """Fill in the per-kill figures; return progress(t), the number of steps the model holds at time t."""
    announces = []  # (arrival, rank, pid, step, worker time)
    detects = []    # (arrival, rank, pid)
    rejoins = []    # (arrival, rank, took)
    steps = []      # (arrival, step)
    for t, _name, line in lines:
        for s in STEP_RE.findall(line):
            steps.append((t, int(s)))
        for m in ANNOUNCE_RE.finditer(line):
            announces.append((t, int(m.group(1)), int(m.group(2)), int(m.group(3)), float(m.group(4))))
        m = (FTRUN_DETECT_RE if mode != "torchrun" else TORCHRUN_DETECT_RE).search(line)
        if m:
            detects.append((t, int(m.group(1)), int(m.group(2))))
        m = REJOIN_RE.search(line)
        if m:
            rejoins.append((t, int(m.group(1)), float(m.group(2))))

    killed = {k.pid for w in windows for k in w.kills}
    for w in windows:
        w.survivor_restarts = [line for t, _name, line in lines if w.t0 <= t <= w.t1 + 5
                               and (m := RESTART_RE.search(line)) and int(m.group(2)) not in killed]
        # (not past a failure-free window's end: the next window starts within 5 s of it)
        w.survivor_rejoins = [line for t, _name, line in lines
                              if w.t0 <= t <= w.t1 + (5 if w.kills else 0) and INPLACE_RE.search(line)]
        for k in w.kills:
            d = [t for t, _r, pid in detects if pid == k.pid and t >= k.t]
            if d:
                k.detect_t = d[0]
            else:
                w.anomalies.append(f"no detection line for the kill of rank {k.rank} (pid {k.pid}) at "
                                   f"+{k.t - w.t0:.1f} s")
            later = [a for a in announces if a[1] == k.rank and a[2] not in k.old_pids and a[0] > k.t]
            if later:
                k.first_step_s = later[0][4] - k.t
            if mode == "ft":
                r = [(t, took) for t, rank, took in rejoins if rank == k.rank and t > k.t]
                if r and k.detect_t is not None:
                    k.back_s = (k.detect_t - k.t) + r[0][1]
            else:
                k.back_s = k.first_step_s

    if mode == "ft":
        def progress(t: float) -> int:
            done = [s + 1 for a, s in steps if a <= t]
            return max(done) if done else 0
        return progress

    # Without --ft, from each kill on the group falls back to the step its successor resumes from
    # (the first announce of a process that was not alive at the kill); step lines in between
    # come from the dying group and do not count.
    resets = []  # (kill time, resume step or None, arrival of the resume)
    for k in kills:
        new = [a for a in announces if a[0] > k.t and a[2] not in k.old_pids]
        resets.append((k.t, new[0][3], new[0][0]) if new else (k.t, None, float("inf")))
        before = [s + 1 for a, s in steps if a <= (k.detect_t or k.t)]
        if new and before:
            k.lost = max(before) - new[0][3]

    def progress(t: float) -> int:
        last = None
        for r in resets:
            if r[0] <= t:
                last = r
        if last is None:
            done = [s + 1 for a, s in steps if a <= t]
            return max(done) if done else 0
        _kt, floor, arrival = last
        if floor is None:
            floor = 0
        if arrival > t:  # restarting: the model is at the snapshot
            return floor
        done = [s + 1 for a, s in steps if arrival <= a <= t]
        return max([floor + 1] + done)
    return progress


def window_figures(res: Result, progress, args: argparse.Namespace) -> None:
    p0, p1 = progress(res.t0), progress(res.t1)
    res.steps = p1 - p0
    span = res.t1 - res.t0
    res.steps_per_s = res.steps / span
    res.samples_per_s = res.steps_per_s * args.batch
    seg = args.segment
    n = int(span // seg)
    res.segment_rates = [(progress(res.t0 + (i + 1) * seg) - progress(res.t0 + i * seg)) / seg for i in range(n)]


# --------------------------------------------------------------------------- table


def fmt(x: Optional[float], spec: str) -> str:
    return "–" if x is None else format(x, spec)


def median(xs: List[float]) -> Optional[float]:
    return statistics.median(xs) if xs else None


def rows(results: List[Result], refs: Dict[str, Result]) -> List[List[str]]:
    out = []
    for r in results:
        ref = refs.get(r.mode)
        ratio = r.steps_per_s / ref.steps_per_s if ref and r.period and ref.steps_per_s else None
        detect = [1000 * (k.detect_t - k.t) for k in r.kills if k.detect_t is not None]
        back = [k.back_s for k in r.kills if k.back_s is not None]
        first = [k.first_step_s for k in r.kills if k.first_step_s is not None]
        if r.mode == "ft":
            lost = r.discarded / len(r.kills) if r.kills and r.discarded is not None else None
        else:
            ls = [k.lost for k in r.kills if k.lost is not None]
            lost = statistics.mean(ls) if ls else None
        spread = None
        if not r.period and r.segment_rates and r.steps_per_s:
            spread = 100 * (max(r.segment_rates) - min(r.segment_rates)) / r.steps_per_s
        out.append([
            LABELS[r.mode], "failure-free" if not r.period else f"{r.period:g}",
            str(len(r.kills)) if r.period else "0",
            f"{r.steps_per_s:.1f}", fmt(ratio, ".2f"), f"{r.samples_per_s:.0f}", fmt(ratio, ".2f"),
            fmt(lost, ".1f") if r.period else "–",
            fmt(median(detect), ".0f") if r.period else "–",
            (f"{median(back):.2f} / {max(back):.2f}" if back else "–") if r.period else "–",
            fmt(median(first), ".2f") if r.period else "–",
            fmt(spread, ".0f") + ("%" if spread is not None else ""),
            f"{r.load:.1f}",
        ])
    return out


HEADERS = ["mode", "T (s)", "kills", "steps/s", "ratio", "samples/s", "ratio", "lost steps/fail",
           "detect ms", "back s (med / max)", "1st step s", "5 s spread", "load"]


def markdown(table: List[List[str]]) -> str:
    lines = ["| " + " | ".join(HEADERS) + " |", "|" + "|".join("---" for _ in HEADERS) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in table]
    return "\n".join(lines)


def workload(args: argparse.Namespace) -> str:
    middle = f"(Linear({args.hidden}, {args.hidden}) - ReLU) x {args.depth - 1} - " if args.depth > 1 else ""
    params = args.dim * args.hidden + args.hidden + (args.depth - 1) * (args.hidden ** 2 + args.hidden) + args.hidden + 1
    optim = {"sgd": "SGD with momentum", "adam": "Adam", "adamw": "AdamW"}[args.optim]
    return (f"Linear({args.dim}, {args.hidden}) - ReLU - {middle}Linear({args.hidden}, 1) "
            f"({params / 1e6:.2f}M parameters), {optim}")


def verdict(results: List[Result], refs: Dict[str, Result]) -> List[str]:
    out = []
    ref = refs.get("ft")
    for r in results:
        if r.mode != "ft" or r.period != 10 or not ref:
            continue
        for other, target in (("group", 1.3), ("torchrun", 1.8)):
            peer = next((q for q in results if q.mode == other and q.period == r.period), None)
            if peer is not None and peer.samples_per_s:
                x = r.samples_per_s / peer.samples_per_s
                out.append(f"- (a) at T = 10 s commits {x:.2f}x the samples/s of {LABELS[other]} "
                           f"(target ≥ {target}x): {'met' if x >= target else 'NOT met'}.")
        ratio = r.samples_per_s / ref.samples_per_s if ref.samples_per_s else 0.0
        back = [k.back_s for k in r.kills if k.back_s is not None]
        out.append(f"- (a) at T = 10 s keeps {100 * ratio:.0f}% of failure-free committed samples/s "
                   f"(target ≥ 90%): {'met' if ratio >= 0.9 else 'NOT met'}.")
        if back:
            ok = max(back) <= 3.0
            out.append(f"- (a) a killed replica takes part again after {statistics.median(back):.2f} s median, "
                       f"{max(back):.2f} s at most over {len(back)} kills (target ≤ 3 s): "
                       f"{'met' if ok else ('met by the median, not by every kill' if statistics.median(back) <= 3 else 'NOT met')}.")
    return out


def write_doc(path: Path, block: str) -> None:
    text = f"{BEGIN}\n{block}\n{END}\n"
    if path.exists():
        old = path.read_text()
        if BEGIN in old and END in old:
            head, rest = old.split(BEGIN, 1)
            _, tail = rest.split(END, 1)
            path.write_text(head + text + tail.lstrip("\n"))
            return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("# Chaos benchmark: throughput and recovery under periodic SIGKILLs\n\n" + text
                    + "\n## Analysis\n\n(to be written from the figures above)\n")


# --------------------------------------------------------------------------- main


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=60.0, help="seconds of each chaos window (default 60)")
    p.add_argument("--ref-duration", type=float, default=None,
                   help="seconds of each failure-free window (default: half of --duration, 10 to 30)")
    p.add_argument("--periods", type=float, nargs="+", default=[5.0, 10.0], help="kill periods T in seconds")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--seed", type=int, default=5)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--depth", type=int, default=1, help="hidden layers of HIDDEN x HIDDEN after the first")
    p.add_argument("--optim", choices=["sgd", "adam", "adamw"], default="sgd", help="SGD with momentum, Adam or AdamW")
    p.add_argument("--batch", type=int, default=96, help="global batch: split over the 3 workers")
    p.add_argument("--lr", type=float, default=0.005)
    p.add_argument("--ckpt-every", type=int, default=50, help="snapshot period of train_ddp.py in steps")
    p.add_argument("--warmup", type=int, default=30, help="steps before the window starts")
    p.add_argument("--segment", type=float, default=5.0, help="segment length for the spread column")
    p.add_argument("--start-timeout", type=float, default=120.0)
    p.add_argument("--settle-timeout", type=float, default=60.0)
    p.add_argument("--markdown", action="store_true", help="also print the table as markdown")
    p.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "chaos.md"), help="markdown file to write ('' for none)")
    p.add_argument("--json", default=None, help="write raw per-kill figures here")
    p.add_argument("--keep", action="store_true", help="keep the temporary folder (launcher logs)")
    p.add_argument("--torchrun-shared-store", action="store_true",
                   help="run torchrun as it comes (shared rendezvous store); its restarts fail with torch 2.13, "
                        "see the docstring")
    args = p.parse_args()
    ref_duration = args.ref_duration or max(10.0, min(30.0, args.duration / 2))

    from rich.console import Console
    from rich.table import Table

    console = Console(stderr=True)
    tmp = Path(tempfile.mkdtemp(prefix="ftrun-bench-chaos-"))
    up0 = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "ftrun"], capture_output=True, text=True,
                           cwd=ROOT).stdout.split("\n")
    dirty = [line[3:] for line in dirty if line.strip()]
    began = time.time()
    refs: Dict[str, Result] = {}
    results: List[Result] = []
    for mode in args.modes:
        try:
            rs = run_mode(mode, args, tmp, ref_duration, console)
        except RuntimeError as e:
            console.print(f"[red]{e}[/]")
            continue
        for r in rs:
            for a in r.anomalies:
                console.print(f"[yellow]  {a}[/]")
            console.print(f"  {'failure-free' if r.period is None else f'T = {r.period:g} s'}: {r.steps} steps in "
                          f"{r.t1 - r.t0:.0f} s ({r.steps_per_s:.1f}/s), {len(r.kills)} kills"
                          + (f", {len(r.survivor_restarts)} survivor restarts, {len(r.survivor_rejoins)} survivors "
                             f"healed in place" if mode == "ft" else ""))
            for line in r.survivor_restarts + r.survivor_rejoins:
                console.print(f"    survivor: {line}", markup=False)
            if r.period is None:
                refs[mode] = r
        results += rs
    # rows: the failure-free ones first, then by period
    results.sort(key=lambda r: (r.period or 0, MODES.index(r.mode)))
    up1 = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    table = rows(results, refs)

    t = Table(title=f"Chaos benchmark: {NPROC} workers, {args.duration:g} s windows, {os.cpu_count()} CPU cores")
    for h in HEADERS:
        t.add_column(h, justify="left" if h == "mode" else "right")
    for r in table:
        t.add_row(*r)
    Console(width=max(160, Console().width)).print(t)
    md = markdown(table)
    if args.markdown:
        print(md)
    lines = verdict(results, refs)
    for v in lines:
        print(v)
    anomalies = [f"- {LABELS[r.mode]}, {'failure-free' if not r.period else f'T = {r.period:g} s'}: {a}"
                 for r in results for a in r.anomalies]
    cmd = "python scripts/bench_chaos.py" + "".join(
        f" {k} {v}" for k, v in (("--duration", f"{args.duration:g}"), ("--periods", " ".join(f"{x:g}" for x in args.periods)),
                                 ("--seed", args.seed)))
    cmd += "".join(f" --{k.replace('_', '-')} {getattr(args, k)}" for k in ("ref_duration", "dim", "hidden", "depth",
                                                                            "optim", "lr", "ckpt_every")
                   if getattr(args, k) != p.get_default(k))
    block = "\n".join([
        f"Run: `{cmd}` on {time.strftime('%Y-%m-%d %H:%M', time.localtime(began))}, {os.cpu_count()} CPU cores, "
        f"torch CPU/gloo, took {(time.time() - began) / 60:.1f} min. "
        f"Workload: {workload(args)}, global batch {args.batch} "
        f"({args.batch // NPROC} per worker), 3 workers; snapshots every {args.ckpt_every} steps for (b) and (c). "
        f"Failure-free windows {ref_duration:g} s, chaos windows {args.duration:g} s. "
        f"Code: commit {head or '?'}" + (f" plus uncommitted changes to {', '.join(dirty)}" if dirty else "") + ".",
        "",
        f"Load before: `{up0}`  ",
        f"Load after: `{up1}`",
        "",
        md,
        "",
        *(lines or ["- (targets apply to (a) at T = 10 s, which this run did not include)"]),
        *(["", "Anomalies seen in this run:", ""] + anomalies if anomalies else []),
    ])
    if args.out:
        write_doc(Path(args.out), block)
        console.print(f"wrote {args.out}")
    if args.json:
        raw = [{"mode": r.mode, "period": r.period, "steps": r.steps, "steps_per_s": r.steps_per_s,
                "window": [r.t0, r.t1], "discarded": r.discarded, "load": r.load, "startup_s": r.startup_s,
                "segment_rates": r.segment_rates, "launcher_rc": r.launcher_rc, "anomalies": r.anomalies,
                "survivor_restarts": r.survivor_restarts, "survivor_rejoins": r.survivor_rejoins,
                "kills": [k.__dict__ for k in r.kills]} for r in results]
        Path(args.json).write_text(json.dumps(raw, indent=1))
    if args.keep:  # out of the scratch folder (scripts/scratch.py), which goes when the benchmark ends
        import shutil

        kept = Path(shutil.copytree(tmp, Path(tempfile.gettempdir()).parent / tmp.name, symlinks=True))
        console.print(f"launcher logs kept in {kept}")
    else:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    scratch.run(main)
