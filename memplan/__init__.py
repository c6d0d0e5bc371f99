"""memplan: plan the memory and compute of one transformer training step, and prove it."""

__version__ = "0.1.0"
