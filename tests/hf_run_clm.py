"""A causal language-model training script in the shape of transformers' run_clm.py, for
`ftrun --ft` with no ftrun in it.

Source: huggingface/transformers, examples/pytorch/language-modeling/run_clm.py: dataclasses of
model and data arguments parsed with TrainingArguments by HfArgumentParser, set_seed, a model
built from a config (--model_type, --config_overrides), texts cut into blocks with labels = input
ids, a Trainer with default_data_collator, preprocess_logits_for_metrics and an accuracy
compute_metrics, train(resume_from_checkpoint=...), save_model(), log/save_metrics,
save_state(), evaluate() and perplexity. Written again here in its shape; what differs, and why:
- no download: the "tokenized texts" are a synthetic stream of token ids (counting up by a
  stride, mod the vocabulary: learnable), grouped into blocks as run_clm's group_texts does,
  in plain Python (the `datasets` package is not installed); no tokenizer, no hub, no model card;
- accuracy is computed in the script (evaluate.load would download it);
- the test's harness: --sleep S a step, ten times that while the file OUT.slow exists (the test
  makes it while a killed replica is away, so that it is back before the run's end however
  loaded the machine), and a report at the end, OUT.rankN.json (the log history, the evaluation's
  metrics, the global step, the best checkpoint, a digest of the parameters, whether the Trainer
  took itself for process zero), and
  OUT.rankN.starts (a line per train() start).
argv: run_clm's (--model_type gpt2 --config_overrides ... --output_dir ... --do_train ...), plus
--report OUT [--sleep S].
"""

import json
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from itertools import chain
from typing import Optional

import torch

import transformers
from transformers import (CONFIG_MAPPING, AutoModelForCausalLM, HfArgumentParser, Trainer, TrainerCallback,
                          TrainingArguments, default_data_collator, set_seed)

logger = logging.getLogger(__name__)


@dataclass
class ModelArguments:
    model_type: Optional[str] = field(default="gpt2", metadata={"help": "a model type to build from scratch"})
    config_overrides: Optional[str] = field(default=None, metadata={"help": "n_embd=10,resid_pdrop=0.2,..."})


@dataclass
class DataTrainingArguments:
    block_size: Optional[int] = field(default=16, metadata={"help": "the length of a training block"})
    train_tokens: int = field(default=4096, metadata={"help": "tokens of the synthetic training texts"})
    validation_tokens: int = field(default=768, metadata={"help": "tokens of the synthetic validation texts"})
    max_train_samples: Optional[int] = field(default=None)
    max_eval_samples: Optional[int] = field(default=None)


@dataclass
class HarnessArguments:
    report: str = field(default="", metadata={"help": "the test's report: REPORT.rankN.json"})
    sleep: float = field(default=0.0, metadata={"help": "seconds a step (ten times that while REPORT.slow exists)"})


def synthetic_texts(tokens: int, vocab: int, seed: int) -> list:
    """Texts of token ids standing in for a tokenized dataset: each counts up by its stride."""
    g = torch.Generator().manual_seed(seed)
    texts, n = [], 0
    while n < tokens:
        length = int(torch.randint(8, 40, (1,), generator=g))
        start, stride = int(torch.randint(0, vocab, (1,), generator=g)), int(torch.randint(1, 4, (1,), generator=g))
        texts.append({"input_ids": [(start + stride * i) % vocab for i in range(length)]})
        n += length
    return texts


def group_texts(examples: list, block_size: int) -> list:
    """run_clm's group_texts: every text concatenated, cut into blocks, labels = input ids."""
    ids = list(chain(*(e["input_ids"] for e in examples)))
    total = (len(ids) // block_size) * block_size
    return [{"input_ids": ids[i:i + block_size], "labels": ids[i:i + block_size]} for i in range(0, total, block_size)]


class Harness(TrainerCallback):
    def on_train_begin(self, args, state, control, **kwargs):
        with open(f"{HARNESS.report}.rank{RANK}.starts", "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "step": state.global_step}) + "\n")

    def on_step_end(self, args, state, control, **kwargs):
        if HARNESS.sleep:
            time.sleep(HARNESS.sleep * (10 if os.path.exists(f"{HARNESS.report}.slow") else 1))


def main() -> None:
    global HARNESS
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments, HarnessArguments))
    model_args, data_args, training_args, HARNESS = parser.parse_args_into_dataclasses()

    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", datefmt="%m/%d/%Y %H:%M:%S",
                        handlers=[logging.StreamHandler(sys.stdout)])
    transformers.utils.logging.set_verbosity_warning()
    set_seed(training_args.seed)

    config = CONFIG_MAPPING[model_args.model_type]()
    if model_args.config_overrides is not None:
        config.update_from_string(model_args.config_overrides)
    model = AutoModelForCausalLM.from_config(config)

    block_size = data_args.block_size
    lm_datasets = {"train": group_texts(synthetic_texts(data_args.train_tokens, config.vocab_size, 1), block_size),
                   "validation": group_texts(synthetic_texts(data_args.validation_tokens, config.vocab_size, 2),
                                             block_size)}
    train_dataset = lm_datasets["train"][:data_args.max_train_samples]
    eval_dataset = lm_datasets["validation"][:data_args.max_eval_samples]

    def preprocess_logits_for_metrics(logits, labels):
        if isinstance(logits, tuple):
            logits = logits[0]
        return logits.argmax(dim=-1)

    def compute_metrics(eval_preds):
        preds, labels = eval_preds
        labels = labels[:, 1:].reshape(-1)
        preds = preds[:, :-1].reshape(-1)
        return {"accuracy": float((preds == labels).mean())}

    trainer = Trainer(model=model, args=training_args,
                      train_dataset=train_dataset if training_args.do_train else None,
                      eval_dataset=eval_dataset if training_args.do_eval else None,
                      data_collator=default_data_collator,
                      compute_metrics=compute_metrics if training_args.do_eval else None,
                      preprocess_logits_for_metrics=preprocess_logits_for_metrics if training_args.do_eval else None,
                      callbacks=[Harness()])

    if training_args.do_train:
        checkpoint = None
        if training_args.resume_from_checkpoint is not None:
            checkpoint = training_args.resume_from_checkpoint
        train_result = trainer.train(resume_from_checkpoint=checkpoint)
        trainer.save_model()

        metrics = train_result.metrics
        metrics["train_samples"] = len(train_dataset)
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()

    metrics = {}
    if training_args.do_eval:
        metrics = trainer.evaluate()
        metrics["eval_samples"] = len(eval_dataset)
        try:
            perplexity = math.exp(metrics["eval_loss"])
        except OverflowError:
            perplexity = float("inf")
        metrics["perplexity"] = perplexity
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)

    total = sum(float(p.detach().double().sum()) for p in model.parameters())
    with open(f"{HARNESS.report}.rank{RANK}.json", "w") as f:
        json.dump({"history": trainer.state.log_history, "eval": metrics, "step": trainer.state.global_step,
                   "best": trainer.state.best_model_checkpoint, "params": total,
                   "process_zero": trainer.is_world_process_zero()}, f)


RANK = os.environ.get("RANK", "0")
HARNESS: HarnessArguments

if __name__ == "__main__":
    main()
