"""What --ft is for, in half a minute: one replica dies, restarts alone and heals from a peer
while the others keep training, and every replica ends bitwise identical.

Runs `ftrun --nproc 3 --ft scripts/train_ft.py` and shows its console as it comes. Once the
replicas are training, it sends SIGKILL to one of them (its pid from `ftrun status --json`),
then says what happened and checks it: the killed replica restarted alone, it healed from a
peer (in how many seconds), the others went on taking steps while it was away, and all
replicas print the same parameter checksum at the end. Exits 1 if any of that is not so.
Every wait is for a condition, with a deadline. Run it with scripts/demo.sh.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, List, Optional

ROOT = Path(__file__).resolve().parent.parent
FTRUN = [sys.executable, "-m", "ftrun"]
WAIT_S = 120.0  # the longest any one wait may take on a slow machine
_print_lock = threading.Lock()


def say(text: str) -> None:
    with _print_lock:
        print(f"demo: {text}", flush=True)


class Demo:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.run_id = f"demo-{os.getpid()}"
        self.lines: List[str] = []
        self.proc: Optional[subprocess.Popen] = None
        self.echo: Optional[threading.Thread] = None

    # ------------------------------------------------------------------ the run and its console
    def start(self) -> None:
        a = self.args
        argv = ["--nproc", str(a.replicas), "--ft", "--run-id", self.run_id, "scripts/train_ft.py",
                "--steps", str(a.steps), "--step-sleep", "0.02", "--print-every", str(a.print_every)]
        say("$ ftrun " + " ".join(argv))
        self.proc = subprocess.Popen(FTRUN + argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, bufsize=1)
        self.echo = threading.Thread(target=self._echo, daemon=True)
        self.echo.start()

    def _echo(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            with _print_lock:
                sys.stdout.write(line)
                sys.stdout.flush()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # ftrun stops its workers and exits
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    # ------------------------------------------------------------------ what `ftrun status` says
    def status(self) -> Optional[dict]:
        r = subprocess.run(FTRUN + ["status", "--json", self.run_id], cwd=ROOT, capture_output=True, text=True,
                           timeout=30)
        if r.returncode != 0:  # no state file yet
            return None
        runs = json.loads(r.stdout)
        return runs[0] if runs else None

    def wait_for(self, what: str, pred: Callable[[dict], bool],
                 seen: Optional[Callable[[dict], None]] = None) -> dict:
        """The run's status once pred(status) holds; fails when the run ends first or after WAIT_S.
        seen(status), if given, is shown every status read on the way."""
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            st = self.status()
            if st is not None and seen is not None:
                seen(st)
            if st is not None and pred(st):
                return st
            if self.proc is not None and self.proc.poll() is not None:
                raise SystemExit(f"demo: the run ended (exit {self.proc.returncode}) before {what}")
            time.sleep(0.1)
        raise SystemExit(f"demo: no {what} within {WAIT_S:.0f} s")

    # ------------------------------------------------------------------ the demo
    def run(self) -> None:
        a = self.args
        victim = a.kill_rank
        self.start()

        def reps(st: dict) -> dict:
            return {r["rank"]: r for r in st["replicas"]}

        st = self.wait_for(f"rank {victim} at step {a.kill_at}",
                           lambda st: all(r["state"] == "running" for r in st["replicas"])
                           and reps(st)[victim]["step"] >= a.kill_at)
        pid = reps(st)[victim]["pid"]
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        others = [r for r in reps(st) if r != victim]
        before = {r: reps(st)[r]["step"] for r in others}
        say(f"SIGKILL to rank {victim} (pid {pid}) at step {reps(st)[victim]['step']}")

        # Each rank reports its step 4 times a second, so one status read may show a survivor's
        # step from before the kill; the survivors all-reduce together (one is never ahead of
        # another by more than a step), so the highest step any of them showed while the victim
        # was away is how far they all went. A survivor that restarted would not count.
        after = dict(before)
        pids = {r: reps(st)[r]["pid"] for r in others}

        def note(st: dict) -> None:
            for r in others:
                if reps(st)[r]["pid"] == pids[r]:
                    after[r] = max(after[r], reps(st)[r]["step"])

        st = self.wait_for(f"rank {victim} training again",
                           lambda st: reps(st)[victim]["restarts"] >= 1 and reps(st)[victim]["pid"] != pid
                           and reps(st)[victim]["state"] == "running", seen=note)
        away = time.monotonic() - killed_at
        same = all(reps(st)[r]["pid"] == pids[r] and reps(st)[r]["restarts"] == 0 for r in others)
        went_on = same and max(after.values()) > max(before.values())
        say(f"while rank {victim} was away (about {away:.1f} s), "
            + ", ".join(f"rank {r} went from step {before[r]} to {after[r]}" for r in others)
            + (" in the same processes: they never stopped" if went_on else ": THEY STOPPED"))

        try:
            code = self.proc.wait(WAIT_S)
        except subprocess.TimeoutExpired:
            raise SystemExit(f"demo: the run did not finish within {WAIT_S:.0f} s") from None
        self.echo.join(10)  # ftrun's last lines (the checksums, the end) are read once its output closes
        final = self.status() or {}
        self.summary(code, final, victim, went_on)

    def summary(self, code: int, final: dict, victim: int, went_on: bool) -> None:
        text = "\n".join(self.lines)
        restarts = {r["rank"]: r["restarts"] for r in final.get("replicas", [])}
        alone = restarts.get(victim) == 1 and all(n == 0 for r, n in restarts.items() if r != victim)
        heal = re.search(rf"rank {victim} is training again, healed from a peer ([\d.]+) s after it failed", text)
        transfer = next((r.get("last_heal_s") for r in final.get("replicas", []) if r["rank"] == victim), None)
        sums = dict(re.findall(r"\[rank (\d+)\] parameters sha256 (\w+)", text))
        identical = len(sums) == self.args.replicas and len(set(sums.values())) == 1
        checks = [
            (code == 0, f"the run finished (exit {code})"),
            (alone, f"rank {victim} restarted alone (restarts per rank: "
                    + ", ".join(f"{r}: {n}" for r, n in sorted(restarts.items())) + ")"),
            (heal is not None, f"rank {victim} healed from a peer and was training again "
                               f"{heal.group(1) if heal else '?'} s after it died"
                               + (f" (the state transfer itself: {transfer:.2f} s)" if transfer else "")),
            (went_on, "the other replicas kept training while it was away"),
            (identical, f"all {self.args.replicas} replicas ended with identical parameters "
                        f"(sha256 {', '.join(sorted(set(sums.values()))) or 'none printed'})"),
        ]
        for ok, line in checks:
            say(("ok: " if ok else "NOT SO: ") + line)
        if not all(ok for ok, _ in checks):
            raise SystemExit(1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--kill-rank", type=int, default=1)
    ap.add_argument("--kill-at", type=int, default=200, help="kill once the replica is at this step")
    ap.add_argument("--print-every", type=int, default=100)
    args = ap.parse_args()
    if not 0 <= args.kill_rank < args.replicas or args.replicas < 2 or not 0 < args.kill_at < args.steps:
        ap.error("need 2+ replicas, 0 <= --kill-rank < --replicas and 0 < --kill-at < --steps")
    demo = Demo(args)
    try:
        demo.run()
    finally:
        demo.stop()


if __name__ == "__main__":
    main()
