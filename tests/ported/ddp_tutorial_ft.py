"""tests/ported/ddp_tutorial.py ported to `ftrun --ft`: only the failed replica restarts, and it
heals from a live peer while the others keep training.

    ftrun --nproc 2 --ft --checkpoint-dir ckpt ddp_tutorial_ft.py 10 2

What changed, and why (docs/guides/porting-to-ft.md shows the diff): the model, the optimizer
and the DataLoader are ftrun.ft's, the epoch loop is ft.epochs(), and the snapshot code is gone
(--checkpoint-dir saves the same state, the data position included, and resumes it); the
init/destroy_process_group() pair is gone too (ftrun.ft needs no default group).
"""

import argparse
import os

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

import ftrun.ft as ft


class MyTrainDataset(Dataset):
    """Random (input, target) pairs, drawn once, as the tutorial's datautils has them."""

    def __init__(self, size: int) -> None:
        g = torch.Generator().manual_seed(7)
        self.data = [(torch.rand(20, generator=g), torch.rand(1, generator=g)) for _ in range(size)]

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index):
        return self.data[index]


class Trainer:
    def __init__(self, model, train_data, optimizer, save_every: int) -> None:
        self.model = ft.DistributedDataParallel(model)
        self.train_data = train_data
        self.optimizer = ft.Optimizer(optimizer)
        self.save_every = save_every

    def _run_batch(self, source, targets) -> None:
        self.optimizer.zero_grad()
        loss = F.mse_loss(self.model(source), targets)
        loss.backward()
        self.optimizer.step()

    def _run_epoch(self, epoch: int) -> None:
        for source, targets in self.train_data:
            self._run_batch(source, targets)

    def train(self, max_epochs: int) -> None:
        for epoch in ft.epochs(max_epochs):
            self._run_epoch(epoch)
            if ft.replica_index() == 0 and epoch % self.save_every == 0:
                print(f"Epoch {epoch} | trained to step {ft.global_step()}", flush=True)


def load_train_objs():
    torch.manual_seed(0)  # (not in the tutorial: seeded so that runs can be compared)
    train_set = MyTrainDataset(2048)
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    return train_set, model, optimizer


def prepare_dataloader(dataset: Dataset, batch_size: int):
    return ft.DataLoader(dataset, batch_size=batch_size, pin_memory=False, shuffle=True)


def main(save_every: int, total_epochs: int, batch_size: int) -> None:
    dataset, model, optimizer = load_train_objs()
    train_data = prepare_dataloader(dataset, batch_size)
    trainer = Trainer(model, train_data, optimizer, save_every)
    trainer.train(total_epochs)
    print(f"rank {os.environ['RANK']} weight {trainer.model.module.weight.sum().item()!r}", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("total_epochs", type=int, help="Total epochs to train the model")
    parser.add_argument("save_every", type=int, help="How often to print progress")
    parser.add_argument("--batch_size", default=32, type=int, help="Input batch size on each device (default: 32)")
    args = parser.parse_args()
    main(args.save_every, args.total_epochs, args.batch_size)
