"""huggingface/accelerate's examples/by_feature/gradient_accumulation.py (with complete_nlp_example.py's
save_state at each epoch's end), ported to `ftrun --ft` with the two-line port of
docs/guides/accelerate.md: `from ftrun.accelerate import Accelerator` and
`for epoch in accelerator.epochs(num_epochs):`. With --plain it is the unported script (Accelerate's
own Accelerator and `range`), which ftrun runs with group restarts and one line saying why.

What differs from the example, and why (so that a test runs it on CPU in seconds and can count):
- BERT is built from a tiny BertConfig (nothing downloaded), and the data is synthetic: each
  sample's tokens and label come from its index (every replica holds the same set);
- the model carries a counter beside BERT: one weight per (epoch, sample), zero at the start,
  added to the loss as the sum of the batch's weights of the current epoch. Its parameter group
  has lr 1, no momentum and a constant schedule, so a committed step lowers each of its samples'
  weights by exactly 1/(k n) (k accumulated batches, n live replicas): every weight ends at
  -1/(k n) if and only if each sample was trained exactly once an epoch in committed steps;
- the optimizer is SGD with momentum 0.9 on BERT's group (state that must heal), the example's
  linear schedule with warmup as a LambdaLR with one function per group (the counter's constant);
- `accelerator.register_for_checkpointing` holds a stateful object (the evaluations so far),
  healed as save_state would save it;
- --sleep slows each batch inside its step (10x while a replica is away, counted by the live
  replicas the run says), and OUT.rankN.pt holds the replica's whole state at the end, for the test to compare;
  OUT.rankN.json says how the training forwards ran (bf16 autocast or not).

argv: OUT, then options. OUT.rankN.starts gets one line per start of the loop (its epoch and the
run's step there); OUT.rankN.json the evaluations, the counter's weights and the global step.
"""

import argparse
import json
import os
import time

import torch
from torch.utils.data import DataLoader, Dataset
from transformers import BertConfig, BertForSequenceClassification

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--plain", action="store_true", help="the unported script: accelerate.Accelerator and range()")
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--size", type=int, default=96)
p.add_argument("--batch", type=int, default=2)
p.add_argument("--accumulate", type=int, default=2)
p.add_argument("--mixed-precision", default="no")
p.add_argument("--sleep", type=float, default=0.0)
args = p.parse_args()

if args.plain:
    from accelerate import Accelerator
else:
    from ftrun.accelerate import Accelerator
from accelerate.utils import set_seed

EVAL_BATCH_SIZE = 32
SEQ, VOCAB = 8, 64
RANK = os.environ.get("RANK", "0")
AUTOCAST = set()  # how this process's training forwards ran


class Synthetic(Dataset):
    """A tokenized pair-classification set, made up from each sample's index."""

    def __init__(self, n: int, offset: int = 0) -> None:
        self.n, self.offset = n, offset

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(self.offset + i)
        ids = torch.randint(1, VOCAB, (SEQ,), generator=g)
        return {"input_ids": ids, "attention_mask": torch.ones(SEQ, dtype=torch.long),
                "labels": torch.tensor(int(ids[0]) % 2), "idx": torch.tensor(i)}


class Counted(torch.nn.Module):
    """BERT for sequence classification, and the counter beside it."""

    def __init__(self, config: BertConfig, epochs: int, size: int) -> None:
        super().__init__()
        self.bert = BertForSequenceClassification(config)
        self.seen = torch.nn.Parameter(torch.zeros(epochs, size))
        self.epoch = 0

    def forward(self, idx, **batch):
        out = self.bert(**batch)
        if self.training:
            AUTOCAST.add(str(torch.get_autocast_dtype("cpu")) if torch.is_autocast_enabled("cpu") else "off")
            out.loss = out.loss + self.seen[self.epoch, idx].sum()
        return out


class Evaluations:
    """The accuracy after each epoch, kept as a checkpoint's custom state."""

    def __init__(self) -> None:
        self.accuracy = []

    def state_dict(self) -> dict:
        return {"accuracy": list(self.accuracy)}

    def load_state_dict(self, sd: dict) -> None:
        self.accuracy = list(sd["accuracy"])


def live_replicas(accelerator) -> int:
    if args.plain:
        return accelerator.num_processes
    import ftrun.ft as ft

    return ft.num_replicas()


def global_step() -> int:
    if args.plain:
        return 0
    import ftrun.ft as ft

    return ft.global_step()


def training_function(config, args):
    gradient_accumulation_steps = int(args.accumulate)
    accelerator = Accelerator(cpu=True, mixed_precision=args.mixed_precision,
                              gradient_accumulation_steps=gradient_accumulation_steps)
    lr = config["lr"]
    num_epochs = int(config["num_epochs"])
    seed = int(config["seed"])
    batch_size = int(config["batch_size"])

    set_seed(seed)
    train_dataloader = DataLoader(Synthetic(args.size), shuffle=True, batch_size=batch_size)
    eval_dataloader = DataLoader(Synthetic(40, offset=10_000), shuffle=False, batch_size=EVAL_BATCH_SIZE)
    model = Counted(BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=32, max_position_embeddings=SEQ, num_labels=2), num_epochs, args.size)
    model = model.to(accelerator.device)
    optimizer = torch.optim.SGD([{"params": model.bert.parameters(), "lr": lr, "momentum": 0.9},
                                 {"params": [model.seen], "lr": 1.0, "momentum": 0.0}])
    num_training_steps = len(train_dataloader) * num_epochs

    def linear_with_warmup(step, warmup=4):
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, (num_training_steps - step) / max(1, num_training_steps - warmup))

    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, [linear_with_warmup, lambda step: 1.0])
    evaluations = Evaluations()
    accelerator.register_for_checkpointing(evaluations)

    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )

    epochs = range(num_epochs) if args.plain else accelerator.epochs(num_epochs)
    first = True
    for epoch in epochs:
        if first:
            first = False
            with open(f"{args.out}.rank{RANK}.starts", "a") as f:
                f.write(json.dumps({"pid": os.getpid(), "epoch": epoch, "step": global_step()}) + "\n")
        accelerator.unwrap_model(model).epoch = epoch
        model.train()
        for step, batch in enumerate(train_dataloader):
            with accelerator.accumulate(model):
                output = model(**batch)
                loss = output.loss
                accelerator.backward(loss)
                if args.sleep:  # inside the step: a kill lands mid-step, and its step is redone
                    time.sleep(args.sleep if live_replicas(accelerator) == accelerator.num_processes
                               else 10 * args.sleep)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()

        model.eval()
        correct = total = 0
        for step, batch in enumerate(eval_dataloader):
            idx = batch.pop("idx")
            with torch.no_grad():
                outputs = model(idx, **batch)
            predictions = outputs.logits.argmax(dim=-1)
            predictions, references = accelerator.gather_for_metrics((predictions, batch["labels"]))
            correct += int((predictions == references).sum())
            total += len(references)
        evaluations.accuracy.append((epoch, correct, total))
        accelerator.print(f"epoch {epoch}:", {"accuracy": correct / total})
        accelerator.save_state(os.path.join(f"{args.out}.ckpt", f"epoch_{epoch}"))
    accelerator.end_training()
    return accelerator, model, optimizer, lr_scheduler, evaluations


accelerator, model, optimizer, lr_scheduler, evaluations = training_function(
    {"lr": 0.05, "num_epochs": args.epochs, "seed": 42, "batch_size": args.batch}, args)
unwrapped = accelerator.unwrap_model(model)
torch.save({"model": unwrapped.state_dict(), "optimizer": optimizer.state_dict(),
            "scheduler": lr_scheduler.state_dict(), "step": accelerator.step,
            "iteration": accelerator.save_iteration, "evaluations": evaluations.state_dict()},
           f"{args.out}.rank{RANK}.pt")
with open(f"{args.out}.rank{RANK}.json", "w") as f:
    json.dump({"seen": unwrapped.seen.detach().tolist(), "evaluations": evaluations.accuracy,
               "main": accelerator.is_main_process, "autocast": sorted(AUTOCAST)}, f)
print(f"done rank {RANK}", flush=True)
