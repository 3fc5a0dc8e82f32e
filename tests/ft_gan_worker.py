"""A small GAN as a user ports it to --ft (tests/test_ft_gan.py), in the shape of pytorch/examples'
DCGAN loop: per batch, the discriminator's backward and step on real and generated samples, then
the generator's backward through the discriminator and its step. Each is wrapped in
ft.DistributedDataParallel, batches come from ft.DataLoader, and each optimizer has its own
ft.Optimizer (`--optimizers two`); `--optimizers one` gives both Adams to one ft.Optimizer and
steps it twice a batch, which is refused.

Every sample is counted in each of the two steps: each step also trains a counter (a model of one
weight per sample, stepped by SGD with lr 1 in the same ft.Optimizer as its network's Adam) whose loss lowers by exactly 1 the weight of every sample in a committed step, so after E
epochs every weight is -E if and only if every sample was trained once an epoch by each step.

--die-at RANK:STEP:WHEN: that rank's first process SIGKILLs itself at that step: `d` inside the
discriminator's backward, `between` after its step, `g` inside the generator's backward.
--out OUT: every rank writes its whole state (both models, both optimizers) to OUT.rankN.pt.
"""

import argparse
import os
import signal
import time

import torch
import torch.nn as nn

import ftrun.ft as ft

p = argparse.ArgumentParser()
p.add_argument("--optimizers", choices=["one", "two"], default="two")
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--samples", type=int, default=512)
p.add_argument("--die-at", default="")
p.add_argument("--out", default=None)
# Seconds each step sleeps while a replica is away: a restarted replica comes back before the run's
# end however slowly a loaded machine restarts it, at no cost while all are there.
p.add_argument("--slow-while-away", type=float, default=0.0)
p.add_argument("--step-sleep", type=float, default=0.0)  # seconds each step sleeps (a test's kill lands mid-run)
args = p.parse_args()
rank = int(os.environ["RANK"])
die = {int(r): (int(s), w) for r, s, w in (x.split(":") for x in args.die_at.split(",") if x)}
first_process = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
torch.manual_seed(0)
Z, X = 8, 16


class Counter(nn.Module):
    """One weight per sample: a committed step that trains on sample i lowers weight i by 1."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(n))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.w[idx]


G = nn.Sequential(nn.Linear(Z, 32), nn.ReLU(), nn.Linear(32, X))
D = nn.Sequential(nn.Linear(X, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
count_g, count_d = Counter(args.samples), Counter(args.samples)
g, d = ft.DistributedDataParallel(G), ft.DistributedDataParallel(D)
cg, cd = ft.DistributedDataParallel(count_g), ft.DistributedDataParallel(count_d)
adam = dict(lr=2e-4, betas=(0.5, 0.999))
opt_g = (torch.optim.Adam(G.parameters(), **adam), torch.optim.SGD(count_g.parameters(), lr=1.0))
opt_d = (torch.optim.Adam(D.parameters(), **adam), torch.optim.SGD(count_d.parameters(), lr=1.0))
if args.optimizers == "one":
    step_d = step_g = ft.Optimizer(*opt_d, *opt_g)
else:
    step_d, step_g = ft.Optimizer(*opt_d), ft.Optimizer(*opt_g)
data = torch.randn(args.samples, X) + 1.0
loader = ft.DataLoader(torch.utils.data.TensorDataset(data, torch.arange(args.samples)), batch_size=32,
                       shuffle=True, seed=0)
bce = nn.BCEWithLogitsLoss()


def kill_in_backward(when: str, net: nn.Module) -> None:
    at, w = die.get(rank, (None, None))
    if first_process and w == when and ft.global_step() == at:
        net.register_full_backward_hook(lambda *_: os.kill(os.getpid(), signal.SIGKILL))


for epoch in ft.epochs(args.epochs):
    for real, idx in loader:
        n, workers = len(real), ft.num_replicas()
        if workers < int(os.environ["WORLD_SIZE"]) and ft.global_step() > 0:
            time.sleep(args.slow_while_away)
        fake = g(torch.randn(n, Z))
        step_d.zero_grad()
        kill_in_backward("d", D)
        loss_d = bce(d(real), torch.ones(n, 1)) + bce(d(fake.detach()), torch.zeros(n, 1))
        (loss_d + cd(idx).sum() * workers).backward()
        step_d.step()
        if first_process and die.get(rank, (None, None)) == (ft.global_step(), "between"):
            os.kill(os.getpid(), signal.SIGKILL)
        step_g.zero_grad()
        kill_in_backward("g", G)
        loss_g = bce(d(fake), torch.ones(n, 1))
        (loss_g + cg(idx).sum() * workers).backward()
        for p_ in D.parameters():  # the generator's backward reaches the discriminator: its step moves G only
            p_.grad = None
        step_g.step()
        time.sleep(args.step_sleep)

if args.out:
    torch.save({"G": G.state_dict(), "D": D.state_dict(), "count_g": count_g.w.detach(), "count_d": count_d.w.detach(),
                "opt_g": [o.state_dict() for o in opt_g],
                "opt_d": [o.state_dict() for o in opt_d]}, f"{args.out}.rank{rank}.pt")
print(f"rank {rank} done at step {ft.global_step()}", flush=True)
