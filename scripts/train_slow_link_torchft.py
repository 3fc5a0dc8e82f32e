"""scripts/train_slow_link.py's model, data and figures under torchft 0.2's DiLoCo, the peer that
scripts/bench_slow_link.py sets beside ftrun's `--hook diloco` (run in a scratch venv with
torchft installed: `--torchft-python`).

One process is one replica group of one worker, started by the benchmark in its node's network
namespace with no launcher: it hosts its group's TCPStore, and torchft's Manager (asking the
lighthouse at --lighthouse for each quorum) and its ProcessGroupGloo carry the syncs between the
groups. The loop is torchft's own DiLoCo usage (torchft.local_sgd.DiLoCo around the inner
AdamW, SGD with Nesterov momentum as the outer optimizer, the same defaults as ftrun's), on the
same MLP, teacher, batches and held-out set as the DDP script; it writes the same JSON.

Must never import ftrun: it is the other system the benchmark measures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_slow_link import Teacher, mlp, tx_bytes  # noqa: E402  (the same model, data and counter)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--group", type=int, required=True, help="this replica group's index (0 or 1)")
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--addr", required=True, help="this node's address on the link (its store and manager)")
    p.add_argument("--store-port", type=int, required=True)
    p.add_argument("--lighthouse", required=True, help="http://HOST:PORT of torchft_lighthouse")
    p.add_argument("--sync-every", type=int, default=20)
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--outer-momentum", type=float, default=0.9)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--classes", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--heldout", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--iface", default=os.environ.get("GLOO_SOCKET_IFNAME"))
    p.add_argument("--out", default=None)
    return p.parse_args()


def main() -> None:
    from torchft.local_sgd import DiLoCo
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    args = parse()
    # torchft's checkpoint server (a heal's transfer) advertises socket.gethostname(); in the
    # benchmark's network namespaces the machine's name resolves to no address on the link.
    socket.gethostname = lambda: args.addr
    torch.set_num_threads(1)
    device = torch.device("cpu")
    # The group's own store (a launcher would host it): the manager and the group's gloo meet there.
    store = dist.TCPStore(args.addr, args.store_port, 1, True, timeout=timedelta(seconds=60), wait_for_workers=False)
    torch.manual_seed(args.seed)  # the same initial model as the DDP script's (its DDP broadcasts rank 0's)
    model = mlp(args.dim, args.hidden, args.depth, args.classes).to(device)
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr)
    outer = torch.optim.SGD(model.parameters(), lr=args.outer_lr, momentum=args.outer_momentum,
                            nesterov=args.outer_momentum > 0)

    def state_dict():
        return {"model": model.state_dict(), "inner": inner.state_dict()}

    def load_state_dict(sd):
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["inner"])

    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=60)), min_replica_size=args.groups,
                      load_state_dict=load_state_dict, state_dict=state_dict, replica_id=f"group{args.group}",
                      store_addr=args.addr, store_port=args.store_port, rank=0, world_size=1,
                      lighthouse_addr=args.lighthouse, hostname=args.addr, use_async_quorum=False,
                      # Both groups start from the same seeded model, as DDP's ranks do after its
                      # broadcast at construction: no transfer of the state at the first sync.
                      init_sync=False,
                      timeout=timedelta(seconds=60), quorum_timeout=timedelta(seconds=60),
                      connect_timeout=timedelta(seconds=60))
    loss_fn = nn.CrossEntropyLoss()
    teacher = Teacher(args.dim, args.classes, args.seed, device)
    train_g = torch.Generator().manual_seed(1 + args.seed * 1000 + args.group)
    hx, hy = teacher.batch(args.heldout, torch.Generator().manual_seed(999_999 + args.seed))
    with DiLoCo(manager, [model], inner, outer, sync_every=args.sync_every, backup_device=device, pin_memory=False):
        for step in range(1, args.steps + 1):
            if step == args.warmup + 1:
                t0, b0 = time.perf_counter(), tx_bytes(args.iface)
            x, y = teacher.batch(args.batch, train_g)
            inner.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()
            inner.step()
    elapsed, b1 = time.perf_counter() - t0, tx_bytes(args.iface)
    timed = args.steps - args.warmup
    with torch.no_grad():
        heldout = loss_fn(model(hx), hy).item()
    result = {"rank": args.group, "world": args.groups, "params": sum(p.numel() for p in model.parameters()),
              "steps": args.steps, "timed_steps": timed, "steps_per_s": timed / elapsed, "heldout_loss": heldout,
              "chance_loss": math.log(args.classes),
              "tx_bytes_per_step": (b1 - b0) / timed if b0 is not None and b1 is not None else None,
              "iface": args.iface, "device": str(device), "manager_step": manager.current_step()}
    print(json.dumps(result), flush=True)
    if args.out:
        Path(f"{args.out}.rank{args.group}.json").write_text(json.dumps(result))
    manager.shutdown()
    del store


if __name__ == "__main__":
    main()
