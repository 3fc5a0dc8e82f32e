"""A plain DDP script training a small GPT on a synthetic language (scripts/bench_diloco_quality.py runs it).

torchrun-style: it reads RANK, WORLD_SIZE, MASTER_ADDR... from its environment (gloo on CPU, nccl
with the GPU of LOCAL_RANK when CUDA is there) and knows nothing of ftrun, so `ftrun --hook diloco`
changes how the replicas train together without a line changed here.

The language (made here from --lang-seed, nothing downloaded) has structure at three ranges. Its
64 tokens fall in 8 classes of 8; a sequence's next class depends on the classes of the two tokens
before it (a second-order table over classes), and the token within that class depends on a topic,
one of 8, drawn once per sequence and never shown: a model must infer the topic from the tokens
seen so far. Because the class part does not depend on the topic, the best any model can do is
computed exactly: the Bayes-optimal predictor (the topic's posterior given the prefix, mixed over
the topics' token tables) scores the held-out set at `floor_loss`, and the best predictor that
ignores the topic at `no_topic_loss`: a model below that one infers the topic. The unigram and
bigram baselines (counted on a large sample of the language, scored on the same held-out set) say
what a model gets without the longer-range structure.

The model is a decoder-only transformer written out below (causal self-attention, pre-LayerNorm
blocks, learnt positions), trained with AdamW (linear warm-up, cosine decay to a tenth). Each rank
draws its own seeded batches (different per rank and step); the held-out set is the same on every
rank and in every run of one --lang-seed. It writes one JSON per rank (--out PREFIX:
PREFIX.rankR.json): the training loss of every step, the held-out loss every --eval-every steps
and at the end, the samples seen by all ranks, steps/s (evaluation excluded), wall time, and a
SHA-256 of the parameters at each evaluation and at the end (two ranks with the same digest hold
bitwise the same model).

Must never import ftrun: it is the unmodified user script the benchmark measures.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

VOCAB, CLASSES, TOPICS, ORDER = 64, 8, 8, 2
PER_CLASS = VOCAB // CLASSES
BOS = CLASSES  # the class of the two virtual tokens before a sequence


def parse(argv: Optional[list] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=500, help="optimizer steps in all")
    p.add_argument("--batch", type=int, default=16, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=64, help="context length (tokens a sequence gives the model)")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks")
    p.add_argument("--dim", type=int, default=128, help="model width")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW's peak learning rate")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default: 5%% of --steps)")
    p.add_argument("--seed", type=int, default=0, help="the model's initialisation and the ranks' batches")
    p.add_argument("--lang-seed", type=int, default=0, help="the language and its held-out set")
    p.add_argument("--heldout", type=int, default=256, help="held-out sequences")
    p.add_argument("--eval-every", type=int, default=100, help="held-out loss every this many steps (and at the end)")
    p.add_argument("--out", default=None, help="write PREFIX.rankR.json")
    args = p.parse_args(argv)
    for name in ("steps", "batch", "seq", "layers", "dim", "heads", "heldout", "eval_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.dim % args.heads:
        p.error("--dim must be a multiple of --heads")
    if args.warmup is None:
        args.warmup = max(1, args.steps // 20)
    return args


# --------------------------------------------------------------------------- the language


class Language:
    """Second-order classes, topic-dependent tokens within a class (see the module's docstring)."""

    def __init__(self, seed: int) -> None:
        g = torch.Generator().manual_seed(424_242 + seed)
        # P(class | the classes of the ORDER tokens before): peaked rows, one per context (BOS included).
        self.pc = torch.softmax(2.5 * torch.randn(*[CLASSES + 1] * ORDER, CLASSES, generator=g), dim=-1)
        # P(token within its class | topic, class): each topic prefers other tokens of a class.
        self.pt = torch.softmax(2.5 * torch.randn(TOPICS, CLASSES, PER_CLASS, generator=g), dim=-1)

    def sample(self, n: int, length: int, g: torch.Generator) -> torch.Tensor:
        topic = torch.randint(TOPICS, (n,), generator=g)
        before = [torch.full((n,), BOS, dtype=torch.long)] * ORDER  # the classes before, oldest first
        out = torch.empty(n, length, dtype=torch.long)
        for t in range(length):
            c = torch.multinomial(self.pc[tuple(before)], 1, generator=g).squeeze(1)
            w = torch.multinomial(self.pt[topic, c], 1, generator=g).squeeze(1)
            out[:, t] = c * PER_CLASS + w
            before = before[1:] + [c]
        return out

    def floor_loss(self, x: torch.Tensor, topic_inferred: bool = True) -> float:
        """The Bayes-optimal predictor's mean loss on targets x[:, 1:] given their prefixes; with
        topic_inferred False, the best predictor that ignores the topic (its prior, not its posterior)."""
        n, length = x.shape
        c, w = x // PER_CLASS, x % PER_CLASS
        padded = torch.cat([torch.full((n, ORDER), BOS), c], dim=1)
        log_class = self.pc.log()[tuple(padded[:, i:i + length] for i in range(ORDER)) + (c,)]  # (n, L)
        log_tok = self.pt.log()[:, c, w].permute(1, 2, 0)  # (n, L, topics)
        seen = torch.cumsum(log_tok, dim=1) - log_tok      # log P(prefix | topic), its tokens-within-class part
        post = torch.log_softmax(seen if topic_inferred else torch.zeros_like(seen), dim=-1)  # uniform prior
        log_p = log_class + torch.logsumexp(post + log_tok, dim=-1)
        return -log_p[:, 1:].mean().item()


def ngram_losses(lang: Language, heldout: torch.Tensor, seed: int) -> Dict[str, float]:
    """Unigram and bigram models counted on 4,096 sequences of the language, scored on the held-out targets."""
    sample = lang.sample(4096, heldout.shape[1], torch.Generator().manual_seed(777_777 + seed))
    uni = torch.bincount(sample.reshape(-1), minlength=VOCAB).double() + 0.5
    bi = torch.bincount((sample[:, :-1] * VOCAB + sample[:, 1:]).reshape(-1), minlength=VOCAB * VOCAB)
    bi = bi.double().view(VOCAB, VOCAB) + 0.5
    prev, nxt = heldout[:, :-1].reshape(-1), heldout[:, 1:].reshape(-1)
    return {"unigram_loss": -(uni / uni.sum()).log()[nxt].mean().item(),
            "bigram_loss": -(bi / bi.sum(1, keepdim=True)).log()[prev, nxt].mean().item()}


# --------------------------------------------------------------------------- the model


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, heads, t, d/heads)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, ctx: int, dim: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(ctx, dim)
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(layers)])
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        return self.head(self.ln(self.blocks(x)))


def lm_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    logits = model(x[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))


def digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


# --------------------------------------------------------------------------- the loop


def main() -> None:
    args = parse()
    wall0 = time.perf_counter()
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)  # one worker per core: the benchmark's machine has few

    lang = Language(args.lang_seed)
    heldout = lang.sample(args.heldout, args.seq + 1, torch.Generator().manual_seed(999_999 + args.lang_seed))
    baselines = {"floor_loss": lang.floor_loss(heldout), "no_topic_loss": lang.floor_loss(heldout, False),
                 **ngram_losses(lang, heldout, args.lang_seed)}
    heldout_dev = heldout.to(device)

    torch.manual_seed(args.seed)
    model = DDP(GPT(VOCAB, args.seq, args.dim, args.layers, args.heads).to(device),
                device_ids=[device.index] if use_cuda else None)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))

    def lr_at(step: int) -> float:  # a factor of --lr for the step after `step` steps
        if step < args.warmup:
            return (step + 1) / args.warmup
        done = (step - args.warmup) / max(1, args.steps - args.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, done)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    train_g = torch.Generator().manual_seed(1 + args.seed * 1000 + rank)  # each rank its own batches

    def sync() -> None:
        if use_cuda:
            torch.cuda.synchronize(device)

    @torch.no_grad()
    def evaluate() -> float:
        net = model.module
        net.eval()
        total = sum(lm_loss(net, heldout_dev[i:i + 64]).item() * len(heldout_dev[i:i + 64])
                    for i in range(0, len(heldout_dev), 64))
        net.train()
        return total / len(heldout_dev)

    losses: List[float] = []
    evals: List[Dict] = []
    train_s = 0.0
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        x = lang.sample(args.batch, args.seq + 1, train_g).to(device)
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(model, x)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
        sync()
        train_s += time.perf_counter() - t0
        if step % args.eval_every == 0 or step == args.steps:
            evals.append({"step": step, "samples": step * args.batch * world, "heldout_loss": evaluate(),
                          "sha256": digest(model.module)})

    result = {"rank": rank, "world": world, "params": sum(p.numel() for p in model.parameters()),
              "steps": args.steps, "batch": args.batch, "seq": args.seq, "layers": args.layers, "dim": args.dim,
              "samples": args.steps * args.batch * world, "tokens": args.steps * args.batch * world * args.seq,
              "steps_per_s": args.steps / train_s, "wall_s": time.perf_counter() - wall0,
              "losses": losses, "evals": evals, "heldout_loss": evals[-1]["heldout_loss"],
              "sha256": evals[-1]["sha256"], **baselines, "device": str(device), "torch": torch.__version__}
    print(json.dumps({k: v for k, v in result.items() if k not in ("losses", "evals")}), flush=True)
    if args.out:
        Path(f"{args.out}.rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
