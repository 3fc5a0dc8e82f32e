"""Lightning's examples/fabric/image_classifier/train_fabric.py, with gradient accumulation as
Fabric's docs write it (fabric.no_backward_sync) and a checkpoint saved with fabric.save, ported to
`ftrun --ft` with the port of docs/guides/accelerate-fabric.md: `from ftrun.fabric import Fabric`,
`for epoch in fabric.epochs(...)`, and the accumulation counted from the last step. With --plain it
is the unported script (Lightning's Fabric and range), which ftrun runs with group restarts and
one line saying why.

What differs from the example, and why (so that a test runs it on CPU in seconds and can count):
- the images are synthetic 12x12 ones made from each sample's index, and the network is the
  example's Net, narrower (4 and 8 channels, 16 hidden);
- the model carries a counter: one weight per (epoch, sample), zero at the start, added to the
  loss as the sum of the batch's weights of the current epoch, in a parameter group with lr 1 and
  no momentum, so a committed step lowers each of its samples' weights by exactly 1/(k n) (k
  accumulated batches, n live replicas): every weight ends at -1/(k n) if and only if each sample
  was trained exactly once an epoch in committed steps. The optimizer is SGD with momentum on the
  network's group (the example's Adadelta would scale the counter's step);
- the data loader yields each sample's index beside its image and target;
- the example's StepLR decays once an epoch, here as a schedule stepped after every optimizer
  step (step_size: an epoch's steps), as a per-step schedule is written: the script steps it
  whatever the step's outcome, and ftrun puts it back after a discarded step;
- --sleep slows each batch inside its step (10x while a replica is away), and OUT.rankN.pt holds the replica's
  whole state at the end, for the test to compare.
"""

import argparse
import json
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import Dataset

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--plain", action="store_true", help="the unported script: lightning.fabric.Fabric and range()")
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--size", type=int, default=96)
p.add_argument("--batch-size", type=int, default=2)
p.add_argument("--accumulate", type=int, default=2)
p.add_argument("--precision", default="bf16-mixed")
p.add_argument("--lr", type=float, default=0.05)
p.add_argument("--gamma", type=float, default=0.7)
p.add_argument("--seed", type=int, default=1)
p.add_argument("--sleep", type=float, default=0.0)
hparams = p.parse_args()

if hparams.plain:
    from lightning.fabric import Fabric, seed_everything
else:
    from lightning.fabric import seed_everything

    from ftrun.fabric import Fabric

RANK = os.environ.get("RANK", "0")


class Images(Dataset):
    def __init__(self, n: int, offset: int = 0) -> None:
        self.n, self.offset = n, offset

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(self.offset + i)
        image = torch.rand(1, 12, 12, generator=g)
        return image, int(image.mean() * 20) % 10, i


class Net(nn.Module):
    def __init__(self, epochs: int, size: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, 1)
        self.conv2 = nn.Conv2d(4, 8, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(8 * 4 * 4, 16)
        self.fc2 = nn.Linear(16, 10)
        self.seen = nn.Parameter(torch.zeros(epochs, size))

    def forward(self, x):
        x = self.conv1(x)
        x = F.relu(x)
        x = self.conv2(x)
        x = F.relu(x)
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = self.fc1(x)
        x = F.relu(x)
        x = self.dropout2(x)
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


def live(fabric) -> int:
    if hparams.plain:
        return fabric.world_size
    import ftrun.ft as ft

    return ft.num_replicas()


def run(hparams):
    fabric = Fabric(accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")), strategy="ddp",
                    precision=hparams.precision)
    fabric.launch()
    seed_everything(hparams.seed)

    train_dataset, test_dataset = Images(hparams.size), Images(40, offset=10_000)
    train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=hparams.batch_size, shuffle=True)
    test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=hparams.batch_size)
    train_loader, test_loader = fabric.setup_dataloaders(train_loader, test_loader)

    model = Net(hparams.epochs, hparams.size)
    net = [p for name, p in model.named_parameters() if name != "seen"]
    optimizer = torch.optim.SGD([{"params": net, "lr": hparams.lr, "momentum": 0.9},
                                 {"params": [model.seen], "lr": 1.0, "momentum": 0.0}])
    model, optimizer = fabric.setup(model, optimizer)
    # The example's decay once an epoch, as a schedule stepped after every optimizer step.
    steps_per_epoch = len(train_loader) // hparams.accumulate
    scheduler = StepLR(optimizer, step_size=steps_per_epoch, gamma=hparams.gamma)

    first = True
    epochs = range(1, hparams.epochs + 1) if hparams.plain else fabric.epochs(1, hparams.epochs + 1)
    for epoch in epochs:
        if first:
            first = False
            with open(f"{hparams.out}.rank{RANK}.starts", "a") as f:
                step = 0 if hparams.plain else __import__("ftrun.ft").ft.global_step()
                f.write(json.dumps({"pid": os.getpid(), "epoch": epoch, "step": step}) + "\n")
        model.train()
        for batch_idx, (data, target, idx) in enumerate(train_loader):
            is_accumulating = (batch_idx + 1) % hparams.accumulate != 0 and batch_idx + 1 != len(train_loader)
            with fabric.no_backward_sync(model, enabled=is_accumulating):
                output = model(data)
                loss = F.nll_loss(output, target) / hparams.accumulate
                loss = loss + model.seen[epoch - 1, idx].sum() / hparams.accumulate
                fabric.backward(loss)
            if hparams.sleep:  # inside the step: a kill lands mid-step, and its step is redone
                time.sleep(hparams.sleep if live(fabric) == fabric.world_size else 10 * hparams.sleep)
            if not is_accumulating:
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()

        model.eval()
        test_loss = 0
        with torch.no_grad():
            for data, target, _ in test_loader:
                output = model(data)
                test_loss += F.nll_loss(output.float(), target, reduction="sum").item()
        test_loss = fabric.all_gather(test_loss).sum() / len(test_loader.dataset)
        fabric.print(f"\nTest set: Average loss: {test_loss:.4f}\n")

    fabric.save(f"{hparams.out}.ckpt", {"model": model, "optimizer": optimizer, "scheduler": scheduler.state_dict()})
    return fabric, model, optimizer, scheduler, float(test_loss)


fabric, model, optimizer, scheduler, test_loss = run(hparams)
torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict()}, f"{hparams.out}.rank{RANK}.pt")
with open(f"{hparams.out}.rank{RANK}.json", "w") as f:
    json.dump({"seen": model.module.seen.detach().tolist(), "test_loss": test_loss}, f)
print(f"done rank {RANK}", flush=True)
