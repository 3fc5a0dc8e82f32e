"""An unmodified Lightning script (no ftrun in it) using what a real one does: an LR scheduler
stepped every batch, a callback holding state, sync_dist logging, validation every epoch, a
ModelCheckpoint, a DataLoader with workers, and Lightning's distributed calls (barrier, reduce,
all_gather, broadcast, reduce_boolean_decision) inside a step and between steps. For `ftrun --ft` under kills.

A linear model on a fixed synthetic regression. argv: EPOCHS OUT, then options. Writes
OUT.rankN.json at the end: the parameters, the learning rate, the callback's count of
committed batches, the checkpoint callback's state, the global step, a validate() after fit(), what
the distributed calls gave at each step; OUT.rankN.starts gets a
line per fit start; checkpoints go to OUT.ckpt/.
"""

import argparse
import json
import os
import time
from typing import Any, Dict

import torch
from torch.utils.data import DataLoader, TensorDataset

try:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
except ImportError:  # the older package name
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import Callback, ModelCheckpoint


class CountBatches(Callback):
    """State a callback keeps across a fit (and in checkpoints): batches begun and trained."""

    def __init__(self) -> None:
        self.batches = self.started = 0

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        self.started += 1

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.batches += 1

    def state_dict(self) -> Dict[str, Any]:
        return {"batches": self.batches, "started": self.started}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.batches, self.started = state_dict["batches"], state_dict["started"]


class Regression(pl.LightningModule):
    def __init__(self, sleep: float) -> None:
        super().__init__()
        self.net = torch.nn.Linear(8, 1)
        self.sleep = sleep

    def on_train_start(self) -> None:
        with open(f"{OUT}.rank{self.global_rank}.starts", "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "epoch": self.current_epoch,
                                "step": self.trainer.global_step}) + "\n")

    def collectives(self) -> Dict[str, Any]:
        """What Lightning's distributed calls give here: who takes part, and that they agree."""
        strategy = self.trainer.strategy
        strategy.barrier()
        return {"n": float(strategy.reduce(torch.tensor(1.0), reduce_op="sum")),
                "ids": self.all_gather(torch.tensor(self.global_rank)).tolist(),
                "first": strategy.broadcast(self.global_rank),
                "any0": strategy.reduce_boolean_decision(self.global_rank == 0, all=False),
                "all0": strategy.reduce_boolean_decision(self.global_rank == 0)}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        seen = SEEN["in_step"][self.trainer.global_step] = self.collectives()
        if self.sleep:
            # Slower while a replica is away, so that a restarted one is back before the run's end
            # however loaded the machine is.
            time.sleep(self.sleep if seen["n"] == self.trainer.world_size else 10 * self.sleep)
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True, on_step=True, on_epoch=True)
        self.log("live", 1.0, sync_dist=True, reduce_fx="sum", on_step=True, on_epoch=False)
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        SEEN["between"][self.trainer.global_step] = self.collectives()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)
        if not self.trainer.sanity_checking:
            # Each replica evaluates the whole set: its values are already the run's.
            SEEN["validation"] = {"n": float(self.trainer.strategy.reduce(torch.tensor(1.0), reduce_op="sum")),
                                  "gathered": list(self.all_gather(torch.tensor(1.0)).shape)}

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


p = argparse.ArgumentParser()
p.add_argument("epochs", type=int)
p.add_argument("out")
p.add_argument("--size", type=int, default=240)
p.add_argument("--batch", type=int, default=4)
p.add_argument("--workers", type=int, default=2)
p.add_argument("--sleep", type=float, default=0.0)
args = p.parse_args()
OUT = args.out
SEEN: Dict[str, Any] = {"in_step": {}, "between": {}, "validation": None}

g = torch.Generator().manual_seed(1)
x = torch.randn(args.size, 8, generator=g)
y = x @ torch.randn(8, 1, generator=g) + 0.1 * torch.randn(args.size, 1, generator=g)
train = DataLoader(TensorDataset(x, y), batch_size=args.batch, shuffle=True, num_workers=args.workers,
                   persistent_workers=args.workers > 0)
val = DataLoader(TensorDataset(x[:60], y[:60]), batch_size=10)

torch.manual_seed(0)
model = Regression(args.sleep)
counter = CountBatches()
checkpoints = ModelCheckpoint(dirpath=f"{OUT}.ckpt", monitor="val_loss", save_top_k=2, save_last=True)
trainer = pl.Trainer(accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")), strategy="ddp",
                     max_epochs=args.epochs, logger=False, enable_progress_bar=False, enable_model_summary=False,
                     callbacks=[counter, checkpoints])
trainer.fit(model, train, val)
SEEN["live"] = float(trainer.callback_metrics["live"])  # the last step's self.log(..., sync_dist=True)
validated = trainer.validate(model, val, verbose=False)
with open(f"{OUT}.rank{trainer.global_rank}.json", "w") as f:
    json.dump({"params": [p.detach().flatten().tolist() for p in model.parameters()],
               "lr": trainer.optimizers[0].param_groups[0]["lr"],
               "batches": counter.batches, "started": counter.started,
               "step": trainer.global_step, "epoch": trainer.current_epoch,
               "total_batch_idx": trainer.fit_loop.total_batch_idx,
               "best": checkpoints.best_model_path, "best_k": sorted(checkpoints.best_k_models),
               "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()}, "validated": validated,
               "seen": SEEN}, f)
print(f"done rank {trainer.global_rank} step {trainer.global_step}", flush=True)
