"""Quorum benchmark: the --ft vote protocol with N replicas and no model, against the real store.

    .venv/bin/python scripts/bench_quorum.py                 # N = 8, 64, 256, 1024
    .venv/bin/python scripts/bench_quorum.py --sizes 8,64    # quicker
    .venv/bin/python scripts/bench_quorum.py --failover 5    # the store's node lost: time to the next commit

One process hosts the run's TCPStore and the supervisor's quorum keeper
(ftrun.supervisor.ft.quorum.QuorumKeeper, polled every 50 ms as in a run: joins,
healed flags, status reports, key collection). N replica clients, spread
over --procs processes of threads, each with its own store connection, vote
round after round with ftrun.worker.ft.member.vote.cast (the code a replica runs
in opt.step()) and write their status report every 0.25 s as a replica's
heartbeat does. With --per-node P they vote and report through their
node's store, and each node's relay (ftrun.supervisor.relay.NodeRelay)
copies its members' reports into the node's one key of the run's store.
Measured per N:

- commit latency: per round, from the moment its last vote is cast to the
  moment the last member knows the decision (median, p99 over rounds): the
  protocol's own cost, without the lateness of straggling threads; and a
  member's whole wait (vote to decision, stragglers included), median;
- rounds per second;
- the run's store's requests per round, by the members and the nodes'
  relays (counted at each call; a blocking read is two requests on the wire:
  wait, then get) and by the keeper;
- the keeper's CPU time per second of run, and the store's key count at the
  start and at the end of the rounds (flat when old rounds are collected).

On this 2-core machine the N clients are Python threads sharing two cores
with the store and the keeper: the figures are an upper bound of what a
real run (one replica per process, on many machines) sees.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Callable, List, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch.distributed as dist  # noqa: E402

from ftrun import keys, votes  # noqa: E402
from ftrun.worker.ft.member import vote  # noqa: E402
from ftrun.wire import MemberReport, Quorum  # noqa: E402
import scratch  # noqa: E402

TIMEOUT = datetime.timedelta(seconds=120)


class Counting:
    """A store client that counts the requests it sends."""

    WIRE = {"get": 2, "multi_get": 2}

    def __init__(self, store: dist.TCPStore) -> None:
        self.store = store
        self.requests = 0

    def __getattr__(self, name: str):
        fn = getattr(self.store, name)

        def call(*a, **kw):
            self.requests += self.WIRE.get(name, 1)
            return fn(*a, **kw)

        return call


class _RunStore:
    """What the keeper expects of the supervisor's RunStore: the client under `.store`."""

    def __init__(self, store) -> None:
        self.store = store


class _Here:
    """A node's store on the forwarder's own machine, left out of the run's store's part (its
    round trips are measured by the one-node run)."""

    def set(self, key: str, value) -> None:
        pass


def _info(rnd: int, phase: str = "vote") -> dict:
    """A member's report in quorum 1 as the JSON object its codec writes (ftrun.wire.MemberReport)."""
    return json.loads(MemberReport(inc=0, quorum_id=1, round=rnd, phase=phase, beat=rnd).encode())


def _vote_rounds(report: Callable[[int], None], rounds: int, start: threading.Barrier,
                 vote_once: Callable[[int], bool]) -> Tuple[list, float, float]:
    """One member's rounds: `report(round)` every 0.25 s (its status report, as
    ftrun.worker.progress writes it) and `vote_once(round)`. Returns each vote's (start, decision
    known) and the span."""
    mine = []
    start.wait()
    began = time.monotonic()
    next_report = 0.0
    for rnd in range(rounds):
        now = time.monotonic()
        if now >= next_report:
            report(rnd)
            next_report = now + 0.25
        t0 = time.monotonic()
        assert vote_once(rnd)
        mine.append((t0, time.monotonic()))
    return mine, began, time.monotonic()


def _run_threads(targets: list) -> None:
    threads = [threading.Thread(target=fn, args=args) for fn, args in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def replicas(port: int, ranks: list, size: int, rounds: int, out: "mp.Queue", go, weight: int = 0) -> None:
    """Members (or, with `weight`, nodes' forwarders each adding its node's count of `weight`
    and writing its node's relayed reports) voting in the run's store, one thread each."""
    sys.setswitchinterval(0.0002)  # many threads in one process: hand the GIL on quickly
    lat, requests, span = [], [], []
    start = threading.Barrier(len(ranks), action=go.wait)  # every process's members start together

    def one(rank: int) -> None:
        s = Counting(dist.TCPStore("127.0.0.1", port, None, False, TIMEOUT))

        def vote_once(rnd: int) -> bool:
            if weight:  # a node's forwarder: its node's whole count in one add
                return vote.forward(s, _Here(), rank, 1, rnd, size, weight * votes.OK_VOTE, 1)[0].startswith("commit")
            return vote.cast(s, 1, rnd, size, True, 1)[0]

        def report(rnd: int) -> None:
            if weight:  # as the node's relay writes its members' reports: one key for the node
                s.set(keys.node_info_key(rank), json.dumps({str(rank * weight + i): _info(rnd) for i in range(weight)}))
            else:
                s.set(keys.info_key(rank), json.dumps(_info(rnd)))

        mine, began, ended = _vote_rounds(report, rounds, start, vote_once)
        lat.append(mine)
        requests.append(s.requests)
        span.append((began, ended))

    _run_threads([(one, (r,)) for r in ranks])
    out.put((lat, sum(requests), min(b for b, _ in span), max(e for _, e in span)))


def relayed_replicas(port: int, nodes: list, per_node: int, size: int, rounds: int, out: "mp.Queue", go) -> None:
    """Whole nodes in one process: each node's store (as its ftrun hosts it), its relay's upkeep
    (ftrun.supervisor.relay.NodeRelay, every 50 ms as in a run), and its `per_node` members, who
    vote and report through it (vote.cast with their vote.Node): the run's store sees the
    forwarders and the relays only."""
    from ftrun.supervisor.relay import NodeRelay

    sys.setswitchinterval(0.0002)
    servers = {k: dist.TCPStore("127.0.0.1", 0, None, True, TIMEOUT, wait_for_workers=False) for k in nodes}
    lat, requests, local_requests, span = [], [], [], []
    start = threading.Barrier(len(nodes) * per_node, action=go.wait)
    stop = threading.Event()

    relays_run = Counting(dist.TCPStore("127.0.0.1", port, None, False, TIMEOUT))

    def upkeep() -> None:
        relays = []
        for k in nodes:
            local = dist.TCPStore("127.0.0.1", servers[k].port, None, False, TIMEOUT)
            relays.append(NodeRelay(k, list(range(k * per_node, (k + 1) * per_node)), lambda c=local: c,
                                    lambda: relays_run))
        while not stop.is_set():
            for r in relays:
                r.poll(time.monotonic())
            stop.wait(0.05)

    def one(node: int, rank: int) -> None:
        s = Counting(dist.TCPStore("127.0.0.1", port, None, False, TIMEOUT))
        local = Counting(dist.TCPStore("127.0.0.1", servers[node].port, None, False, TIMEOUT))
        me = vote.Node(node, node * per_node, per_node, local)
        mine, began, ended = _vote_rounds(lambda rnd: local.set(keys.info_key(rank), json.dumps(_info(rnd))),
                                          rounds, start,
                                          lambda rnd: vote.cast(s, 1, rnd, size, True, 1, me, per_node)[0])
        lat.append(mine)
        requests.append(s.requests)
        local_requests.append(local.requests)
        span.append((began, ended))

    keeper = threading.Thread(target=upkeep, daemon=True)
    keeper.start()
    _run_threads([(one, (k, k * per_node + i)) for k in nodes for i in range(per_node)])
    stop.set()
    keeper.join()
    out.put((lat, sum(requests) + relays_run.requests, min(b for b, _ in span), max(e for _, e in span),
             sum(local_requests)))


def _keeper(n: int, per_node: int = 0):
    """A store server, a counting client and the supervisor's keeper with N members in quorum 1
    (per_node P: as N/P relaying nodes of P, whose reports it reads in one key per node)."""
    from ftrun.supervisor.ft.quorum import QuorumKeeper
    from ftrun.supervisor.relay import Routes

    server = dist.TCPStore("127.0.0.1", 0, None, True, TIMEOUT, wait_for_workers=False)
    client = Counting(dist.TCPStore("127.0.0.1", server.port, None, False, TIMEOUT))
    # No member dies here: the keeper never dials a node's store, whose address is left out.
    routes = Routes({k: ("127.0.0.1:0", list(range(k * per_node, (k + 1) * per_node)))
                     for k in range(n // per_node)}) if per_node else None
    keeper = QuorumKeeper(_RunStore(client), list(range(n)), routes=routes)
    for r in range(n):
        keeper.on_spawn(r, 0)
    keeper.on_store_ready()
    members = tuple((r, 0) for r in range(n))
    keeper.quorum_id, keeper.members = 1, dict(members)
    keeper.quorums[1] = set(members)
    return server, client, keeper


def measure(n: int, rounds: int, procs: int, per_node: int = 0, forwarders: bool = False) -> dict:
    """per_node P: the replicas are n/P nodes of P voting through their nodes' relays, all on this
    machine. forwarders: only what the run's store sees of that (n/P forwarders, each adding its
    node's count of P), the part that grows with the run; a node's own round trips happen on its
    own machine, in parallel with the other nodes', and are measured by a run of one node."""
    server, client, keeper = _keeper(n, per_node)
    port = server.port
    members = tuple((r, 0) for r in range(n))
    client.set(keys.quorum_key(1), Quorum(1, members, (), False, 0).to_json())
    client.set(keys.LATEST, "1")
    client.requests = 0
    stop = threading.Event()
    ticks = [0]

    def keep() -> None:
        while not stop.is_set():
            keeper.poll(time.time())
            ticks[0] += 1
            stop.wait(0.05)

    # Forked by a fork server, not by this process: this one runs the store's server and the
    # keeper's thread, and a child forked while a thread here was in a call of torch's store
    # client (which holds a lock for its wait counters) waited for that lock for ever in its
    # first add: round 0 never closed (seen in gdb). Spawned clients are safe too, but their
    # rounds measured about a third slower (8 replicas: 0.61-0.78 ms against 0.41-0.58 ms).
    ctx = mp.get_context("forkserver")
    q: "mp.Queue" = ctx.Queue()
    if per_node:
        nodes = list(range(n // per_node))
        chunks = [nodes[i::procs] for i in range(min(procs, len(nodes)))]
    else:
        chunks = [list(range(n))[i::procs] for i in range(min(procs, n))]
    go = ctx.Barrier(len(chunks), timeout=300)
    if forwarders:
        workers = [ctx.Process(target=replicas, args=(port, c, n, rounds, q, go, per_node), daemon=True) for c in chunks]
    elif per_node:
        workers = [ctx.Process(target=relayed_replicas, args=(port, c, per_node, n, rounds, q, go), daemon=True) for c in chunks]
    else:
        workers = [ctx.Process(target=replicas, args=(port, c, n, rounds, q, go), daemon=True) for c in chunks]
    keys_before = server.num_keys()
    for w in workers:
        w.start()
    kt = threading.Thread(target=keep, daemon=True)
    kt.start()
    results = [q.get(timeout=900) for _ in workers]
    stop.set()
    kt.join()
    for w in workers:
        w.join()
    keeper._collected_when = 0.0  # a last collection now, as the next period's poll would do
    keeper.poll(time.time())
    # A round's commit latency: from the moment its last vote was cast to the moment the last
    # member knew the decision (the protocol's own cost, without the stragglers' lateness).
    per_member = [m for r in results for m in r[0]]
    lat = sorted(max(m[k][1] for m in per_member) - max(m[k][0] for m in per_member) for k in range(rounds))
    wait = sorted(e - b for m in per_member for b, e in m)
    member_requests = sum(r[1] for r in results)
    wall = max(r[3] for r in results) - min(r[2] for r in results)  # the rounds themselves, not start-up
    out = {
        "n": n, "nodes": n // per_node if per_node else n, "relayed": bool(per_node),
        "node_requests_per_round": sum(r[4] for r in results) / rounds if per_node and not forwarders else 0.0,
        "part": "forwarders" if forwarders else "whole",
        "rounds": rounds, "rounds_per_s": rounds / wall,
        "median_ms": 1e3 * statistics.median(lat), "p99_ms": 1e3 * lat[int(0.99 * (len(lat) - 1))],
        "member_wait_median_ms": 1e3 * statistics.median(wait),
        "member_requests_per_round": member_requests / rounds,
        "keeper_requests_per_round": client.requests / rounds, "keeper_ticks": ticks[0],
        "keys_before": keys_before, "keys_after": server.num_keys(), "wall_s": wall,
    }
    return out


def keeper_cpu_fraction(n: int, seconds: float, per_node: int = 0) -> float:
    """The keeper's own CPU per second of wall time, polling N replicas whose reports all
    change every tick (the worst case: every report is parsed); per_node P: relayed, N/P keys."""
    server, _, keeper = _keeper(n, per_node)
    writer = dist.TCPStore("127.0.0.1", server.port, None, False, TIMEOUT)
    spent, t0, beat = 0.0, time.monotonic(), 0
    while time.monotonic() - t0 < seconds:
        beat += 1
        info = _info(beat, "compute")
        if per_node:
            nodes = range(n // per_node)
            writer.multi_set([keys.node_info_key(k) for k in nodes],
                             [json.dumps({str(k * per_node + i): info for i in range(per_node)}) for k in nodes])
        else:
            writer.multi_set([keys.info_key(r) for r in range(n)], [json.dumps(info)] * n)
        c = time.thread_time()
        keeper.poll(time.time())
        spent += time.thread_time() - c
        time.sleep(0.05)
    return spent / (time.monotonic() - t0)


def _replica(home: Path, run: str, node: int) -> dict:
    try:
        st = json.loads((home / f"{run}.node{node}" / "state.json").read_text())
        return next(r for r in st["replicas"] if r["rank"] == node)
    except (OSError, ValueError, StopIteration, KeyError):
        return {}


def failover_once(i: int, root: Path, c10d: bool = False) -> float:
    """Three real ftruns as three nodes over loopback (one replica each, 1.3M parameters with
    Adam), static or (`c10d`) elastic with the same line on each; node 0's whole process tree
    SIGKILLed at step 30 or later. Returns the seconds from the kill to the first step a
    survivor commits past the kill (its state file, written every 0.2 s at most: the figure
    is that coarse)."""
    import signal
    import socket
    import subprocess

    import psutil

    home = root / f"home{i}"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, FTRUN_HOME=str(home), FTRUN_NODE_TIMEOUT="3")
    ftrun = [sys.executable, "-m", "ftrun"]
    train = Path(__file__).with_name("train_ft.py")
    script = [str(train), "--steps", "100000", "--step-sleep", "0.02", "--dim", "256", "--hidden", "512",
              "--depth", "5", "--optim", "adam", "--lr", "0.001"]

    def line(k: int) -> List[str]:
        if c10d:  # the first started hosts the endpoint and is node 0; the others take 1 and 2
            return ["--nnodes", "3:4", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                    f"127.0.0.1:{port}", "--rdzv-conf", "last_call_timeout=1", "--ft", "--run-id", "fo", *script]
        return ["--nnodes", "3", "--node-rank", str(k), "--master-addr", "127.0.0.1", "--master-port", str(port),
                "--nproc", "1", "--ft", "--run-id", "fo", *script]

    procs = {}
    for k in (0, 1, 2) if c10d else (2, 1, 0):
        procs[k] = subprocess.Popen(ftrun + line(k), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while c10d and k == 0:  # the endpoint is up before the others come
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.05)
    try:
        deadline = time.monotonic() + 180
        while min(_replica(home, "fo", k).get("step", 0) for k in (1, 2)) < 30:
            if time.monotonic() > deadline:
                raise SystemExit("the three nodes never trained")
            time.sleep(0.05)
        family = [procs[0].pid] + [c.pid for c in psutil.Process(procs[0].pid).children(recursive=True)]
        at = _replica(home, "fo", 1).get("step", 0)
        t0 = time.monotonic()
        for pid in family:
            os.kill(pid, signal.SIGKILL)
        while _replica(home, "fo", 1).get("step", 0) <= at + 1:
            if time.monotonic() - t0 > 120:
                raise SystemExit("no step committed within 120 s of the kill")
            time.sleep(0.01)
        return time.monotonic() - t0
    finally:
        for p in procs.values():
            p.kill()
            p.wait()


def failover(runs: int) -> None:
    import tempfile

    print("\n| store host SIGKILLed (3 nodes, --ft) | runs | to the next committed step: median | min - max | target |")
    print("|---|---:|---:|---:|---:|")
    for c10d in (False, True):
        with tempfile.TemporaryDirectory() as d:
            took = [failover_once(i, Path(d), c10d) for i in range(runs)]
        what = "elastic c10d (`--nnodes 3:4`), the endpoint's node" if c10d else "static, node 0"
        print(f"| {what}, with its workers | {runs} | {statistics.median(took):.2f} s | "
              f"{min(took):.2f} - {max(took):.2f} s | < 10 s |")
        print(json.dumps({"c10d": c10d, "failover_s": [round(t, 2) for t in took]}), file=sys.stderr)
    print(f"\nnode timeout 3 s (the default); load average {os.getloadavg()[0]:.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="8,64,256,1024")
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--json", default=None)
    ap.add_argument("--per-node", type=int, default=0, metavar="P",
                    help="replicas as N/P nodes of P, voting through their node's relay (0: every replica "
                         "votes in the run's store, as on one node)")
    ap.add_argument("--failover", type=int, default=0, metavar="RUNS",
                    help="instead: kill the store's node of a 3-node --ft run RUNS times, time the next commit")
    args = ap.parse_args()
    if args.failover:
        failover(args.failover)
        return
    rows = []
    for n in (int(x) for x in args.sizes.split(",")):
        rounds = max(20, min(400, 20000 // n))
        row = measure(n, rounds, args.procs, args.per_node)
        row["keeper_cpu"] = keeper_cpu_fraction(n, 3.0, args.per_node)
        rows.append(row)
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
        if args.per_node and n > args.per_node:
            # The run's store's part alone (forwarders), as when each node is its own machine.
            part = measure(n, max(100, rounds), args.procs, args.per_node, forwarders=True)
            part["keeper_cpu"] = row["keeper_cpu"]
            rows.append(part)
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in part.items()}), flush=True)
    print()
    print("| replicas | nodes | rounds | commit latency median | p99 | member's wait (median) | rounds/s | run's store requests "
          "per round: members and relays (per node) | keeper | keeper CPU | store keys before / after |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        nodes = f"{r['nodes']} x {r['n'] // r['nodes']}" if r["relayed"] else "flat"
        if r.get("part") == "forwarders":
            nodes += " (the run's store's part: forwarders only)"
        print(f"| {r['n']} | {nodes} | {r['rounds']} | {r['median_ms']:.2f} ms | {r['p99_ms']:.2f} ms | "
              f"{r['member_wait_median_ms']:.2f} ms | {r['rounds_per_s']:.0f} | "
              f"{r['member_requests_per_round']:.0f} ({r['member_requests_per_round'] / r['nodes']:.2f}) | "
              f"{r['keeper_requests_per_round']:.1f} | {100 * r['keeper_cpu']:.1f}% | {r['keys_before']} / {r['keys_after']} |")
    print(f"\n{args.procs} client processes of threads; load average {os.getloadavg()[0]:.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    scratch.run(main)
