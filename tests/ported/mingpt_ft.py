"""tests/ported/mingpt.py ported to `ftrun --ft`: only the failed replica restarts, and it heals
from a live peer while the others keep training.

    ftrun --nproc 2 --ft --checkpoint-dir ckpt mingpt_ft.py --max-epochs 3

What changed, and why (docs/guides/porting-to-ft.md shows the diff): the model and the optimizer
are ftrun.ft's (the optimizer wrapped first, as the trainer has it); the training loader is
ft.DataLoader with the script's own DistributedSampler, and seed=1 because the script's
set_epoch counts from 1 where ft.epochs() counts from 0; the evaluation loader stays torch's
(its DistributedSampler works on a restarted replica too); the epoch loop is ft.epochs(); the
counter moves only on a committed step; the snapshot code goes for --checkpoint-dir; and the
init/destroy_process_group() pair goes (ftrun.ft needs no default group).
"""

import argparse
import os
from dataclasses import asdict, dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, random_split
from torch.utils.data.distributed import DistributedSampler

import ftrun.ft as ft


class CharDataset(Dataset):
    """Blocks of a text as (input, target, index): the next character of each is the target."""

    def __init__(self, text: str, block_size: int) -> None:
        chars = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(chars)}
        self.vocab_size, self.block_size = len(chars), block_size
        self.data = torch.tensor([self.stoi[c] for c in text], dtype=torch.long)

    def __len__(self) -> int:
        return len(self.data) - self.block_size

    def __getitem__(self, idx: int):
        chunk = self.data[idx:idx + self.block_size + 1]
        return chunk[:-1], chunk[1:], idx


def synthetic_text(n: int) -> str:
    g = torch.Generator().manual_seed(11)
    return "".join("abcdefghijklmnop"[i] for i in torch.randint(0, 16, (n,), generator=g).tolist())


class GPT(torch.nn.Module):
    def __init__(self, vocab_size: int, block_size: int, n_embd: int, samples: int) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(vocab_size, n_embd)
        self.pos = torch.nn.Parameter(torch.zeros(block_size, n_embd))
        self.block = torch.nn.TransformerEncoderLayer(n_embd, 2, 2 * n_embd, dropout=0.0, batch_first=True)
        self.head = torch.nn.Linear(n_embd, vocab_size)
        # The test's counter: a step's backward marks the samples it trained, and count_seen() takes 1
        # from each of them (no optimizer steps it). Its gradient is averaged like the others'.
        self.seen = torch.nn.Parameter(torch.zeros(samples))

    def forward(self, idx, targets, ids=None):
        t = idx.shape[1]
        mask = torch.nn.Transformer.generate_square_subsequent_mask(t)
        logits = self.head(self.block(self.tok(idx) + self.pos[:t], src_mask=mask, is_causal=True))
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        if ids is not None:
            loss = loss + 1e-6 * self.seen[ids].sum()
        return logits, loss

    @torch.no_grad()
    def count_seen(self) -> None:
        self.seen -= (self.seen.grad != 0).float()
        self.seen.grad = None


def create_optimizer(model: GPT, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if n != "seen" and p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if n != "seen" and p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))


@dataclass
class TrainerConfig:
    max_epochs: int
    batch_size: int
    grad_norm_clip: float = 1.0
    snapshot_path: Optional[str] = None
    save_every: int = 1


class Trainer:
    def __init__(self, config: TrainerConfig, model, optimizer, train_dataset, test_dataset=None) -> None:
        self.config = config
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.global_rank = int(os.environ["RANK"])
        self.train_loader = self._prepare_dataloader(train_dataset, ft.DataLoader, seed=1)
        self.test_loader = self._prepare_dataloader(test_dataset, DataLoader) if test_dataset else None
        self.model = model
        self.optimizer = ft.Optimizer(optimizer)
        self.model = ft.DistributedDataParallel(self.model)

    def _prepare_dataloader(self, dataset: Dataset, loader, **seed):
        return loader(dataset, batch_size=self.config.batch_size, pin_memory=False, shuffle=False,
                      sampler=DistributedSampler(dataset), **seed)

    def _run_batch(self, source, targets, ids, train: bool = True) -> float:
        with torch.set_grad_enabled(train):
            _, loss = self.model(source, targets, ids if train else None)
        if train:
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_norm_clip)
            if self.optimizer.step():
                self.model.module.count_seen()
        return loss.item()

    def _run_epoch(self, epoch: int, dataloader: DataLoader, train: bool = True) -> None:
        dataloader.sampler.set_epoch(epoch)
        for it, (source, targets, ids) in enumerate(dataloader):
            step_type = "Train" if train else "Eval"
            batch_loss = self._run_batch(source, targets, ids, train)
            if it % 100 == 0:
                print(f"[GPU{self.global_rank}] Epoch {epoch} | Iter {it} | {step_type} Loss {batch_loss:.5f}")

    def train(self) -> None:
        for epoch in ft.epochs(self.config.max_epochs):
            epoch += 1
            self._run_epoch(epoch, self.train_loader, train=True)
            if self.test_loader:
                self._run_epoch(epoch, self.test_loader, train=False)


def get_train_objs(text_len: int, block_size: int):
    dataset = CharDataset(synthetic_text(text_len), block_size)
    train_len = int(len(dataset) * 0.9)
    train_set, test_set = random_split(dataset, [train_len, len(dataset) - train_len],
                                       generator=torch.Generator().manual_seed(42))
    torch.manual_seed(0)
    model = GPT(dataset.vocab_size, block_size, 32, len(dataset))
    return model, create_optimizer(model, 3e-3, 0.1), train_set, test_set


def report(model: GPT, train_set, rank: int) -> None:
    seen = model.seen.detach()[train_set.indices]
    weights = sum(float(p.double().sum()) for n, p in model.named_parameters() if n != "seen")
    print(f"rank {rank} seen {seen.min().item():g} {seen.max().item():g} weights {weights!r}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--text-len", type=int, default=2000)
    parser.add_argument("--snapshot", default=None)
    args = parser.parse_args()
    model, optimizer, train_data, test_data = get_train_objs(args.text_len, 8)
    trainer = Trainer(TrainerConfig(args.max_epochs, args.batch_size, snapshot_path=args.snapshot),
                      model, optimizer, train_data, test_data)
    trainer.train()
    report(trainer.model.module, train_data, trainer.global_rank)


if __name__ == "__main__":
    main()
