"""An unmodified Hugging Face Trainer script (no ftrun in it): the counter model, for `ftrun --ft`.

One weight per sample and epoch, zero at the start; SGD with lr 1 passed through optimizers=, a
constant schedule, no clipping; the loss is the sum of the batch's weights of the current epoch.
DDP averages the gradients over the n replicas of a step, so a committed step lowers each of its
samples' weights by exactly 1/n: every weight ends at -1/n for the n of the step that trained it
if and only if every sample was trained exactly once in every epoch. With --accumulate k (the Trainer divides
the loss by k) a step is k batches, and every weight ends at -1/(k n).

argv: EPOCHS OUT, then options. Appends one line per train() start to OUT.rankN.starts (the
epoch and global step it started at: a restarted replica's shows where it went on), and writes
OUT.rankN.json at the end: the weights, the global step, the autocast dtypes its training
forwards ran under (["off"] without mixed precision; --bf16: ["torch.bfloat16"] once each forward
ran in it), the samples of each training forward in order, and a stateful callback's count of
steps (ExportableState: the Trainer's checkpoints save it, and a restarted replica must receive
it from a peer to end at the global step).
"""

import argparse
import dataclasses
import json
import math
import os
import time

import torch
import transformers
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_callback import ExportableState


class Indices(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"idx": i}


class Stream(torch.utils.data.IterableDataset):
    """The stream (--iterable): sample i of pass e is e * n + i (Accelerate's DDP calls the dataset's
    set_epoch(e) as each pass over it begins; the counter keeps one weight per sample and pass)."""

    def __init__(self, n: int) -> None:
        self.n, self.epoch = n, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        return ({"idx": self.epoch * self.n + i} for i in range(self.n))


class Counter(torch.nn.Module):
    def __init__(self, size: int, epochs: int, sleep: float, sleep_late: float) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(epochs, size))
        self.sleep, self.sleep_late, self.epoch = sleep, sleep_late, 0

    def forward(self, idx: torch.Tensor) -> dict:
        if self.training:
            AUTOCAST.add(str(torch.get_autocast_dtype("cpu")) if torch.is_autocast_enabled("cpu") else "off")
            TRAINED.append(idx.tolist())
        pause = self.sleep_late if self.epoch and self.sleep_late else self.sleep
        if self.training and os.path.exists(f"{OUT}.slow"):  # the test slows the run while a replica is away
            pause = max(pause, 0.3)
        if pause:
            time.sleep(pause)
        if args.iterable:  # a stream: its passes are its own (the weight of pass e, sample i: e * size + i)
            return {"loss": self.w.view(-1)[idx].sum()}
        return {"loss": self.w[self.epoch, idx].sum()}


class Epochs(TrainerCallback):
    """Tells the model its epoch; notes where each train() started."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        with open(f"{OUT}.rank{RANK}.starts", "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "epoch": math.floor(state.epoch or 0),
                                "step": state.global_step}) + "\n")

    def on_epoch_begin(self, args, state, control, model=None, **kwargs):
        COUNTER.epoch = math.floor(state.epoch or 0)


class StepCount(TrainerCallback, ExportableState):
    """Counts the steps this run took (whichever process took them): a callback with state."""

    def __init__(self, count: int = 0) -> None:
        self.count = count

    def on_step_end(self, args, state, control, **kwargs):
        self.count += 1

    def state(self) -> dict:
        return {"args": {}, "attributes": {"count": self.count}}


p = argparse.ArgumentParser()
p.add_argument("epochs", type=int)
p.add_argument("out")
p.add_argument("--size", type=int, default=120)
p.add_argument("--batch", type=int, default=4)
p.add_argument("--sleep", type=float, default=0.0)
p.add_argument("--sleep-late", type=float, default=0.0, help="the sleep a step after epoch 0 (default: --sleep)")
p.add_argument("--subclass", action="store_true", help="ftrun.hf's FTTrainer, as a script that says so")
p.add_argument("--workers", type=int, default=0, help="the Trainer's dataloader_num_workers (persistent)")
p.add_argument("--fp16", action="store_true", help="fp16 mixed precision (a GradScaler): a setup ftrun cannot heal")
p.add_argument("--bf16", action="store_true", help="bf16 mixed precision (autocast on CPU)")
p.add_argument("--data-seed", type=int, default=None, help="the Trainer's data_seed (its seed is 1)")
p.add_argument("--pretend-transformers", default=None,
               help="transformers.__version__ as this script sees it (a version ftrun does not support)")
p.add_argument("--accumulate", type=int, default=1, help="gradient_accumulation_steps")
p.add_argument("--ddp-backend", default=None, help="the Trainer's ddp_backend (gloo: what the HF docs give for CPU)")
p.add_argument("--iterable", action="store_true", help="the train set as an IterableDataset, with max_steps")
p.add_argument("--max-steps", type=int, default=0, help="with --iterable: max_steps (default: one pass)")
p.add_argument("--split-batches", action="store_true", help="Accelerate's split_batches (accelerator_config)")
args = p.parse_args()
OUT, RANK = args.out, os.environ.get("RANK", "0")
AUTOCAST = set()  # how this process's training forwards ran
TRAINED = []  # the samples of each of this process's training forwards, in order
if args.pretend_transformers:
    transformers.__version__ = args.pretend_transformers

torch.manual_seed(0)
COUNTER = Counter(args.size, args.epochs, args.sleep, args.sleep_late)
opt = torch.optim.SGD(COUNTER.parameters(), lr=1.0)
targs = TrainingArguments(output_dir=f"{OUT}.out", per_device_train_batch_size=args.batch,
                          num_train_epochs=args.epochs, max_grad_norm=0, lr_scheduler_type="constant",
                          logging_strategy="no", save_strategy="no", report_to=[], use_cpu=True,
                          disable_tqdm=True, seed=1, dataloader_drop_last=False, fp16=args.fp16, bf16=args.bf16,
                          dataloader_num_workers=args.workers, dataloader_persistent_workers=args.workers > 0,
                          gradient_accumulation_steps=args.accumulate, data_seed=args.data_seed,
                          ddp_backend=args.ddp_backend,
                          accelerator_config={"split_batches": True} if args.split_batches else None,
                          max_steps=(args.max_steps or args.size // args.batch) if args.iterable else -1)
STEPS = StepCount()
cls = Trainer
if args.subclass:
    from ftrun.hf import FTTrainer as cls
trainer = cls(model=COUNTER, args=targs, train_dataset=Stream(args.size) if args.iterable else Indices(args.size), optimizers=(opt, None),
              callbacks=[Epochs(), STEPS])
trainer.train()
with open(f"{OUT}.rank{RANK}.json", "w") as f:
    # The rest of the replica's state, which ends the same on every replica: the optimizer's, the
    # schedule's and the TrainerState (less what is this process's own: its timings, whether it
    # takes itself for process zero).
    state = dataclasses.asdict(trainer.state)
    state.pop("is_world_process_zero"), state.pop("is_local_process_zero")
    state["log_history"] = [{k: v for k, v in h.items() if not k.endswith(("_runtime", "_per_second"))}
                            for h in state["log_history"]]
    json.dump({"weights": COUNTER.w.detach().tolist(), "step": trainer.state.global_step,
               "state": repr((trainer.optimizer.state_dict(), trainer.lr_scheduler.state_dict(), state)),
               "autocast": sorted(AUTOCAST), "callback_steps": STEPS.count, "trained": TRAINED}, f)
print(f"done rank {RANK} step {trainer.state.global_step}", flush=True)
