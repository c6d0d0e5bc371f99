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

Modelled where the measured sequence is the code's (``modelled``): a gated MLP after an RMSNorm, its
linears separate or with Phi-3's fused ``gate_up_proj`` (one adapter over [T, 2f]: ``up_backward``'s and
``rerun_forward``'s widths), not GELU's two (StableLM's LayerNorm keeps its attention input alive through
the re-run: one [T, h] more there, not traced), a sequential layer without post norms, peft's fp32
adapters on all three (not bitsandbytes' QLoRA layer, whose forward casts the adapter's product to the
result's dtype before the sum), no adapter dropout, no mixture of experts; the re-run under full
non-reentrant checkpointing. Measured exact (every moment but the NB bytes) at Llama 3 8B's, Llama 3.2
1B's, Qwen3 8B's, Qwen2.5 7B's, Mistral 7B's, Granite 3.0 8B's, Gemma 2B's, Phi-3-mini's, Phi-4's and GLM-4
9B's widths, with and without checkpointing, at ranks 4 to 32 and one or two sequences a micro-batch.
Elsewhere ``strategies.lora.mlp_adapter_note`` says the moment reads low.
"""

from __future__ import annotations

from memplan.blocks.inventory import Dims
from memplan.blocks.profiles import profile_of
from memplan.config import Checkpointing, DType, Impl, Method, MlpType, NormType, Setup
from memplan.config.finetune import Target
from memplan.config.trainable import adapted, fp32_adapters

ADAPTER_BYTES = DType.FP32.bytes
"""peft's adapters under ``fp32_adapters`` (``strategies.lora.adapter_dtype``): fp32 weights, inputs cast
to fp32."""

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
        and adapted(setup, m.num_layers - 1) >= _THREE
    )


def _first_out(setup: Setup, dims: Dims) -> int:
    """The output width of the MLP's first adapted linear: W_up's f, or the fused ``gate_up_proj``'s 2f
    (Phi-3: one adapter over both, ``Profile.fused_gate_up``)."""
    return 2 * dims.f if profile_of(setup).fused_gate_up else dims.f


def down_backward(setup: Setup, dims: Dims) -> int | None:
    """W_down's adapter at its A's backward, above the layer's live set: the incoming dY [T, h] and the
    base's 16-bit copy of it, dW_B [h, r], d(A x) [T, r], dW_A [r, f] and dx32 [T, f] in fp32, A x [T, r]
    (a save) freed. Measured at Llama 3 8B's widths: 9.1406 [T, h] (the layer's top without
    checkpointing). None where not ``modelled``."""
    if not modelled(setup):
        return None
    t, h, f, e, r, a = dims.tokens, dims.h, dims.f, dims.act.bytes, setup.finetune.rank, ADAPTER_BYTES
    return 2 * t * h * e + a * (h * r + r * f + t * f)


def up_backward(setup: Setup, dims: Dims) -> int | None:
    """The first linear's adapter (W_up's; a fused ``gate_up_proj``'s, over [T, 2f]) at its scaled
    gradient, above the layer's live set: dY [T, h] and W_down's adapter's gradients beside dY32, its
    16-bit copy and dY32 · scaling over [T, out] (the incoming 16-bit gradient freed); W_down's adapter's
    fp32 input and A x freed, and W_up's output and the activation (their own gradient, d(act), kept
    where separate: the two cancel) — fused, the [T, 2f] output and the activation freed beside the
    ``cat`` of the two gradients, itself freed once cast. Measured: 8.137 [T, h] at Llama 3 8B's widths
    (below W_down's), 14.443 at Phi-3-mini's (the layer's top without checkpointing). None where not
    ``modelled``."""
    if not modelled(setup):
        return None
    t, h, f, e, r, a = dims.tokens, dims.h, dims.f, dims.act.bytes, setup.finetune.rank, ADAPTER_BYTES
    out = _first_out(setup, dims)
    held = t * h * e + a * (h * r + r * f) - a * t * r - a * t * f  # dY, W_down's grads; its saves freed
    fused = t * f * e if out > f else 0  # the activation freed, its gradient gone into the cat
    return held + 2 * a * t * out - fused


def rerun_forward(setup: Setup, dims: Dims) -> int | None:
    """A checkpointed layer's re-run forward at W_up's adapter, above the layer's live set with its whole
    re-run working set: dY [T, h], W_down's adapter's backward begun before the re-run (dY's 16-bit copy and
    the scaled fp32 gradient [T, h]), the residual stream and the MLP's input [T, h], W_up's base output
    [T, f] and B·A·x32 with its scaled copy in fp32 [T, f]; not made yet: W_up's output [T, f] and W_down's
    adapter's saves (its fp32 input [T, f], A x [T, r]). A fused ``gate_up_proj``'s over [T, 2f], the
    activation not made yet either. None but under full non-reentrant checkpointing where ``modelled``."""
    if setup.strategy.checkpointing is not Checkpointing.FULL or not modelled(setup):
        return None
    t, h, f, e, r, a = dims.tokens, dims.h, dims.f, dims.act.bytes, setup.finetune.rank, ADAPTER_BYTES
    out = _first_out(setup, dims)
    held = 4 * t * h * e + a * t * h  # dY, its copy, the residual, the MLP's input; the scaled gradient
    up = t * out * e + 2 * a * t * out  # the base output, B·A·x32 and its scaled copy
    # not made yet: the output (fused: and the activation after it), W_down's adapter's input and A x
    not_yet = t * out * e + (t * f * e if out > f else 0) + a * t * f + a * t * r
    return held + up - not_yet
