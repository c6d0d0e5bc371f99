"""torchtitan's Llama 3 (torchtitan 0.3.0, ``torchtitan/models/llama3`` on ``models/common``) as a profile.

Every fact cites the code that causes it and is checked by running that code under fake tensors
(``memplan.measure.titan``, tests/titan/). What torchtitan keeps as memplan's reference model does (the
fused ``wqkv``'s input, SDPA's q, k, v, out and logsumexp, the SwiGLU's four [b, s, ffn] tensors, the fp32
``cross_entropy`` of ``components/loss.py``) needs no switch.
"""

from __future__ import annotations

from memplan.blocks.profile import Profile
from memplan.config import Impl, Setup


def profile(setup: Setup) -> Profile:
    """torchtitan's Llama 3: ``nn.RMSNorm`` (``F.rms_norm``), the complex rotary cache of each layer and
    ``FullAC``'s re-run without early stop; its labels are not padded (``cross_entropy_loss`` takes them as
    they are)."""
    return Profile(
        impl=Impl.TORCHTITAN,
        rms_norm_fp32_product=True,
        rope_cache_per_layer=True,
        checkpoint_early_stop=False,
    )
