"""A DDP training script with ftrun's fault-tolerance API (run it with `ftrun --ft`).

Compared with scripts/train_ddp.py it differs in the places marked FT: the
model and optimizer are wrapped, the batches come from ft.DataLoader, the loop
runs over ftrun's global step, and the LR scheduler is registered so a
restarted replica receives it too. There is no init_process_group, no
checkpoint and no resume logic: a replica that dies is restarted by ftrun and
healed from a live peer, and the data loader's position travels with the state.

Data: a dataset of --data-size synthetic samples (x, x @ w + noise), read by
ft.DataLoader: DistributedSampler's order split over the live replicas, every
sample trained once an epoch whatever fails, --batch / replicas samples per
replica and step. `--data step` keeps the old step-indexed global batch of
--batch samples split over the live replicas (a fixed amount of data per step,
which the chaos benchmark compares across launchers).
"""

import argparse
import hashlib
import json
import os
import signal
import time

import torch
import torch.nn as nn

import ftrun.ft as ft


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--batch", type=int, default=96,
                   help="global batch with every replica alive: --batch / replicas samples per replica")
    p.add_argument("--data", choices=["loader", "step"], default="loader",
                   help="loader: a dataset read by ft.DataLoader; step: a synthetic batch drawn from the step")
    p.add_argument("--data-size", type=int, default=20000, help="samples in the dataset (--data loader)")
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--depth", type=int, default=1, help="hidden layers of HIDDEN x HIDDEN after the first")
    p.add_argument("--optim", choices=["sgd", "adam", "adamw"], default="sgd",
                   help="sgd (momentum 0.9), or Adam/AdamW (two state tensors per parameter)")
    p.add_argument("--out", default=None, help="write final parameters to OUT.rankN.pt and stats to OUT.rankN.json")
    p.add_argument("--step-sleep", type=float, default=0.0, help="pretend each step does more work")
    p.add_argument("--slow-while-away", type=float, default=0.0,
                   help="each step sleeps this long more while the quorum has fewer replicas than it had (a "
                        "test's restarted replica then comes back before the run ends, however slow the machine)")
    p.add_argument("--print-every", type=int, default=50)
    p.add_argument("--announce", action="store_true",
                   help="print one line with rank, pid, step and wall time when this process completes its "
                        "first committed step (scripts/bench_chaos.py uses it)")
    p.add_argument("--restart-delay", type=float, default=0.0,
                   help="a restarted process waits this long before it starts (pretend a slow restart)")
    p.add_argument("--die-at", default="",
                   help="RANK:STEP[,RANK:STEP...]: that rank's first process SIGKILLs itself at that step, as a "
                        "kill from outside would (several at one step: replicas lost together)")
    p.add_argument("--nudge", action="store_true",
                   help="after each step taken, change a parameter outside the optimizer (as an EMA or a weight "
                        "constraint does): a hot spare fed the gradients misses it and must be healed whole")
    p.add_argument("--init-process-group", action="store_true",
                   help="call dist.init_process_group() first, as plain DDP scripts do (ftrun.ft needs none)")
    p.add_argument("--ddp", default="",
                   help="comma-separated DDP variants: unused (a layer no step uses, find_unused_parameters=True), "
                        "static (static_graph=True), view (gradient_as_bucket_view=True), accumulate (two "
                        "micro-batches a step, the first under no_sync()), split (the model as two parts, each "
                        "wrapped apart, with an optimizer each, both in one ft.Optimizer)")
    args = p.parse_args()
    args.ddp = {v for v in args.ddp.split(",") if v}
    args.die_at = dict(tuple(int(n) for n in pair.split(":")) for pair in args.die_at.split(",") if pair)
    known = {"unused", "static", "view", "accumulate", "split"}
    if not args.ddp <= known:
        p.error(f"--ddp: unknown variant(s) {sorted(args.ddp - known)}")
    if "split" in args.ddp and args.ddp & {"unused", "accumulate"}:
        p.error("--ddp split goes with static and view only")
    return args


class Regression(torch.utils.data.Dataset):
    """Synthetic samples (x, x @ w + noise), each drawn from its own index: no file to read."""

    def __init__(self, size: int, true_w: torch.Tensor) -> None:
        self.size, self.true_w = size, true_w

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(1_000_003 + i)
        x = torch.randn(self.true_w.shape[0], generator=g)
        return x, x @ self.true_w + 0.01 * torch.randn(1, generator=g)


class WithUnused(nn.Module):
    """A model with a layer that no forward uses (DDP needs find_unused_parameters=True)."""

    def __init__(self, body: nn.Module, dim: int) -> None:
        super().__init__()
        self.body = body
        self.unused = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def main() -> None:
    args = parse()
    if args.restart_delay and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        time.sleep(args.restart_delay)
    if args.init_process_group:
        import torch.distributed as dist

        dist.init_process_group("gloo")
    torch.manual_seed(0)
    layers = [nn.Linear(args.dim, args.hidden), nn.ReLU()]
    for _ in range(args.depth - 1):
        layers += [nn.Linear(args.hidden, args.hidden), nn.ReLU()]
    # One GPU per worker where there are GPUs (LOCAL_RANK picks it, as under torchrun).
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if torch.cuda.is_available() \
        else torch.device("cpu")
    model = nn.Sequential(*layers, nn.Linear(args.hidden, 1))
    if "unused" in args.ddp:
        model = WithUnused(model, args.dim)
    model = model.to(device)
    options = dict(find_unused_parameters="unused" in args.ddp, static_graph="static" in args.ddp,
                   gradient_as_bucket_view="view" in args.ddp)
    if "split" in args.ddp:  # e.g. an encoder and a decoder, each wrapped on its own
        ddp = nn.Sequential(ft.DistributedDataParallel(model[:2], **options),             # FT
                            ft.DistributedDataParallel(model[2:], **options))             # FT
    else:
        ddp = ft.DistributedDataParallel(model, **options)                                # FT
    def make(params):
        if args.optim == "sgd":
            return torch.optim.SGD(params, lr=args.lr, momentum=0.9)
        return (torch.optim.Adam if args.optim == "adam" else torch.optim.AdamW)(params, lr=args.lr)

    if "split" in args.ddp:  # an optimizer per part, stepped together
        opt = ft.Optimizer(*(make(part.parameters()) for part in ddp))                  # FT
    else:
        opt = ft.Optimizer(make(ddp.parameters()))                                       # FT
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100, gamma=0.5)                # every optimizer's groups
    ft.register_state("sched", sched)                                                    # FT

    true_w = torch.randn(args.dim, 1, generator=torch.Generator().manual_seed(1)) / args.dim ** 0.5
    replicas = int(os.environ["WORLD_SIZE"]) // int(os.environ.get("FTRUN_REPLICA_SIZE", "1"))
    if args.data == "loader":
        loader = ft.DataLoader(Regression(args.data_size, true_w), batch_size=max(1, args.batch // replicas),  # FT
                               shuffle=True, seed=0)
        batches = iter(loader)
    loss = torch.tensor(0.0)
    announced = not args.announce
    commits = []  # (global step, wall time) of this process's committed steps
    first_process = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    began = not args.announce
    most = 0  # the most replicas a quorum of this process had
    for step in ft.steps(args.steps):                                                    # FT
        if first_process and args.die_at.get(int(os.environ["RANK"])) == step:
            os.kill(os.getpid(), signal.SIGKILL)
        if not began:  # this process trains from here: its replica is back at full strength
            began = True
            print(f"[announce] rank {ft.replica_id()} pid {os.getpid()} begins step {step} t {time.time():.6f}",
                  flush=True)
        n = ft.num_replicas()
        most = max(most, n)
        if n < most:
            time.sleep(args.slow_while_away)
        if args.data == "step":
            i = ft.replica_index()
            g = torch.Generator().manual_seed(step)
            x = torch.randn(args.batch, args.dim, generator=g)
            y = x @ true_w + 0.01 * torch.randn(args.batch, 1, generator=g)
            x, y = x.chunk(n)[i], y.chunk(n)[i]
        else:
            try:
                x, y = next(batches)
            except StopIteration:  # the end of an epoch: the next pass is the next epoch
                batches = iter(loader)
                x, y = next(batches)
        x, y = x.to(device), y.to(device)
        opt.zero_grad(set_to_none=True)
        if "accumulate" in args.ddp:
            half = len(x) // 2
            with ddp.no_sync():
                (nn.functional.mse_loss(ddp(x[:half]), y[:half]) * half / len(x)).backward()
            loss = nn.functional.mse_loss(ddp(x[half:]), y[half:]) * (len(x) - half) / len(x)
        else:
            loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        if opt.step():
            sched.step()
            if args.nudge:
                with torch.no_grad():
                    next(model.parameters()).add_(1e-6)
            commits.append((step, time.time()))
            if not announced:
                announced = True
                print(f"[announce] rank {ft.replica_id()} pid {os.getpid()} first step {step} "
                      f"t {time.time():.6f}", flush=True)
        if args.step_sleep:
            time.sleep(args.step_sleep)
        if step % args.print_every == 0:
            print(f"step {step} loss {loss.item():.5f} replicas {n}", flush=True)

    rank = int(os.environ["RANK"])
    if args.out:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, f"{args.out}.rank{rank}.pt")
        torch.save(opt.state_dict(), f"{args.out}.rank{rank}.opt.pt")
        with open(f"{args.out}.rank{rank}.json", "w") as f:
            json.dump({"step": ft.global_step(), "loss": loss.item(), "commits": commits, "sched": sched.state_dict()}, f)
    print(f"done at step {ft.global_step()}", flush=True)
    # Bitwise: replicas that stayed identical print the same digest (scripts/demo.sh compares them).
    digest = hashlib.sha256()
    for name, value in model.state_dict().items():
        digest.update(name.encode())
        digest.update(value.detach().cpu().contiguous().numpy().tobytes())
    print(f"parameters sha256 {digest.hexdigest()[:16]}", flush=True)


if __name__ == "__main__":
    main()
