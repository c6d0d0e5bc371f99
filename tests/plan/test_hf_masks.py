"""transformers' attention masks that a gradient checkpoint keeps (``constants.checkpointed_mask_rule``),
derived by hand, no torch: every checkpointed decoder layer is called with its mask kind's [b, 1, s, s]
additive mask in the activation dtype (``masking_utils.eager_mask``), one storage per kind; Gemma-2's
alternating layers (every ``sliding_window_pattern``-th full) have a sliding and a full kind once the
model has a full layer, only the sliding kind before."""

from __future__ import annotations

import pytest
from tiny_setup import B as TB
from tiny_setup import H as TH
from tiny_setup import S as TS
from tiny_setup import tiny_setup

from memplan.api import build_setup
from memplan.blocks import norm
from memplan.blocks.inventory import Block, Dims
from memplan.config import AttentionChoice, Family, Impl, ImplConfig, ModelConfig
from memplan.engine import estimate

B, S = 2, 32


def masks(layers: int, pattern: int) -> dict[str, int]:
    model = ModelConfig(
        hidden_size=64,
        num_layers=layers,
        num_heads=4,
        ffn_size=128,
        vocab_size=128,
        family=Family.GEMMA2,
        sliding_window=16,
        sliding_window_pattern=pattern,
    )
    setup = build_setup(
        model,
        seq=S,
        batch=B,
        attention=AttentionChoice.EAGER,
        checkpointing="full",
        impl=ImplConfig(impl=Impl.HF),
    )
    return {
        k.name: k.total_bytes
        for k in estimate(setup).tensors
        if k.name.startswith("attn.") and "mask" in k.name
    }


@pytest.mark.parametrize(("layers", "pattern", "kinds"), [(2, 2, 2), (3, 2, 2), (2, 3, 1), (3, 3, 2)])
def test_one_checkpointed_mask_per_kind(layers: int, pattern: int, kinds: int) -> None:
    one = B * S * S * 2  # [b, 1, s, s] bf16
    names = ["attn.mask", "attn.full_mask"][:kinds]
    assert masks(layers, pattern) == dict.fromkeys(names, one)


def test_gemma_norms_keep_one_plus_w_at_the_hidden_width() -> None:
    """Gemma's RMSNorm (transformers' GemmaRMSNorm) computes output·(1.0 + weight.float()) in fp32: autograd
    keeps the [h] fp32 ``1 + w`` of each norm for d(normed), 4·h bytes — the norm's width, the last
    dimension of its input [b, s, h] (not s, not b)."""
    model = ModelConfig(
        hidden_size=64, num_layers=2, num_heads=4, ffn_size=128, vocab_size=128, family=Family.GEMMA
    )
    setup = build_setup(model, seq=S, batch=B, impl=ImplConfig(impl=Impl.HF))
    kept = {k.name: k for k in estimate(setup).tensors if k.name.endswith("weight_plus_one")}
    assert set(kept) == {f"{n}_norm.weight_plus_one" for n in ("attn", "mlp", "final")}
    for k in kept.values():
        assert tuple(k.shape) == (64,) and k.total_bytes == 4 * 64 * k.count


def test_a_parallel_residual_mlp_norm_shares_the_attention_norms_input() -> None:
    # GPT-NeoX's use_parallel_residual: both norms read the layer input x, which the attention's norm keeps
    # already [b, s, h] (bf16); the MLP's keeps its own mean and rstd, fp32 [b, s, 1] on CUDA.
    model = {"family": Family.GPT_NEOX, "mlp": "gelu", "norm": "layernorm", "parallel_residual": True}
    s = tiny_setup(model, impl=ImplConfig(impl=Impl.HF))

    def rules(block: Block) -> list[tuple[str, tuple[int, ...], str]]:
        return [(r.name, r.shape, r.dtype.name) for r in norm.norm_rules(s, block, Dims.of(s))]

    stats = [("mean", (TB, TS, 1), "FP32"), ("rstd", (TB, TS, 1), "FP32")]
    assert rules(Block.ATTN_NORM) == [("attn_norm.input", (TB, TS, TH), "BF16")] + [
        ("attn_norm." + n, shape, d) for n, shape, d in stats
    ]
    assert rules(Block.MLP_NORM) == [("mlp_norm." + n, shape, d) for n, shape, d in stats]
