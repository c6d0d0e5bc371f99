"""The MLP: SwiGLU down(silu(gate(x))·up(x)) with three h×f matrices, or GELU fc2(gelu(fc1(x))) with two."""

from __future__ import annotations

from memplan.blocks import fp8, linear_params, mm, te_fp8
from memplan.blocks.inventory import Block, Dims, Role, Rule, save
from memplan.blocks.profiles import (
    dropout_keeps,
    hidden_dropouts,
    made_grad_bytes,
    profile_of,
    top_layer_grads,
)
from memplan.config import DType, MlpType, ModelConfig, Setup
from memplan.config.finetune import MLP_TARGETS, Target
from memplan.config.trainable import adapted, base_trains

B, R = Block, Role


def mlp_params(m: ModelConfig) -> int:
    h, f, b = m.hidden_size, m.ffn, m.mlp_bias
    up = linear_params(h, f, b)
    down = linear_params(f, h, b)
    return (2 * up if m.mlp is MlpType.SWIGLU else up) + down


def mlp_inner_rules(setup: Setup, block: Block, part: str, shape: tuple[int, ...], act: DType) -> list[Rule]:
    """What an MLP keeps between its first matrices and its last, each of ``shape`` ([·, f]): SwiGLU's
    gate, act, up and down input (fused SwiGLU: W_fc1's [·, 2f] output and the down input), GELU's fc1
    output and fc2 input. ``part`` prefixes the names."""

    def inner(name: str, why: str) -> Rule:
        return save(block, part + name, shape, act, R.MLP_INNER, why)

    if setup.model.mlp is MlpType.SWIGLU and profile_of(setup).fused_swiglu:
        # Megatron's SwiGLUFunction keeps W_fc1's fused [·, 2f] output (gate and up side by side) only.
        fc1 = save(
            block, part + "fc1", (*shape[:-1], 2 * shape[-1]), act, R.MLP_INNER, "fused SwiGLU's input"
        )
        return [fc1, inner("down_input", "input of W_down: dW = Xᵀ·dY")]
    if setup.model.mlp is MlpType.SWIGLU and profile_of(setup).fused_gate_up:
        fused = (*shape[:-1], 2 * shape[-1])
        return [
            save(block, part + "gate_up", fused, act, R.MLP_INNER, "fused gate|up output: act and · read it"),
            inner("act", "act(g) for the product act(g)·u: du needs it"),
            inner("down_input", "input of W_down: dW = Xᵀ·dY"),
        ]
    if setup.model.mlp is MlpType.SWIGLU and profile_of(setup).compiled_block:
        # The compiled block recomputes silu(g) from g in backward (Profile.compiled_block).
        return [
            inner("gate", "gate projection: silu(g) and silu'(g) are recomputed from it"),
            inner("up", "up projection for the product: d silu(g) needs u"),
            inner("down_input", "input of W_down: dW = Xᵀ·dY"),
        ]
    if setup.model.mlp is MlpType.SWIGLU:
        return [
            inner("gate", "gate projection: silu'(g) needs g"),
            inner("act", "silu(g) for the product silu(g)·u: du needs it"),
            inner("up", "up projection for the product: d silu(g) needs u"),
            inner("down_input", "input of W_down: dW = Xᵀ·dY"),
        ]
    gelu = [
        inner("up", "fc1 output: gelu'(x) needs x"),
        inner("down_input", "gelu output, input of fc2: dW = Xᵀ·dY"),
    ]
    if not profile_of(setup).gelu_python:
        return gelu
    # NewGELUActivation: 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·pow(x, 3)))); pow keeps x (``up``).
    return [
        gelu[0],
        inner("tanh", "tanh output: tanh' = 1 − tanh²"),
        inner("half_x", "0.5·x, an operand of the last product: d(1 + tanh) needs it"),
        inner("one_plus_tanh", "1 + tanh, the other operand: d(0.5·x) needs it"),
        gelu[1],
    ]


def mlp_rules(setup: Setup, dims: Dims) -> list[Rule]:
    """The MLP's input and inner saves; under ``shared_norm`` its input is the attention's (the one norm's
    output, ``attn.input``), kept once."""
    b, s, h, f, act = dims.b, dims.s, dims.h, dims.f, dims.act
    why = "input of the MLP's first matrices: dW = Xᵀ·dY"
    inputs = [] if setup.model.shared_norm else [save(B.MLP, "input", (b, s, h), act, R.LINEAR_INPUT, why)]
    return [*inputs, *mlp_inner_rules(setup, B.MLP, "", (b, s, f), act)]


def mlp_flops(setup: Setup, dims: Dims) -> int:
    """Forward FLOPs of the MLP's matrices: 2·T·h·f each (3 for SwiGLU, 2 for GELU)."""
    mats = 3 if setup.model.mlp is MlpType.SWIGLU else 2
    return mats * mm(dims.tokens, dims.h, dims.f)


def early_stop_skip(setup: Setup, dims: Dims) -> int:
    """The forward FLOPs a checkpointed segment ending in this MLP never re-runs: its last save is W_down's
    input, saved before W_down runs, so the early-stopping re-run skips W_down, [T, f]·[f, h]."""
    return mm(dims.tokens, dims.f, dims.h)


def frozen_mlp(setup: Setup) -> bool:
    """Fine-tuning where the top layer's MLP (the layer whose backward is the moment: it keeps the most)
    neither trains nor carries an adapter — LoRA on attention targets, peft's default q, v; QLoRA alike."""
    top = setup.model.num_layers - 1
    if setup.finetune.trains_everything or base_trains(setup, top):
        return False
    return not adapted(setup, top) & MLP_TARGETS


def mlp_backward_transient(setup: Setup, dims: Dims) -> int:
    """MLP backward at the product's gradient: dY [T, h] coming in, d(down input) and the two operand
    gradients [T, f] (SwiGLU; GELU: one fewer), and the down projection's weight gradient, already made;
    the down projection's saved input is released once its backward has run (a [T, f] fewer).
    Or earlier, whichever is larger: ``down_backward_transient``.

    A frozen MLP (``frozen_mlp``) makes no weight gradient and keeps no down input (dX = dY·W needs the
    weight only: ``strategies.lora``), so nothing is released: dY and the [T, f] buffers less the residual
    dropout's mask, the largest of its backward. Measured op by op on CPU against every live storage
    (tests/measure/test_peak.py ``test_lora_peak_is_exact``: Llama- and GPT-shaped layers, q, v and q, k,
    v, o adapters, flash and eager attention, LoRA dropout, none and full checkpointing, one and two
    micro-batches), exact.
    NB: an adapted MLP (gate, up or down targets) keeps full training's buffers, its frozen base no weight
    gradient (``profiles.top_layer_grads``); its adapters' backward adds [T, in] input-gradient pieces not
    modelled (all-linear LoRA on the Llama-shaped layer under full checkpointing: −1.7 … +0.3 %; one
    [T, h] at Llama 3 8B's widths under transformers and peft). The layer's other moments count the
    adapters' gradients alone too: they had counted a frozen base's as made, which at a wide layer and a
    short sequence put the peak there (tests/measure/test_peak.py ``WIDE``: 31 % over)."""
    a_bytes = dims.act.bytes
    t = dims.tokens
    if frozen_mlp(setup) and not (te_fp8.applies(setup) or fp8.enabled(setup)):
        # no weight gradient made, no down input saved or released; the residual dropout's backward has
        # consumed its mask first (``dropout_keeps``: on CPU transformers' nn.Dropout keeps its noise in
        # the activation dtype — measured, StarCoder2's and GPT-2's layer under LoRA half a [T, h] over
        # with a bool mask's bytes)
        mask = t * dims.h * dropout_keeps(setup, dims.act).bytes if hidden_dropouts(setup)[0] > 0 else 0
        return t * dims.h * a_bytes + gradient_buffers(setup, dims) - mask
    later = product_gradient_transient(setup, dims)
    if te_fp8.applies(setup):
        return max(later, down_backward_transient(setup, dims), te_first_backward(setup, dims))
    if fp8.enabled(setup):
        return max(later, down_backward_transient(setup, dims), fp8_first_backward(setup, dims))
    first = first_linears_transient(setup, dims)
    return max(later, down_backward_transient(setup, dims), *([first] if first is not None else []))


def first_linears_transient(setup: Setup, dims: Dims) -> int | None:
    """``mlp_backward_transient``'s last moment, at the first matrices' backward (the MLP trains, no
    adapter on it): the last of them to run makes its weight gradient, then its dX [T, h]
    (``MmBackward``: mat2's gradient first) beside the other's dX, not yet summed into the MLP input's
    gradient. Gated (SwiGLU, GeGLU), from the product's moment: W_up's and W_gate's gradients and the two
    dX made; d(down input), d(act) and d(up) consumed and d(gate) made (two [T, f] fewer), and the saves
    the product and the activation read freed (act, up, gate: three more). GELU: W_fc1's gradient and
    dX, d(down input) consumed and the fc1 output freed. None where the MLP's saves or buffers are others
    (fused kernels, ``NewGELUActivation``'s, a compiled block, adapters).
    Where the MLP is wide against the sequence its weight gradients outweigh the [T, f] buffers: Gemma 2B
    (f 8h) under transformers at s 512, this moment is the layer's top, 3,174,398 B above the moment the
    estimate had (tests/hf/test_hf_peak.py)."""
    prof = profile_of(setup)
    top = setup.model.num_layers - 1
    if prof.fused_swiglu or prof.fused_gate_up or prof.compiled_block or prof.gelu_python:
        return None
    if adapted(setup, top) & MLP_TARGETS:
        return None
    t, h, f, e = dims.tokens, dims.h, dims.f, dims.act.bytes
    weight = f * h + (f if setup.model.mlp_bias else 0)
    at_product = product_gradient_transient(setup, dims)
    if setup.model.mlp is MlpType.SWIGLU:
        up = top_layer_grads(setup, weight, {Target.UP})
        gate = top_layer_grads(setup, weight, {Target.GATE}, summed=False)  # made just now, not yet summed
        return at_product + up + gate + 2 * t * h * e - 5 * t * f * e
    fc1 = top_layer_grads(setup, weight, {Target.UP}, summed=False)
    return at_product + fc1 + t * h * e - 2 * t * f * e


def product_gradient_transient(setup: Setup, dims: Dims) -> int:
    """``mlp_backward_transient``'s moment at the product's gradient (the MLP trains): dY [T, h], the
    [T, f] gradient buffers and the down projection's gradients (unless summed into an earlier
    micro-batch's and freed), its saved input released (Transformer Engine: a float8 cast and its scale)."""
    a_bytes, t = dims.act.bytes, dims.tokens
    down = top_layer_grads(setup, dims.f * dims.h + (dims.h if setup.model.mlp_bias else 0), {Target.DOWN})
    released = t * dims.f * a_bytes
    if te_fp8.applies(setup):
        released = te_fp8.saved_cast_bytes(setup, t, dims.f)
    mask = python_gelu_mask(setup, dims)
    return t * dims.h * a_bytes + gradient_buffers(setup, dims) + down - released - mask


def gradient_buffers(setup: Setup, dims: Dims) -> int:
    """The MLP backward's [T, f] buffers at the product's gradient: d(down input) and the product's two
    operand gradients (SwiGLU; GELU: one fewer; transformers' ``NewGELUActivation``, ``gelu_python``: its
    last product ``(0.5·x) · (1 + tanh(·))``, both operands [T, f] saves, makes two gradients beside
    d(down input), as SwiGLU's. Measured, GPT-2 at s 128, h 64, f 256: the two ``mul`` of that product's
    backward rise the layer to its top, d(down input) alive)."""
    two = setup.model.mlp is MlpType.SWIGLU or profile_of(setup).gelu_python
    return (3 if two else 2) * dims.tokens * dims.f * dims.act.bytes


def python_gelu_mask(setup: Setup, dims: Dims) -> int:
    """The residual dropout's mask after W_down (on CPU under ``cpu_dropout_noise`` its noise in the
    activation dtype, ``dropout_keeps``), freed by the dropout's backward before the MLP's product's
    gradient: counted released there for ``gelu_python`` (GPT-2's ``NewGELUActivation``), where that
    moment is the MLP's top (measured: ``empty_like`` [b, s, h] freed before W_down's backward).
    NB: the other MLPs' product-gradient moment still counts it (not re-measured here; plain GELU's
    top with dropout is W_down's backward, ``down_backward_transient``)."""
    if not profile_of(setup).gelu_python or hidden_dropouts(setup)[0] == 0:
        return 0
    return dims.tokens * dims.h * dropout_keeps(setup, dims.act).bytes


def te_first_backward(setup: Setup, dims: Dims) -> int:
    """Transformer Engine's float8 (blocks/te_fp8.py): W_fc1's backward, after the fused activation's. Alive:
    dY [T, h] and W_down's gradients; d(fc1) [T, w] (w = 2f SwiGLU, f GeLU) with its float8 rowwise and
    columnwise casts (``grad_output_casts``), the dgrad output [T, h] and W_fc1's gradient [h, w]; released:
    W_fc2's float8 input (T·f and its scale_inv), the activation's saved input [T, w] and the residual
    dropout's mask."""
    e, g, t, f, h = dims.act.bytes, setup.training.precision.grad_bytes, dims.tokens, dims.f, dims.h
    w = 2 * f if setup.model.mlp is MlpType.SWIGLU else f
    bias = setup.model.mlp_bias
    down = (f * h + (h if bias else 0)) * g
    first = (w * h + (w if bias else 0)) * g
    mask = t * h * DType.BOOL.bytes if hidden_dropouts(setup)[0] > 0 else 0
    alive = t * h * e + down + t * w * e + te_fp8.grad_output_casts(setup, t, w) + t * h * e + first
    return alive - te_fp8.saved_cast_bytes(setup, t, f) - t * w * e - mask


def fp8_first_backward(setup: Setup, dims: Dims) -> int:
    """``--fp8``: the first matrices' backward casts (``fp8.backward_transient`` of [T, h] → [T, f]), after
    the product's backward (autograd runs W_up's, created after silu, before silu's and W_gate's). Alive:
    dY [T, h] and W_down's gradients. SwiGLU at W_up's: d(act), d(up) [T, f]; the down input, act and up
    saves released (and the residual dropout's mask). At W_gate's: W_up's dX [T, h] and gradients, d(gate)
    [T, f]; silu's saved gate released too. GELU at W_fc1's: d(fc1) [T, f]; the down input and fc1's output
    released."""
    # the gradients made by then, unless summed into an earlier micro-batch's and freed
    e, g, t, f, h = dims.act.bytes, made_grad_bytes(setup), dims.tokens, dims.f, dims.h
    bias = setup.model.mlp_bias
    tf, dy = t * f * e, t * h * e
    down = (f * h + (h if bias else 0)) * g
    first_bias = (f if bias else 0) * g  # W_up's (W_gate's) bias gradient, made before its matmul's
    mask = t * h * DType.BOOL.bytes if hidden_dropouts(setup)[0] > 0 else 0
    cast = fp8.backward_transient(setup, t, h, f)
    base = dy + down - mask + cast
    if setup.model.mlp is not MlpType.SWIGLU:
        return base + tf + first_bias - 2 * tf
    up = base + 2 * tf + first_bias - 3 * tf
    gate = base + dy + tf + f * h * g + 2 * first_bias - 4 * tf
    return max(up, gate)


def down_backward_transient(setup: Setup, dims: Dims) -> int:
    """The down projection's own backward, its saved input still alive: dY [T, h], with residual dropout
    also the dropout's input gradient [T, h] (its bool mask freed), then d(down input) [T, f], the weight
    gradient and the bias gradient. A checkpoint's re-run input is released right after its last use, the
    weight gradient's matmul, before the bias gradient is made: the peak is at that matmul then."""
    a_bytes, t, h = dims.act.bytes, dims.tokens, dims.h
    dropout = 0
    if hidden_dropouts(setup)[0] > 0:
        mask = t * h * DType.BOOL.bytes  # the bool mask of the dropout after W_down
        dropout = t * h * a_bytes - mask
    if fp8.enabled(setup):
        # torchao's casts, dX and dW among their steps (blocks/fp8.py); Float8Linear adds its bias outside
        # the matmul, so the bias gradient is made first, checkpointed or not.
        bias_grad = (h if setup.model.mlp_bias else 0) * made_grad_bytes(setup)
        return t * h * a_bytes + dropout + bias_grad + fp8.down_backward(setup, dims)
    bias = h if setup.model.mlp_bias and not setup.strategy.segment else 0
    grads = top_layer_grads(setup, dims.f * h + bias, {Target.DOWN}, summed=False)
    # Transformer Engine's float8: dY's rowwise and columnwise casts beside it (blocks/te_fp8.py)
    casts = te_fp8.grad_output_casts(setup, t, h) if te_fp8.applies(setup) else 0
    return t * h * a_bytes + dropout + casts + t * dims.f * a_bytes + grads
