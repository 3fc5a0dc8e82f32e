"""ftrun's Fabric for `ftrun --ft`: `from ftrun.fabric import Fabric`.

    fabric = Fabric(accelerator="cuda", devices=8, strategy="ddp")
    fabric.launch()
    model, optimizer = fabric.setup(model, optimizer)
    train_loader = fabric.setup_dataloaders(train_loader)
    for epoch in fabric.epochs(num_epochs):          # was: for epoch in range(num_epochs):
        for batch in train_loader: ...

Only a failed replica restarts; it goes on mid-epoch with the run's state from a live peer
(ftrun/worker/frameworks/fabric.py says what it does, docs/guides/accelerate-fabric.md what it
costs and its limits). Outside ftrun --ft it is lightning.fabric.Fabric, and epochs() is range().
"""
# Worker-side only: the launcher never imports this module (it imports torch and Lightning).

from ftrun.worker.frameworks.fabric import fabric_class

__all__ = ["Fabric"]

Fabric = fabric_class()
