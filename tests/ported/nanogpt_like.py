"""A training script shaped like karpathy/nanoGPT's train.py, for torchrun (or ftrun without --ft):
uint16 tokens read from a memmapped DATA_DIR/train.bin and val.bin with a per-rank random
get_batch (the next batch fetched while the model runs), gradient accumulation under DDP,
clip_grad_norm_, a cosine learning rate with warmup computed from the iteration, an evaluation
of both splits and a checkpoint (when the val loss improves) on rank 0 every eval_interval, and
init_from='resume' from OUT_DIR/ckpt.pt. Its port to `ftrun --ft` is nanogpt_like_ft.py.

    torchrun --nproc-per-node 2 nanogpt_like.py --data_dir D --out_dir O [--init_from resume]

--out P writes P.rankN.pt/.opt.pt (parameters, optimizer) and P.rankN.json (the last step, its
loss, the evaluations this rank ran) for the tests.
"""

import argparse
import json
import math
import os
import time
from contextlib import nullcontext

import numpy as np
import torch
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP

from nanogpt_model import GPT, GPTConfig

p = argparse.ArgumentParser()
p.add_argument("--data_dir", required=True)
p.add_argument("--out_dir", default="out")
p.add_argument("--eval_interval", type=int, default=20)
p.add_argument("--log_interval", type=int, default=10)
p.add_argument("--eval_iters", type=int, default=4)
p.add_argument("--always_save_checkpoint", action="store_true")
p.add_argument("--init_from", default="scratch", choices=["scratch", "resume"])
p.add_argument("--gradient_accumulation_steps", type=int, default=4)  # over all ranks, as in nanoGPT
p.add_argument("--batch_size", type=int, default=8)
p.add_argument("--block_size", type=int, default=32)
p.add_argument("--vocab_size", type=int, default=64)
p.add_argument("--n_layer", type=int, default=2)
p.add_argument("--n_head", type=int, default=4)
p.add_argument("--n_embd", type=int, default=64)
p.add_argument("--learning_rate", type=float, default=3e-3)
p.add_argument("--max_iters", type=int, default=100)
p.add_argument("--weight_decay", type=float, default=0.1)
p.add_argument("--grad_clip", type=float, default=1.0)
p.add_argument("--warmup_iters", type=int, default=10)
p.add_argument("--lr_decay_iters", type=int, default=100)
p.add_argument("--min_lr", type=float, default=3e-4)
p.add_argument("--out", default=None)
args = p.parse_args()
globals().update(vars(args))

# DDP: one process per rank; the accumulation steps are shared out between the ranks.
ddp = int(os.environ.get("RANK", -1)) != -1
if ddp:
    init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    ddp_rank = int(os.environ["RANK"])
    ddp_local_rank = int(os.environ["LOCAL_RANK"])
    ddp_world_size = int(os.environ["WORLD_SIZE"])
    device = f"cuda:{ddp_local_rank}" if torch.cuda.is_available() else "cpu"
    master_process = ddp_rank == 0
    seed_offset = ddp_rank
    assert gradient_accumulation_steps % ddp_world_size == 0
    gradient_accumulation_steps //= ddp_world_size
else:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    master_process, seed_offset, ddp_world_size = True, 0, 1
if device.startswith("cuda"):
    torch.cuda.set_device(device)
device_type = "cuda" if device.startswith("cuda") else "cpu"
os.makedirs(out_dir, exist_ok=True)
torch.manual_seed(1337 + seed_offset)


def get_batch(split):
    # A fresh memmap per batch, as nanoGPT does (a long-lived one holds its pages)
    data = np.memmap(os.path.join(data_dir, f"{split}.bin"), dtype=np.uint16, mode="r")
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([torch.from_numpy(data[i:i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block_size].astype(np.int64)) for i in ix])
    if device_type == "cuda":
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


iter_num = 0
best_val_loss = 1e9
model_args = dict(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size, vocab_size=vocab_size)
if init_from == "resume":
    checkpoint = torch.load(os.path.join(out_dir, "ckpt.pt"), map_location=device)
    model_args = checkpoint["model_args"]
    model = GPT(GPTConfig(**model_args))
    model.load_state_dict(checkpoint["model"])
    iter_num = checkpoint["iter_num"]
    best_val_loss = checkpoint["best_val_loss"]
else:
    model = GPT(GPTConfig(**model_args))
model.to(device)
optimizer = model.configure_optimizers(weight_decay, learning_rate, (0.9, 0.95))
if init_from == "resume":
    optimizer.load_state_dict(checkpoint["optimizer"])
    checkpoint = None
if ddp:
    model = DDP(model, device_ids=[ddp_local_rank] if device_type == "cuda" else None)
raw_model = model.module if ddp else model


@torch.no_grad()
def estimate_loss():
    out = {}
    model.eval()
    for split in ["train", "val"]:
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            X, Y = get_batch(split)
            logits, loss = model(X, Y)
            losses[k] = loss.item()
        out[split] = losses.mean().item()
    model.train()
    return out


def get_lr(it):
    # linear warmup, then a cosine decay down to min_lr at lr_decay_iters, then min_lr
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return min_lr + coeff * (learning_rate - min_lr)


evals = []  # (iter, train loss, val loss, best_val_loss before), for the tests
X, Y = get_batch("train")
t0 = time.time()
while True:
    lr = get_lr(iter_num)
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr

    if iter_num % eval_interval == 0 and master_process:
        losses = estimate_loss()
        evals.append((iter_num, losses["train"], losses["val"], best_val_loss))
        print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}", flush=True)
        if losses["val"] < best_val_loss or always_save_checkpoint:
            best_val_loss = losses["val"]
            if iter_num > 0:
                checkpoint = {"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
                              "model_args": model_args, "iter_num": iter_num, "best_val_loss": best_val_loss}
                print(f"saving checkpoint to {out_dir}", flush=True)
                torch.save(checkpoint, os.path.join(out_dir, "ckpt.pt"))

    for micro_step in range(gradient_accumulation_steps):
        # only the last micro-step's backward all-reduces the gradients
        sync = not ddp or micro_step == gradient_accumulation_steps - 1
        with nullcontext() if sync else model.no_sync():
            logits, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps
            X, Y = get_batch("train")  # the next batch, fetched while the model computes
            loss.backward()
    if grad_clip != 0.0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

    t1 = time.time()
    dt, t0 = t1 - t0, t1
    if iter_num % log_interval == 0 and master_process:
        lossf = loss.item() * gradient_accumulation_steps
        print(f"iter {iter_num}: loss {lossf:.4f}, time {dt * 1000:.2f}ms", flush=True)
    iter_num += 1
    if iter_num > max_iters:
        break

if out:
    rank = int(os.environ.get("RANK", 0))
    torch.save({k: v.detach().clone() for k, v in raw_model.state_dict().items()}, f"{out}.rank{rank}.pt")
    torch.save(optimizer.state_dict(), f"{out}.rank{rank}.opt.pt")
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump({"step": iter_num, "loss": loss.item(), "evals": evals, "best_val_loss": best_val_loss}, f)
if ddp:
    destroy_process_group()
