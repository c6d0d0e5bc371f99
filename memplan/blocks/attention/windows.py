"""Sliding-window layer kinds: which layers attend through the window (Gemma-2/3's every-n-th full layer,
Qwen2's first N full), from the model config alone."""

from __future__ import annotations

from memplan.config import ModelConfig


def full_and_sliding(m: ModelConfig) -> bool:
    """Whether both layer types exist (``sliding_window_pattern``: every n-th layer full; ``full_layers``:
    the first N full): transformers then makes a causal and a sliding-window mask
    (``Gemma2Model.forward``'s / ``Qwen2Model.forward``'s ``causal_mask_mapping``)."""
    every = m.sliding_window_pattern
    return (every is not None and m.num_layers >= every) or m.full_layers is not None


def is_sliding(m: ModelConfig, layer: int) -> bool:
    """Whether layer i attends through the sliding window: with ``sliding_window_pattern`` n unless
    (i + 1) % n == 0 (``Gemma2Config`` / ``Gemma3TextConfig``'s ``layer_types``), with ``full_layers`` N
    when i ≥ N (``Qwen2Config``'s: ``i >= max_window_layers``), else every layer when a window is set."""
    if m.sliding_window is None:
        return False
    every = m.sliding_window_pattern
    if every:
        return (layer + 1) % every != 0
    return layer >= (m.full_layers or 0)


def sliding_layers(m: ModelConfig) -> int:
    """How many layers slide (``is_sliding``)."""
    return sum(is_sliding(m, i) for i in range(m.num_layers))
