"""scripts/bench_frameworks.py's Lightning worker: an unmodified Lightning script (no ftrun in it),
`Trainer(strategy="ddp")`, an MLP of --params parameters (train_ft.py's shape) with AdamW on random
data. Writes OUT.rankN.json (each step's end on the worker's wall and CPU clocks) and prints its
first step's wall time."""

import os
import time

from bench_frameworks_common import announce, arguments, clocks, report


def mlp_dims(params: int) -> tuple:
    """(dim, hidden, depth) of train_ft.py's MLP with about `params` parameters."""
    # dim x hidden in, depth - 1 layers of hidden x hidden, hidden x 1 out (bench_heal.py's sizes).
    dim, depth = 1024, 4
    hidden = int((-dim + (dim * dim + 4 * (depth - 1) * params) ** 0.5) / (2 * (depth - 1)))
    return dim, hidden, depth


def main() -> None:
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    global STEP_SLEEP
    args = arguments()
    STEP_SLEEP = args.step_sleep
    dim, hidden, depth = mlp_dims(args.params)
    times = []

    class MLP(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            layers = [torch.nn.Linear(dim, hidden), torch.nn.ReLU()]
            for _ in range(depth - 1):
                layers += [torch.nn.Linear(hidden, hidden), torch.nn.ReLU()]
            self.net = torch.nn.Sequential(*layers, torch.nn.Linear(hidden, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
            announce(self.trainer.global_step)  # before the sleep, as train_ft.py's --announce
            time.sleep(STEP_SLEEP)
            times.append(clocks())

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    g = torch.Generator().manual_seed(0)
    n = args.batch * 2 * args.steps
    data = TensorDataset(torch.randn(n, dim, generator=g), torch.randn(n, 1, generator=g))
    trainer = pl.Trainer(accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")), strategy="ddp",
                         max_steps=args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    torch.manual_seed(0)
    trainer.fit(MLP(), DataLoader(data, batch_size=args.batch, shuffle=True))
    report(args.out, times)


STEP_SLEEP = 0.0

if __name__ == "__main__":
    main()
