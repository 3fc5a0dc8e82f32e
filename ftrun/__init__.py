"""ftrun: a fault-tolerant, torchrun-style launcher for PyTorch distributed training.

This top-level module must stay import-cheap: the CLI imports it, and the CLI
never imports torch. The fault-tolerance API for training scripts lives in
``ftrun.ft`` and is only imported by scripts that opt in.
"""

__version__ = "0.1.0"
