"""ftrun's Lightning strategy for `ftrun --ft`: `from ftrun.lightning import FTStrategy`.

    trainer = Trainer(strategy=FTStrategy(), accelerator="gpu", devices=8, max_epochs=10)

Under `ftrun --ft` an unmodified script with `Trainer(strategy="ddp")`, or the default strategy
on several devices, gets it without this import. Only a failed replica restarts; it goes on
mid-epoch with the whole Lightning state from a live peer (ftrun/worker/frameworks/lightning.py
says what it does, docs/guides/lightning.md what it costs and its limits). FTStrategy is built
over the Lightning package installed (`lightning`, else `pytorch_lightning`);
`strategy_class("pytorch_lightning")` gives the one over the other.
"""
# Worker-side only: the launcher never imports this module (it imports torch and Lightning).

from typing import Any

from ftrun.worker.frameworks.lightning import strategy_class

__all__ = ["FTStrategy", "strategy_class"]


def __getattr__(name: str) -> Any:
    if name == "FTStrategy":  # built over Lightning's DDPStrategy when first asked for
        return strategy_class()
    raise AttributeError(f"module 'ftrun.lightning' has no attribute {name!r}")
