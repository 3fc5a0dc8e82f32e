"""An unmodified Lightning GAN with manual optimization (no ftrun in it), for `ftrun --ft`
(tests/test_lightning_ft.py), in the shape of Lightning's own GAN example: automatic_optimization
= False, two optimizers from configure_optimizers, and per batch the discriminator's
manual_backward and step on real and generated samples, then the generator's through the
discriminator and its step, each between toggle_optimizer and untoggle_optimizer, and each
optimizer's LR scheduler stepped after its step. `--optimizers one` trains the discriminator
alone with one optimizer and clips its gradients by hand before opt.step(), as manual
optimization is often written for.

Each optimizer also steps a counter (one weight per sample, in its own parameter group with
SGD's lr 1 and no momentum) whose loss is the sum of the batch's weights times the replicas of
the step (counted by Lightning's own reduce): DDP averages over those replicas, so a committed
step lowers each of its samples' weights by exactly 1, and after E epochs every weight is -E if
and only if every sample was trained once an epoch by that optimizer's step.

argv: EPOCHS OUT, then options. --die-at RANK:STEP:WHEN (several, comma-separated): that rank's
first process SIGKILLs itself in the batch after STEP committed batches (or the first after it
with every replica there), `d` inside the discriminator's backward, `between` after its step,
`g` inside the generator's backward.
--no-step-at B: the training_step of batch B steps no optimizer (refused under --ft). Writes
OUT.rankN.pt at the end: both models, the counters, both optimizers' states and learning rates,
and the global step.
"""

import argparse
import os
import signal
import time

import lightning.pytorch as pl
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

Z, X = 8, 16


class Points(Dataset):
    """Synthetic "real" samples (a shifted Gaussian), each with its index."""

    def __init__(self, n: int) -> None:
        self.x = torch.randn(n, X, generator=torch.Generator().manual_seed(1)) + 1.0

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], i


def die_here(net_output: torch.Tensor) -> None:
    """SIGKILL this process when the backward reaches `net_output`'s gradient."""
    net_output.register_hook(lambda grad: os.kill(os.getpid(), signal.SIGKILL))


class GAN(pl.LightningModule):
    def __init__(self, samples: int, optimizers: str, die: dict, sleep: float, no_step_at: int) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.G = nn.Sequential(nn.Linear(Z, 32), nn.ReLU(), nn.Linear(32, X))
        self.D = nn.Sequential(nn.Linear(X, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
        self.count_d = nn.Parameter(torch.zeros(samples))
        self.count_g = nn.Parameter(torch.zeros(samples))
        self.two = optimizers == "two"
        self.die, self.sleep, self.no_step_at = die, sleep, no_step_at
        self.first_process = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        self.bce = nn.BCEWithLogitsLoss()

    def _dies(self, when: str) -> bool:
        """Whether to die here: at the step planned, or the first after it with every replica
        there (a kill while one is away could leave no peer to heal from)."""
        steps = self.trainer.global_step // (2 if self.two else 1)  # committed batches (one step per optimizer)
        at, w = self.die.get(self.global_rank, (None, None))
        full = self.trainer.world_size - SPARES
        return self.first_process and w == when and steps >= at and self.live == full

    def training_step(self, batch, batch_idx):
        real, idx = batch
        if batch_idx == self.no_step_at:
            return None
        n = len(real)
        self.live = live = self.trainer.strategy.reduce(torch.tensor(1.0), reduce_op="sum")  # the step's replicas
        if self.sleep:  # slower while a replica is away, so that it is back before the run's end
            time.sleep(self.sleep if live == self.trainer.world_size - SPARES else 10 * self.sleep)
        ones, zeros = torch.ones(n, 1), torch.zeros(n, 1)
        if self.two:
            opt_d, opt_g = self.optimizers()
        else:
            opt_d = self.optimizers()
        fake = self.G(torch.randn(n, Z))

        if self.two:  # only the discriminator takes gradients (requires_grad off for the others' parameters)
            self.toggle_optimizer(opt_d)
        opt_d.zero_grad()
        on_real = self.D(real)
        if self._dies("d"):
            die_here(on_real)
        loss_d = self.bce(on_real, ones) + self.bce(self.D(fake.detach()), zeros)
        self.manual_backward(loss_d + self.count_d[idx].sum() * live)
        if not self.two:
            torch.nn.utils.clip_grad_norm_(self.D.parameters(), 0.5)  # the network's, not the counter's
        opt_d.step()
        if not self.two:
            return loss_d.detach()
        sched_d, sched_g = self.lr_schedulers()
        sched_d.step()
        self.untoggle_optimizer(opt_d)
        if self._dies("between"):
            os.kill(os.getpid(), signal.SIGKILL)

        self.toggle_optimizer(opt_g)
        opt_g.zero_grad()
        if self._dies("g"):
            die_here(fake)
        loss_g = self.bce(self.D(fake), ones)
        self.manual_backward(loss_g + self.count_g[idx].sum() * live)
        opt_g.step()
        sched_g.step()
        self.untoggle_optimizer(opt_g)
        return loss_g.detach()

    def configure_optimizers(self):
        opt_d = torch.optim.SGD([{"params": self.D.parameters(), "lr": 0.05, "momentum": 0.9},
                                 {"params": [self.count_d], "lr": 1.0}])
        if not self.two:
            return opt_d
        opt_g = torch.optim.SGD([{"params": self.G.parameters(), "lr": 0.05, "momentum": 0.9},
                                 {"params": [self.count_g], "lr": 1.0}])
        # Each network's learning rate decays by a factor a batch; the counters' stays 1.
        decay = [lambda k: 0.99 ** k, lambda k: 1.0]
        return [opt_d, opt_g], [torch.optim.lr_scheduler.LambdaLR(opt, decay) for opt in (opt_d, opt_g)]


p = argparse.ArgumentParser()
p.add_argument("epochs", type=int)
p.add_argument("out")
p.add_argument("--samples", type=int, default=96)
p.add_argument("--batch", type=int, default=8)
p.add_argument("--optimizers", choices=["one", "two"], default="two")
p.add_argument("--die-at", default="")
p.add_argument("--sleep", type=float, default=0.0)
p.add_argument("--spares", type=int, default=0, help="ftrun's --spares: a step's full count of replicas is the rest")
p.add_argument("--no-step-at", type=int, default=-1, help="a batch whose training_step steps no optimizer")
args = p.parse_args()
die = {int(r): (int(s), w) for r, s, w in (x.split(":") for x in args.die_at.split(",") if x)}
SPARES = args.spares

torch.manual_seed(0)
model = GAN(args.samples, args.optimizers, die, args.sleep, args.no_step_at)
trainer = pl.Trainer(accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")), max_epochs=args.epochs,
                     strategy="ddp_find_unused_parameters_true", logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
trainer.fit(model, DataLoader(Points(args.samples), batch_size=args.batch, shuffle=True))
torch.save({"G": model.G.state_dict(), "D": model.D.state_dict(), "count_d": model.count_d.detach(),
            "count_g": model.count_g.detach(), "optimizers": [o.state_dict() for o in trainer.optimizers],
            "lr": [[g["lr"] for g in o.param_groups] for o in trainer.optimizers],
            "step": trainer.global_step}, f"{args.out}.rank{trainer.global_rank}.pt")
print(f"done rank {trainer.global_rank} step {trainer.global_step}", flush=True)
