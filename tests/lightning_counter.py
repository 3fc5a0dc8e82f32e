"""An unmodified Lightning script (no ftrun in it): the counter model, for `ftrun --ft`.

One weight per sample and epoch, zero at the start; SGD with lr 1; the loss is the sum of the
batch's weights of the current epoch. DDP averages the gradients over the n replicas of a step,
so a committed step lowers each of its samples' weights by exactly 1/n: every weight ends at
-1/n for the n of the step that trained it if and only if every sample was trained exactly once
in every epoch. With --accumulate k (Lightning divides the loss by k) a step is k batches, and
every weight ends at -1/(k n).

argv: EPOCHS OUT, then options. Appends one line per fit start to OUT.rankN.starts (the epoch
and global step it started at: a restarted replica's shows where it went on), and writes
OUT.rankN.json at the end: the weights and the global step.
"""

import argparse
import json
import os
import sys
import time

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

if "--package=pytorch_lightning" in sys.argv:  # the older package name
    import pytorch_lightning as pl
else:
    import lightning.pytorch as pl


class Indices(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(i)


class Stream(IterableDataset):
    """The stream (--iterable), split by rank as a torchrun script splits it (Lightning gives every
    rank the same loader of a stream): rank r of R reads samples r, r + R, ..."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.rank, self.world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))

    def __iter__(self):
        return (torch.tensor(i) for i in range(self.rank, self.n, self.world))


class Counter(pl.LightningModule):
    def __init__(self, size: int, epochs: int, sleep: float, away: float = 10.0) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(epochs, size))
        self.sleep, self.away = sleep, away
        self.draws_away = 0

    def on_train_start(self) -> None:
        with open(f"{OUT}.rank{self.global_rank}.starts", "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "epoch": self.current_epoch,
                                "step": self.trainer.global_step}) + "\n")

    def training_step(self, idx: torch.Tensor, batch_idx: int) -> torch.Tensor:
        TRAINED.append(idx.tolist())
        if self.sleep:
            # Slower while a replica is away (the replicas of the step, counted by Lightning's own
            # reduce), so that a restarted one is back before the run's end however loaded the
            # machine is: 10 times for its first 3 draws away (steps that commit without it), then
            # --away-sleep times.
            live = self.trainer.strategy.reduce(torch.tensor(1.0), reduce_op="sum")
            self.draws_away = 0 if live == self.trainer.world_size else self.draws_away + 1
            factor = 1 if not self.draws_away else 10 if self.draws_away <= 3 else self.away
            time.sleep(factor * self.sleep)
        return self.w[self.current_epoch, idx].sum()

    def manual_step(self, idx: torch.Tensor, batch_idx: int) -> None:
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(self.w[self.current_epoch, idx].sum())
        opt.step()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1.0)


p = argparse.ArgumentParser()
p.add_argument("epochs", type=int)
p.add_argument("out")
p.add_argument("--size", type=int, default=120)
p.add_argument("--batch", type=int, default=4)
p.add_argument("--sleep", type=float, default=0.0)
p.add_argument("--away-sleep", type=float, default=10.0, help="times --sleep, a step's while a replica is away")
p.add_argument("--workers", type=int, default=0, help="the DataLoader's (persistent) workers")
p.add_argument("--package", default="lightning", help="pytorch_lightning: import Lightning by its older name")
p.add_argument("--manual", action="store_true", help="manual optimization (automatic_optimization = False)")
p.add_argument("--accumulate", type=int, default=1, help="Trainer(accumulate_grad_batches=)")
p.add_argument("--strategy", default="ddp",
               help="'default': no strategy= (several devices choose DDP); 'FTStrategy': ftrun.lightning's object; "
                    "'DDPStrategy': Lightning's DDPStrategy object, built by the script")
p.add_argument("--iterable", action="store_true", help="the training DataLoader over an IterableDataset")
args = p.parse_args()
OUT = args.out
TRAINED = []  # the samples of each of this process's training steps, in order (a redone one's again)

torch.manual_seed(0)
model = Counter(args.size, args.epochs, args.sleep, args.away_sleep)
if args.manual:
    model.automatic_optimization = False
    model.training_step = model.manual_step
kwargs = {} if args.strategy == "default" else {"strategy": args.strategy}
if args.strategy == "FTStrategy":  # a script that says so itself
    from ftrun.lightning import FTStrategy

    kwargs["strategy"] = FTStrategy()
if args.strategy == "DDPStrategy":  # an object ftrun does not make: the plain strategy
    kwargs["strategy"] = pl.strategies.DDPStrategy(process_group_backend="gloo")
trainer = pl.Trainer(accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")), max_epochs=args.epochs,
                     logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, num_sanity_val_steps=0,
                     accumulate_grad_batches=args.accumulate, **kwargs)
if args.iterable:
    train = DataLoader(Stream(args.size), batch_size=args.batch)
else:
    train = DataLoader(Indices(args.size), batch_size=args.batch, shuffle=True, num_workers=args.workers,
                       persistent_workers=args.workers > 0)
trainer.fit(model, train)
with open(f"{OUT}.rank{trainer.global_rank}.json", "w") as f:
    # The rest of the replica's state, which ends the same on every replica: the optimizer's and
    # the loop's progress.
    state = repr((trainer.optimizers[0].state_dict(), trainer.global_step, trainer.current_epoch,
                  trainer.fit_loop.epoch_loop.batch_progress.state_dict()))
    json.dump({"weights": model.w.detach().tolist(), "step": trainer.global_step, "state": state,
               "trained": TRAINED}, f)
print(f"done rank {trainer.global_rank} step {trainer.global_step}", flush=True)
