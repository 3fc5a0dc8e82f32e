"""A plain PyTorch Lightning script, Trainer(strategy="ddp") on CPU (no ftrun API).

Run under `ftrun --nproc 2 --hook fp16`: Lightning reads torchrun's variables,
builds its own DistributedDataParallel, and ftrun's hook lands on it. With
--out it writes OUT.rankN.json: the hook DDP reports, first/last loss, a
parameter checksum and ftrun's figures.
"""

import argparse
import json

import lightning.pytorch as pl
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
        self.losses = []
        self.comm_hook = None

    def training_step(self, batch, _idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        ddp = self.trainer.strategy.model  # the DistributedDataParallel Lightning built
        if hasattr(ddp, "_get_ddp_logging_data"):
            self.comm_hook = ddp._get_ddp_logging_data().get("comm_hook", "")
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--steps", type=int, default=12)
    args = p.parse_args()
    torch.manual_seed(0)
    x = torch.randn(512, 16)
    y = torch.tanh(x @ torch.randn(16, 1, generator=torch.Generator().manual_seed(1)))
    model = Regressor()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=args.steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=16, shuffle=False))
    if args.out:
        report = {
            "comm_hook": model.comm_hook,
            "first_loss": sum(model.losses[:3]) / 3,
            "last_loss": sum(model.losses[-3:]) / 3,
            "checksum": float(sum(p.detach().double().sum() for p in model.parameters())),
        }
        try:
            from ftrun.worker.hooks import current_stats

            report["ftrun"] = current_stats()
        except ImportError:
            pass
        with open(f"{args.out}.rank{trainer.global_rank}.json", "w") as f:
            json.dump(report, f)


if __name__ == "__main__":
    main()
