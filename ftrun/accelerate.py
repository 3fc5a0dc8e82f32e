"""ftrun's Accelerator for `ftrun --ft`: `from ftrun.accelerate import Accelerator`.

    accelerator = Accelerator(mixed_precision="bf16", gradient_accumulation_steps=2)
    model, optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(model, optimizer, train_dl, eval_dl, scheduler)
    for epoch in accelerator.epochs(num_epochs):     # was: for epoch in range(num_epochs):
        for batch in train_dl: ...

Only a failed replica restarts; it goes on mid-epoch with the run's state from a live peer
(ftrun/worker/frameworks/accelerate.py says what it does, docs/guides/accelerate-fabric.md what it
costs and its limits). Outside ftrun --ft it is accelerate.Accelerator, and epochs() is range().
"""
# Worker-side only: the launcher never imports this module (it imports torch and Accelerate).

from ftrun.worker.frameworks.accelerate import accelerator_class

__all__ = ["Accelerator"]

Accelerator = accelerator_class()
