"""scripts/bench_frameworks.py's Hugging Face worker: an unmodified Trainer script (no ftrun in it),
a 4-layer GPT-2 built from a config of about --params parameters (a vocabulary of 8192, tied
embeddings), AdamW (the Trainer's default) on random tokens. Writes OUT.rankN.json (each optimizer
step's end on the worker's wall and CPU clocks) and prints its first step's wall time."""

import time

from bench_frameworks_common import announce, arguments, clocks, report


def main() -> None:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    global STEP_SLEEP
    args = arguments()
    STEP_SLEEP = args.step_sleep
    times = []

    class Times(TrainerCallback):
        def on_step_end(self, a, state, control, **kwargs):
            announce(state.global_step)  # before the sleep, as train_ft.py's --announce
            time.sleep(STEP_SLEEP)
            times.append(clocks())

    # 4 layers of width W hold about 48 W^2 parameters, the embeddings 8192 W.
    width = 64
    while 48 * (width + 64) ** 2 + 8192 * (width + 64) <= args.params:
        width += 64
    config = GPT2Config(n_layer=4, n_head=4, n_embd=width, n_positions=64, vocab_size=8192, bos_token_id=0,
                        eos_token_id=0)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 8192, (args.batch * 2 * args.steps, 64), generator=g)
    data = [{"input_ids": row, "labels": row} for row in ids]
    targs = TrainingArguments(output_dir=args.out + ".hf", per_device_train_batch_size=args.batch,
                              max_steps=args.steps, save_strategy="no", logging_strategy="no", report_to=[],
                              use_cpu=True, disable_tqdm=True, seed=0)
    Trainer(model=model, args=targs, train_dataset=data, callbacks=[Times()]).train()
    report(args.out, times)


STEP_SLEEP = 0.0

if __name__ == "__main__":
    main()
