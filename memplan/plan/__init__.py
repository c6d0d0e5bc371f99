"""The planning layer: parallelism per device, mixture of experts, GPUs, time, compare and fit.

Built on top of the single-device analytic core (``memplan.analytic``, ``memplan.estimate``) without
changing it: a tensor-parallel rank is a narrower model (``parallel.tp_model``), sequence parallelism and
MoE transform its inventory (``shard.py``, ``moe.py``), pipeline stages regroup it (``device.py``).
Pure Python, no torch.
"""
