"""A plain DDP script (no ftrun API) for checking comm hooks end to end.

Runs unchanged under `torchrun` and `ftrun --hook ...`. Trains a small MLP on a
synthetic regression task with gloo on CPU and, with --out, writes per rank
OUT.rankN.json: the hook DDP reports (`_get_ddp_logging_data()['comm_hook']`),
first and last losses, a parameter checksum, and ftrun's hook figures when the
script runs under ftrun; plus OUT.rankN.pt with the final parameters.
"""

import argparse
import json

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--find-unused", action="store_true", help="DDP(find_unused_parameters=True), with an unused layer")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="small values give several buckets")
    p.add_argument("--own-hook", action="store_true", help="register torch's fp16_compress_hook in the script")
    p.add_argument("--out", default=None)
    p.add_argument("--hook-state", action="store_true",
                   help="with --out, under ftrun: also save ftrun's hook state to OUT.rankN.hook.pt and load it back")
    p.add_argument("--save-at", type=int, default=None,
                   help="under ftrun: after this many steps save model, optimizer and hook state to "
                        "CKPT.rankN.pt (rank 0's hook state saved by rank 0 alone, as scripts often do) and stop")
    p.add_argument("--resume", default=None, help="under ftrun: continue from what --save-at wrote there")
    p.add_argument("--ckpt", default=None, help="the checkpoint path of --save-at and --resume")
    return p.parse_args()


class Net(nn.Module):
    def __init__(self, dim: int, hidden: int, unused: bool) -> None:
        super().__init__()
        self.a = nn.Linear(dim, hidden)
        self.b = nn.Linear(hidden, hidden)
        self.c = nn.Linear(hidden, 1)
        self.unused = nn.Linear(hidden, hidden) if unused else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        # NaN == NaN here: PowerSGD without orthogonalization_epsilon turns an all-zero
        # gradient (the unused layer) into NaNs, and they round-trip as NaNs.
        return isinstance(b, torch.Tensor) and torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)
    return a == b


def main() -> None:
    args = parse()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Net(args.dim, args.hidden, args.find_unused)
    ddp = DDP(model, find_unused_parameters=args.find_unused, bucket_cap_mb=args.bucket_cap_mb)
    if args.own_hook:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    true_w = torch.randn(args.dim, 1, generator=torch.Generator().manual_seed(1))
    losses = []
    first = 0
    if args.resume:
        from ftrun.worker import hooks

        ck = torch.load(f"{args.resume}.rank{rank}.pt", weights_only=True)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        with torch.no_grad():  # ftrun registers its hook at the first forward: its state loads from then on
            ddp(torch.zeros(1, args.dim))
        hooks.load_hook_state_dict(ddp, ck["hook"])
        first = int(ck["step"])
    for step in range(first, args.steps):
        if args.save_at is not None and step == args.save_at:
            from ftrun.worker import hooks

            # A script that saves on rank 0 only must not hang: the hook state issues no collective.
            state = hooks.hook_state_dict(ddp) if rank == 0 else None
            dist.barrier()
            mine = hooks.hook_state_dict(ddp)
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "hook": mine, "step": step},
                       f"{args.ckpt}.rank{rank}.pt")
            assert state is None or _same(state, mine)
            dist.barrier()
            dist.destroy_process_group()
            return
        g = torch.Generator().manual_seed(step * world + rank)
        x = torch.randn(args.batch, args.dim, generator=g)
        y = torch.tanh(x @ true_w)
        loss = nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    if args.out:
        report = {
            "comm_hook": ddp._get_ddp_logging_data().get("comm_hook", ""),
            "losses": losses,
            "checksum": float(sum(p.detach().double().sum() for p in model.parameters())),
        }
        try:  # only under ftrun; the script itself never needs it
            from ftrun.worker import hooks
        except ImportError:
            hooks = None
        if hooks is not None:
            report["ftrun"] = hooks.current_stats()
            if args.hook_state:
                path = f"{args.out}.rank{rank}.hook.pt"
                torch.save(hooks.hook_state_dict(ddp), path)
                hooks.load_hook_state_dict(ddp, torch.load(path, weights_only=True))
                report["reloaded_equal"] = _same(hooks.hook_state_dict(ddp), torch.load(path, weights_only=True))
                hooks.reset_hook_state(ddp)
                report["after_reset"] = {k: len(v) for k, v in hooks.hook_state_dict(ddp).items() if isinstance(v, dict)}
        with open(f"{args.out}.rank{rank}.json", "w") as f:
            json.dump(report, f)
        torch.save({k: v.detach() for k, v in model.state_dict().items()}, f"{args.out}.rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
