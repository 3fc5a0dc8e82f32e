"""A plain torchrun-style DDP training script on synthetic data (no ftrun API).

Runs unchanged under `torchrun --nproc-per-node N` and `ftrun --nproc N`:
gloo on CPU, nccl with one GPU per LOCAL_RANK when CUDA is there. Used by the
demo, the tests and the benchmarks; the --fail-*/--hang-* flags inject faults
on the first attempt only (TORCHELASTIC_RESTART_COUNT == 0), and --ckpt lets
a restarted group resume where it left off.
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--depth", type=int, default=1, help="hidden layers of HIDDEN x HIDDEN after the first")
    p.add_argument("--optim", choices=["sgd", "adam", "adamw"], default="sgd",
                   help="SGD with momentum (default), Adam or AdamW: as scripts/train_ft.py")
    p.add_argument("--ckpt", default=None, help="checkpoint file: saved every --ckpt-every steps, resumed from")
    p.add_argument("--ckpt-every", type=int, default=5)
    p.add_argument("--fail-rank", type=int, default=-1)
    p.add_argument("--fail-step", type=int, default=-1)
    p.add_argument("--fail-always", action="store_true", help="fail on every attempt, not just the first")
    p.add_argument("--hang-rank", type=int, default=-1)
    p.add_argument("--hang-step", type=int, default=-1)
    p.add_argument("--out", default=None, help="write final parameters of each rank to OUT.rankN.pt")
    p.add_argument("--step-sleep", type=float, default=0.0, help="pretend each step does more work")
    p.add_argument("--print-every", type=int, default=10)
    p.add_argument("--announce", action="store_true",
                   help="print one line with rank, pid, step and wall time when this process completes its "
                        "first optimizer step (scripts/bench_chaos.py uses it)")
    return p.parse_args()


def main() -> None:
    args = parse()
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)

    torch.manual_seed(0)
    layers = [nn.Linear(args.dim, args.hidden), nn.ReLU()]
    for _ in range(args.depth - 1):
        layers += [nn.Linear(args.hidden, args.hidden), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(args.hidden, 1)).to(device)
    ddp = DDP(model, device_ids=[device.index] if use_cuda else None)
    if args.optim == "sgd":
        opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    else:
        opt = (torch.optim.Adam if args.optim == "adam" else torch.optim.AdamW)(ddp.parameters(), lr=args.lr)
    start = 0
    if args.ckpt and os.path.exists(args.ckpt):
        state = torch.load(args.ckpt, map_location=device, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = int(state["step"])
        print(f"resumed from step {start}", flush=True)

    true_w = torch.randn(args.dim, 1, generator=torch.Generator().manual_seed(1))
    announced = not args.announce
    for step in range(start, args.steps):
        # The step's global batch, of which this rank takes its share: the same work per step as
        # scripts/train_ft.py, whose share follows the replicas taking part (the benchmarks compare them).
        g = torch.Generator().manual_seed(step)
        x = torch.randn(args.batch * world, args.dim, generator=g)
        y = x @ true_w + 0.01 * torch.randn(args.batch * world, 1, generator=g)
        x, y = x.chunk(world)[rank].to(device), y.chunk(world)[rank].to(device)
        loss = nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if not announced:
            announced = True
            print(f"[announce] rank {rank} pid {os.getpid()} first step {step} t {time.time():.6f}", flush=True)
        if args.step_sleep:
            time.sleep(args.step_sleep)
        if step % args.print_every == 0 or step == args.steps - 1:
            print(f"step {step} loss {loss.item():.5f}", flush=True)
        first_attempt = attempt == 0 or args.fail_always
        if rank == args.fail_rank and step == args.fail_step and first_attempt:
            raise RuntimeError(f"injected failure at step {step}")
        if rank == args.hang_rank and step == args.hang_step and attempt == 0:
            print("hanging now", flush=True)
            while True:
                time.sleep(3600)
        if args.ckpt and (step + 1) % args.ckpt_every == 0:
            dist.barrier()
            if rank == 0:
                tmp = args.ckpt + ".tmp"
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step + 1}, tmp)
                os.replace(tmp, args.ckpt)
            dist.barrier()

    if args.out:
        torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, f"{args.out}.rank{rank}.pt")
        with open(f"{args.out}.rank{rank}.json", "w") as f:
            json.dump({"loss": loss.item(), "steps": args.steps}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
