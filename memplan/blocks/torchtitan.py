"""torchtitan's Llama 3 (torchtitan 0.3.0, ``torchtitan/models/llama3`` on ``models/common``) as a profile.

Every fact cites the code that causes it and is checked by running that code under fake tensors
(``memplan.measure.frameworks.titan``, tests/titan/). What torchtitan keeps as memplan's reference model does
(the
fused ``wqkv``'s input, SDPA's q, k, v, out and logsumexp, the SwiGLU's four [b, s, ffn] tensors, the fp32
``cross_entropy`` of ``components/loss.py``) needs no switch.

Known limitations:
- NB: measured with CPU kernels (``trace --impl torchtitan`` runs on CPU). On a GPU torch may run a fused
  ``_fused_rms_norm`` kernel and torchtitan's SDPA prefers cuDNN attention; neither is checked here, so
  ``--device cuda`` estimates keep the CPU facts (with the CUDA flash RNG state the reference counts).
- NB: torchtitan's ``SelectiveAC`` (per-op save list) is refused: its list holds CUDA's SDPA ops, not the
  CPU flash kernel, so a CPU run would not show what a GPU run keeps.
"""

from __future__ import annotations

from memplan.blocks.profile import Profile
from memplan.config import Impl, Setup


def profile(setup: Setup, compiled: bool = False) -> Profile:
    """torchtitan's Llama 3: ``nn.RMSNorm`` (``F.rms_norm``), the complex rotary cache of each layer and
    ``FullAC``'s re-run without early stop; the summed loss divided by the valid-token count (its labels
    are not padded: ``cross_entropy_loss`` takes them as they are). ``compiled``: ``apply_compile``'s
    ``torch.compile`` of each block (``Profile.compiled_block``; measured: its partitioner keeps the
    reference block's values, W_O's output in place of the residual sum, and the rotary cache's conjugate,
    the bytes of the eager per-layer cache)."""
    return Profile(
        impl=Impl.TORCHTITAN,
        rms_norm_fp32_product=True,
        rope_cache_per_layer=True,
        loss_over_token_count=True,
        checkpoint_reruns_all=True,
        compiled_block=compiled,
    )
