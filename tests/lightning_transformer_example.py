"""Lightning's own example of a language model, ported for `ftrun --ft` with no ftrun in it.

Source: Lightning-AI/pytorch-lightning, examples/pytorch/basics/transformer.py (a LanguageModel
over lightning.pytorch.demos.Transformer, WikiText2 split by random_split, DataLoaders of 20 with
shuffle=True for training, SGD with lr 20, gradient_clip_val=0.25, fit() then test()). Written
again here in its shape; what differs, and why:
- WikiText2 downloads: a synthetic token stream of the same form stands in for it (a block of
  35 tokens and the same block one token on; the stream follows a fixed rule most of the time,
  so the loss falls);
- sizes are small (a vocabulary of 64, a narrow Transformer, 2 epochs) to fit a test, and
  dropout is 0: a sample's dropout mask is drawn by whichever worker trains it, which a kill
  changes, so with dropout a run with a kill could not be compared with a failure-free one;
  and SGD's lr is 2, not 20: on this small model lr 20 swings the loss from step to step
  (chaotic runs cannot be compared either);
- the Trainer is given devices= (the launcher's workers per node) and accelerator="cpu", as any
  script launched by torchrun must (on CPU Lightning's default is one device per process);
- the demo Transformer of the installed Lightning takes (inputs, target);
- the test's harness: a callback that sleeps S a step, ten times that while a replica is away
  (so a restarted one is back before the run's end however loaded the machine), and a report at
  the end: OUT.rankN.json (the global step, the test loss, the validation loss per epoch, a
  digest of the parameters) and OUT.rankN.starts (a line per fit start).
argv: OUT [--epochs N] [--sleep S]
"""

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, random_split

import lightning as L
from lightning.pytorch.demos import Transformer


class SyntheticText(Dataset):
    """WikiText2's interface over a generated stream: item i is (tokens, the same tokens one on)."""

    def __init__(self, tokens: int, vocab_size: int, block_size: int = 35) -> None:
        g = torch.Generator().manual_seed(7)
        data = torch.empty(tokens + 1, dtype=torch.long)
        data[0] = 0
        noise = torch.randint(vocab_size, (tokens + 1,), generator=g)
        keep = torch.rand(tokens + 1, generator=g) < 0.8
        for i in range(1, tokens + 1):
            data[i] = (data[i - 1] * 5 + 3) % vocab_size if keep[i] else noise[i]
        self.data, self.block_size, self.vocab_size = data, block_size, vocab_size

    def __len__(self) -> int:
        return len(self.data) // self.block_size - 1

    def __getitem__(self, index: int):
        start = index * self.block_size
        end = start + self.block_size
        return self.data[start:end], self.data[start + 1:end + 1]


class Pace(L.Callback):
    """The test's harness (not the example's): a step's pace, slower while a replica is away."""

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if args.sleep:
            live = trainer.strategy.reduce(torch.tensor(1.0), reduce_op="sum")
            time.sleep(args.sleep if live == trainer.world_size else 10 * args.sleep)


class LanguageModel(L.LightningModule):
    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.model = Transformer(vocab_size=vocab_size, ninp=32, nhead=2, nhid=64, nlayers=1, dropout=0.0)
        self.epoch_losses = []

    def on_train_start(self) -> None:
        with open(f"{OUT}.rank{self.global_rank}.starts", "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "step": self.trainer.global_step}) + "\n")

    def training_step(self, batch, batch_idx):
        input, target = batch
        output = self.model(input, target)
        loss = F.nll_loss(output, target.view(-1))
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        input, target = batch
        output = self.model(input, target)
        loss = F.nll_loss(output, target.view(-1))
        self.log("val_loss", loss, prog_bar=True)
        return loss

    def on_validation_epoch_end(self) -> None:
        if not self.trainer.sanity_checking:
            self.epoch_losses.append(float(self.trainer.callback_metrics["val_loss"]))

    def test_step(self, batch, batch_idx):
        input, target = batch
        output = self.model(input, target)
        loss = F.nll_loss(output, target.view(-1))
        self.log("test_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=2.0)


def main() -> None:
    L.seed_everything(42)
    dataset = SyntheticText(tokens=35 * 1500, vocab_size=64)

    n = len(dataset)
    train_dataset, val_dataset, test_dataset = random_split(dataset, [n - 300, 150, 150])
    train_dataloader = DataLoader(train_dataset, batch_size=20, shuffle=True)
    val_dataloader = DataLoader(val_dataset, batch_size=20, shuffle=False)
    test_dataloader = DataLoader(test_dataset, batch_size=20, shuffle=False)

    model = LanguageModel(vocab_size=dataset.vocab_size)
    trainer = L.Trainer(gradient_clip_val=0.25, max_epochs=args.epochs, accelerator="cpu",
                        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")), logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[Pace()])
    trainer.fit(model, train_dataloader, val_dataloader)
    tested = trainer.test(model, test_dataloader, verbose=False)
    with open(f"{OUT}.rank{trainer.global_rank}.json", "w") as f:
        json.dump({"step": trainer.global_step, "test_loss": tested[0]["test_loss"], "val": model.epoch_losses,
                   "params": float(sum(p.detach().double().abs().sum() for p in model.parameters()))}, f)


p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--sleep", type=float, default=0.0)
args = p.parse_args()
OUT = args.out

if __name__ == "__main__":
    main()
