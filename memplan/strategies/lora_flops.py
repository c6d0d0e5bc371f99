"""Fine-tuning's FLOPs (LoRA, QLoRA, frozen parts) along the gradient flow (``strategies.lora_flow``), and
the re-run forward of segment checkpointing with LoRA (``recompute``, the ``strategies.lora`` strategy's).

FLOPs (FlopCounterMode counts matmuls): a frozen linear's backward is dX only (1× its forward), and
none when its input needs no gradient; an adapter adds 2·T·r·(in + out) forward and dA, dB, d(A·x) plus
dX when its input needs a gradient in backward. Eager attention's two bmms compute only the operand
gradients needed; the flash backward runs all five s×s products when any of q, k, v needs a gradient.

Known limitations: see ``strategies.lora`` (what fine-tuning refuses); the fp32 adapters' matmuls are
counted like the others (their time: ``time.compute``).
"""

from __future__ import annotations

from memplan.analytic.flops import Flops
from memplan.blocks import mm
from memplan.blocks.attention.core import Core, core_of
from memplan.blocks.attention.flops import attention_core_flops
from memplan.blocks.head import lm_head_flops
from memplan.blocks.inventory import Dims
from memplan.blocks.moe import early_stop_skip as moe_early_stop_skip
from memplan.blocks.moe import mlp_flops as moe_mlp_flops
from memplan.blocks.profiles import checkpoints_alone
from memplan.config import LossKind, Setup
from memplan.config.finetune import ATTN_TARGETS, Target, linear_shapes
from memplan.config.trainable import adapters, embedding_trains, final_norm_trains, head_trains
from memplan.strategies.lora_flow import Flow, flows

T = Target


def recompute(setup: Setup, dims: Dims) -> int:
    """Segment checkpointing (allowed with LoRA on every layer) re-runs each layer's forward, adapters
    included; torch's early stop skips what runs after a segment's last save (``checkpointing``'s
    docstring): B's input is saved before B's matmul [T, r]·[r, h] on an adapted down projection, else the
    product's operands before the frozen down projection [T, f]·[f, h]; nothing with residual dropout (its
    mask is saved last)."""
    segments = -(-dims.layers // setup.strategy.segment) if setup.strategy.segment else 0
    if not segments:
        return 0
    # Every-K checkpointing of single layers (``Profile.checkpoints_alone``: transformers') re-runs only the
    # checkpointed layers 0, K, 2K, …; segments of K layers re-run every layer.
    alone, k = checkpoints_alone(setup), setup.strategy.segment
    rerun = [f for i, f in enumerate(flows(setup)) if not alone or i % k == 0]
    forward = sum(layer_flops(setup, dims, f)[0] for f in rerun)
    forward += len(rerun) * attention_core_flops(dims)
    down = T.DOWN in setup.finetune.targets
    skip = mm(dims.tokens, setup.finetune.rank if down else dims.f, dims.h)
    if setup.model.moe is not None:  # frozen whole: the same last saves as in full training
        skip = moe_early_stop_skip(setup, dims)
    return forward - (segments * skip if setup.model.resid_dropout == 0 else 0)


def _linear(fwd: int, g_x: bool, trains: bool) -> int:
    """A linear's backward: dX = dY·W when its input needs a gradient, dW = dYᵀ·X when it trains (each as
    many FLOPs as the forward)."""
    return fwd * (int(g_x) + int(trains))


def input_grads(f: Flow) -> dict[Target, bool]:
    """The layer's linears under ``f``, in order, each with whether its input needs a gradient (its
    backward runs dX = dY·W)."""
    targets = [*ATTN_TARGETS, *((T.GATE, T.UP) if f.swiglu else (T.UP,)), T.DOWN]
    return {t: f.g_input(t) for t in targets}


def base_dx_linears(setup: Setup) -> dict[Target, int]:
    """Per linear, the layers whose frozen base runs dX in backward (QLoRA dequantises its weight again
    for it: ``time.compute``)."""
    out: dict[Target, int] = {}
    for f in flows(setup):
        for t, g in input_grads(f).items():
            out[t] = out.get(t, 0) + int(g)
    return out


def layer_flops(setup: Setup, dims: Dims, f: Flow) -> tuple[int, int, int]:
    """One layer's (linear forward, linear backward, attention-core backward) FLOPs under ``f``."""
    tokens, r = dims.tokens, setup.finetune.rank
    shapes = linear_shapes(setup.model)
    inputs = input_grads(f)
    forward = backward = 0
    if setup.model.moe is not None:  # no adapters on it: dX of the router, experts and shared experts
        mlp = moe_mlp_flops(setup, dims)  # where its input needs a gradient, dW where it trains
        forward, backward = mlp, mlp * (int(f.g_mid) + int(f.trains))
        inputs = {t: g for t, g in inputs.items() if t in ATTN_TARGETS}
    for t in inputs:
        fan_in, fan_out = shapes[t]
        base = mm(tokens, fan_in, fan_out)
        forward += base
        backward += _linear(base, inputs[t], f.trains)
    # each adapter (a fused projection's one under --impl hf: one A for its linears, one B as wide as
    # their outputs) on the layer's adapted linears: A·x and B·(A·x); dB always, dA and A's dX where x
    # needs a gradient
    for ad in adapters(setup, f.adapters):
        if ad.targets[0] not in inputs:
            continue
        a, b = mm(tokens, ad.fan_in, r), mm(tokens, r, ad.fan_out)
        forward += a + b
        backward += _linear(a, inputs[ad.targets[0]], True) + _linear(b, True, True)
    per_bmm = dims.b * dims.a * mm(dims.s, dims.d, dims.s)
    if core_of(setup) is Core.FLASH:
        core = 5 * per_bmm if f.g_core else 0  # S recomputed, dP, dV, dQ, dK: all when any runs
    else:  # QKᵀ: dQ if q, dK if k needs one; P·V: dP if P (q or k), dV if v
        core = per_bmm * (int(f.g_q) + int(f.g_k) + int(f.g_qk) + int(f.g_v))
    return forward, backward, core


def flops(setup: Setup) -> Flops:
    """FLOPs of one micro-batch under fine-tuning (``analytic.flops.Flops``, the same phases)."""
    dims = Dims.of(setup)
    fl = flows(setup)
    per = [layer_flops(setup, dims, f) for f in fl]
    linear = sum(p[0] for p in per)
    attention = dims.layers * attention_core_flops(dims)
    head = lm_head_flops(dims)
    g_final = (fl[-1].g_out if fl else embedding_trains(setup)) or final_norm_trains(setup)
    flash = core_of(setup) is Core.FLASH
    kernel = sum(dims.b * dims.a * mm(dims.s, dims.d, dims.s) for f in fl if f.g_core) if flash else 0
    head_backward = _linear(head, g_final, head_trains(setup))
    if setup.loss is LossKind.FUSED:  # Liger makes dX (and dW where the head trains) in its forward
        head, head_backward = head + head_backward, 0
    return Flops(
        forward=linear + attention + head,
        backward=sum(p[1] + p[2] for p in per) + head_backward,
        recompute=recompute(setup, dims),
        kernel_recompute=kernel,
        layer_linear=linear,
        layer_attention=attention,
        lm_head=head,
        layer_linear_backward=sum(p[1] for p in per),
        lm_head_backward=head_backward,
    )
