"""An unmodified Hugging Face Trainer script (no ftrun in it): a 2-layer GPT-2 built from a config
(nothing downloaded) on a synthetic token set, gradient_accumulation_steps=2, max_grad_norm=1.0, a
cosine schedule, evaluation and checkpoints every few steps, for `ftrun --ft`.

argv: OUT, then options. Writes OUT.rankN.json at the end: the log history (train and eval
losses by step), the global step, the learning rate, and a checksum of the parameters.
"""

import argparse
import json
import os
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments


class Tokens(torch.utils.data.Dataset):
    """Sequences that count up from a start by a stride (mod the vocabulary): learnable."""

    def __init__(self, n: int, length: int, vocab: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, vocab, (n, 1), generator=g)
        strides = torch.randint(1, 4, (n, 1), generator=g)
        self.ids = (starts + strides * torch.arange(length)) % vocab

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Slow(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(SLEEP)


p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--size", type=int, default=192)
p.add_argument("--sleep", type=float, default=0.0)
p.add_argument("--bf16", action="store_true")
p.add_argument("--embd", type=int, default=32, help="the width (512 with --vocab 32000: about 25M parameters)")
p.add_argument("--vocab", type=int, default=48)
args = p.parse_args()
OUT, RANK, SLEEP = args.out, os.environ.get("RANK", "0"), args.sleep

torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=args.embd, n_positions=16, vocab_size=args.vocab, bos_token_id=0, eos_token_id=0,
                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
targs = TrainingArguments(output_dir=f"{OUT}.out", per_device_train_batch_size=4, per_device_eval_batch_size=16,
                          gradient_accumulation_steps=2, max_grad_norm=1.0, learning_rate=3e-3,
                          lr_scheduler_type="cosine", warmup_steps=2, num_train_epochs=args.epochs,
                          eval_strategy="steps", eval_steps=4, save_strategy="steps", save_steps=6,
                          save_total_limit=2, logging_steps=1, report_to=[], use_cpu=True, disable_tqdm=True,
                          seed=1, dataloader_drop_last=True, bf16=args.bf16)
trainer = Trainer(model=model, args=targs, train_dataset=Tokens(args.size, 16, args.vocab, 1),
                  eval_dataset=Tokens(48, 16, args.vocab, 2), callbacks=[Slow()])
trainer.train()
trainer.save_model(f"{OUT}.final")  # one writer: the first live replica
total = sum(float(p.detach().double().sum()) for p in model.parameters())
with open(f"{OUT}.rank{RANK}.json", "w") as f:
    json.dump({"history": trainer.state.log_history, "step": trainer.state.global_step,
               "lr": trainer.lr_scheduler.get_last_lr()[0], "params": total}, f)
print(f"done rank {RANK} step {trainer.state.global_step}", flush=True)
