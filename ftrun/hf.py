"""ftrun's Hugging Face Trainer for `ftrun --ft`: `from ftrun.hf import FTTrainer`.

    trainer = FTTrainer(model=model, args=TrainingArguments(...), train_dataset=train)
    trainer.train()

Under `ftrun --ft` an unmodified script's `Trainer(...)` gets the same without this import: only a
failed replica restarts, and its train() goes on mid-epoch with the Trainer's whole state from a
live peer (ftrun/worker/frameworks/hf.py says what it does, docs/guides/huggingface.md what it
costs and its limits). Outside ftrun --ft, FTTrainer is the Trainer.
"""
# Worker-side only: the launcher never imports this module (it imports torch and transformers).

from ftrun.worker.frameworks.hf import trainer_class

__all__ = ["FTTrainer"]

FTTrainer = trainer_class()
