"""transformers' ``modeling_phi3.py``: Llama's code with a sliding window (``llama.windowed``) and fused
projections (``Phi3Attention.qkv_proj``, ``Phi3MLP.gate_up_proj``); the parameters equal the separate
matrices', what is kept does not."""

from __future__ import annotations

from dataclasses import replace

from memplan.blocks.hf.llama import windowed
from memplan.blocks.profile import Profile
from memplan.config import Setup


def profile(setup: Setup) -> Profile:
    """Phi-3: q/k/v sliced from one ``qkv_proj`` output, gate/up ``chunk``ed from one ``gate_up_proj``."""
    return replace(windowed(setup), fused_qkv=True, fused_gate_up=True)
