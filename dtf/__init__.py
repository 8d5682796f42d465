"""dtf: configuration-driven distributed training for PyTorch on Hydra."""

__version__ = "0.1.0"
