"""A layer backward's moments of peft's LoRA adapters on a gated MLP's three linears (``--lora-targets``
gate, up and down together: all-linear, the QLoRA paper's choice) under transformers' code
(``--impl hf``), where peft keeps the adapters in fp32 (``config.trainable.fp32_adapters``).

peft's ``Linear.forward`` (lora/layer.py) runs ``result = base_layer(x)``, then, the input cast to the
adapters' dtype, ``result = result + lora_B(lora_A(x.to(fp32))) * scaling`` — the 16-bit base output and
the fp32 product summed in fp32 — and casts the sum back (``result.to(torch_result_dtype)``). So, traced
op by op at Llama 3 8B's widths (s 512, two layers, each storage's maker, docs/peak-accuracy.md
"All-linear LoRA"), with e the activation bytes, 4 the adapters', r the rank, T the tokens:

- An adapted linear's backward (``down_backward``): the cast's backward makes dY in fp32 [T, out], the
  sum's the base's share as a 16-bit copy [T, out] and the adapter's, dY32 · scaling [T, out] fp32; dY32
  dies, B's backward makes dW_B [out, r] and d(A x) [T, r] and frees A x (its save) and the scaled
  gradient; A's makes dW_A [r, in] and dx32 [T, in] in fp32 — W_down's, over [T, f], tops the layer
  without checkpointing, beside the incoming dY and the base's 16-bit copy.
- Under (non-reentrant) checkpointing the cast's, the sum's and the scaling's backward need no saved
  tensor, so they run before the re-run, and their dY copy and scaled gradient wait through it; the re-run
  forward's top is W_up's adapter (``rerun_forward``): the base's output [T, f], B·A·x32 and its scaled
  copy [T, f] in fp32, beside the residual stream and the MLP's input (both [T, h], held by the forward
  until the MLP returns), with every save made but W_up's output and W_down's adapter's (its fp32 input
  copy and A x) — 12.996 [T, h] above the layer's re-run working set, where the estimate had read the
  re-run saves and W_down's full-training buffers (4.86 [T, h] under).

Modelled where the measured sequence is the code's (``modelled``): a gated MLP of separate linears (not
Phi-3's or GLM's fused ``gate_up_proj``, not GELU's two) after an RMSNorm (StableLM's LayerNorm keeps its
attention input alive through the re-run: one [T, h] more there, not traced), a sequential layer without
post norms, peft's fp32 adapters on all three (not bitsandbytes' QLoRA layer, whose forward casts the
adapter's product to the result's dtype before the sum), no adapter dropout, no mixture of experts; the
re-run under full non-reentrant checkpointing. Measured exact (every moment but the NB bytes) at Llama 3
8B's, Llama 3.2 1B's, Qwen3 8B's, Qwen2.5 7B's, Mistral 7B's and Granite 3.0 8B's widths, with and without
checkpointing, at ranks 4 to 32 and one or two sequences a micro-batch; Gemma 2B's re-run 81,920 B (5·T·r
fp32) under, not traced. Elsewhere ``strategies.lora.mlp_adapter_note`` says the moment reads low.
"""

from __future__ import annotations

from memplan.blocks.inventory import Dims
from memplan.blocks.profiles import profile_of
from memplan.config import Checkpointing, Impl, Method, MlpType, NormType, Setup
from memplan.config.finetune import Target
from memplan.config.trainable import adapted, fp32_adapters

ADAPTER_BYTES = 4
"""peft's adapters under ``fp32_adapters``: fp32 weights, inputs cast to fp32."""

_THREE = frozenset({Target.GATE, Target.UP, Target.DOWN})


def modelled(setup: Setup) -> bool:
    """The top layer's gated MLP carries peft's fp32 adapters on gate, up and down, in the code whose
    sequence this module replays (module docstring), without checkpointing or under full non-reentrant
    checkpointing (every-K's and reentrant re-runs are other sequences)."""
    m, ft, ckpt = setup.model, setup.finetune, setup.strategy.checkpointing
    rerun = ckpt is Checkpointing.FULL and not setup.impl.reentrant
    return (
        (ckpt is Checkpointing.NONE or rerun)
        and setup.impl.impl is Impl.HF
        and ft.method is Method.LORA
        and fp32_adapters(setup)
        and ft.dropout == 0
        and m.mlp is MlpType.SWIGLU
        and m.norm is NormType.RMSNORM
        and m.moe is None
        and not m.parallel_residual
        and not m.post_norms
        and not profile_of(setup).fused_gate_up
        and adapted(setup, m.num_layers - 1) >= _THREE
    )


def down_backward(setup: Setup, dims: Dims) -> int | None:
    """W_down's adapter at its A's backward, above the layer's live set: the incoming dY [T, h] and the
    base's 16-bit copy of it, dW_B [h, r], d(A x) [T, r], dW_A [r, f] and dx32 [T, f] in fp32, A x [T, r]
    (a save) freed. Measured at Llama 3 8B's widths: 9.1406 [T, h] (the layer's top without
    checkpointing). None where not ``modelled``."""
    if not modelled(setup):
        return None
    t, h, f, e, r, a = dims.tokens, dims.h, dims.f, dims.act.bytes, setup.finetune.rank, ADAPTER_BYTES
    return 2 * t * h * e + a * (h * r + r * f + t * f)


def rerun_forward(setup: Setup, dims: Dims) -> int | None:
    """A checkpointed layer's re-run forward at W_up's adapter, above the layer's live set with its whole
    re-run working set: dY [T, h], W_down's adapter's backward begun before the re-run (dY's 16-bit copy and
    the scaled fp32 gradient [T, h]), the residual stream and the MLP's input [T, h], W_up's base output
    [T, f] and B·A·x32 with its scaled copy in fp32 [T, f]; not made yet: W_up's output [T, f] and W_down's
    adapter's saves (its fp32 input [T, f], A x [T, r]). None but under full non-reentrant checkpointing
    where ``modelled``."""
    if setup.strategy.checkpointing is not Checkpointing.FULL or not modelled(setup):
        return None
    t, h, f, e, r, a = dims.tokens, dims.h, dims.f, dims.act.bytes, setup.finetune.rank, ADAPTER_BYTES
    held = 4 * t * h * e + a * t * h  # dY, its copy, the residual, the MLP's input; the scaled gradient
    up = t * f * e + 2 * a * t * f  # W_up's base output, B·A·x32 and its scaled copy
    not_yet = t * f * e + a * t * f + a * t * r  # W_up's output, W_down's adapter's input copy and A x
    return held + up - not_yet
