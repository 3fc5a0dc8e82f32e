"""ftrun's Lightning strategy for `ftrun --ft`: `from ftrun.lightning import FTStrategy`.

    trainer = Trainer(strategy=FTStrategy(), accelerator="gpu", devices=8, max_epochs=10)

Under `ftrun --ft` an unmodified script with `Trainer(strategy="ddp")`, or the default strategy
on several devices, gets it without this import. Only a failed replica restarts; it goes on
mid-epoch with the whole Lightning state from a live peer (ftrun/worker/frameworks/lightning.py
says what it does, docs/guides/lightning.md what it costs and its limits). FTStrategy is built
over the Lightning package the script imported before this module (`lightning.pytorch` or
`pytorch_lightning`), else the one installed; `strategy_class("pytorch_lightning")` gives the
one over a given package.
"""
# Worker-side only: the launcher never imports this module (it imports torch and Lightning).

from ftrun.worker.frameworks.lightning import strategy_class

__all__ = ["FTStrategy", "strategy_class"]

# Over the script's Lightning's DDPStrategy.
FTStrategy = strategy_class()
