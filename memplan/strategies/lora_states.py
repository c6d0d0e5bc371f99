"""Fine-tuning's parameters and model states: what trains (peft's trainable count), the frozen base in its
dtype (QLoRA: bitsandbytes' 4-bit storage) and the gradients, master weights and optimizer states of the
trainable parameters only, ZeRO-sharded as in ``strategies.zero``.

bitsandbytes ``Linear4bit`` (``Params4bit``, blocksize 64; inspected on CPU, tests/measure/test_finetune.py)
stores a weight of n elements as a packed uint8 tensor of n/2 bytes (two 4-bit codes a byte) and a
``QuantState``: the fp32 absmax of each 64-weight block (4·n/64 bytes) and the 16-entry fp32 code book
(64 bytes). Double quantisation (``bnb_4bit_use_double_quant``) stores the absmax as uint8 (n/64 bytes)
with a fp32 offset (4 bytes) and a second ``QuantState``: a fp32 absmax per 256 first-level values and its
256-entry fp32 code book (1024 bytes). Everything but the layers' linear weights (embeddings, norms, biases,
the lm head) stays in the compute dtype. Dettmers et al. 2023 §3: 4 + 32/64 = 4.5 bits per weight, 4.127
with double quantisation (the constants are 8/64 + 32/(64·256) bits).

Known limitations (NB): the peak's layer-backward moment (``analytic.peak``) keeps full training's
backward buffers (a layer's weight gradients), so under fine-tuning that moment is an upper bound (the
activations, states and FLOPs are exact; the optimizer step steps the trainable tensors only,
``analytic.optimizer_step.trainable_shapes``, measured in tests/measure/test_finetune.py); QLoRA adds the
dequantised weight to every moment but the optimizer step. The LoRA adapters are counted in the weight
dtype with a master copy under mixed precision, as memplan's reference model runs them; under ``--impl hf``
with 16-bit activations in fp32 (weights, gradients, optimizer states; no master copy), peft's default
``autocast_adapter_dtype=True`` (``config.trainable.fp32_adapters``). The optimizer step's transient
(``analytic.optimizer_step``) still takes the activation dtype's element size for the adapters.
"""

from __future__ import annotations

from memplan.analytic.params import ParamCount
from memplan.analytic.states import ModelStates, shard
from memplan.config import Precision, Setup, ZeroStage
from memplan.config.finetune import QUANT_BLOCK, QUANT_BLOCK2, Method
from memplan.config.trainable import adapter_params, base_linears, fp32_adapters
from memplan.strategies.zero import model_states

FP32_BYTES = 4
CODE_4BIT = 16 * FP32_BYTES
"""The 16 fp32 levels of NF4 / FP4 (``QuantState.code``)."""
CODE_8BIT = 256 * FP32_BYTES
"""The 256 fp32 levels of the dynamic 8-bit map that double quantisation's absmax uses."""


def quantized_bytes(n: int, double_quant: bool) -> int:
    """Bytes of one ``Linear4bit`` weight of ``n`` elements: packed codes, absmax, code books (above)."""
    blocks = -(-n // QUANT_BLOCK)
    packed = -(-n // 2)
    if not double_quant:
        return packed + FP32_BYTES * blocks + CODE_4BIT
    blocks2 = -(-blocks // QUANT_BLOCK2)
    return packed + blocks + FP32_BYTES + FP32_BYTES * blocks2 + CODE_8BIT + CODE_4BIT


def adapted_layers(setup: Setup) -> int:
    ft, n = setup.finetune, setup.model.num_layers
    return sum(1 for i in range(n) if not ft.layer_frozen(i)) if ft.lora else 0


def trainable_params(setup: Setup, params: ParamCount) -> int:
    """Parameters that train: peft's ``get_nb_trainable_parameters`` under LoRA; under full fine-tuning all
    but the frozen embedding (and tied head), lm head and layers."""
    ft = setup.finetune
    if ft.lora:
        return adapter_params(setup) * adapted_layers(setup)
    if ft.method is not Method.FULL:
        raise AssertionError(ft.method)
    frozen = 0
    tied = setup.model.tied_embeddings
    if ft.freeze_embeddings or (tied and ft.freeze_lm_head):
        frozen += params.embedding + params.positions
    if ft.freeze_lm_head and not tied:
        frozen += params.lm_head
    if ft.freeze_layers is not None:
        frozen += params.layer.total * (ft.freeze_layers[1] - ft.freeze_layers[0] + 1)
    return params.total - frozen


def base_weight_bytes(setup: Setup, params: ParamCount) -> int:
    """The base model's weights (adapters excluded): the weight dtype, QLoRA's linears in 4-bit storage."""
    w = setup.training.precision.weight_bytes
    if setup.finetune.method is not Method.QLORA:
        return params.total * w
    shapes = base_linears(setup)  # bitsandbytes quantises each module, a fused projection as one
    linear_elements = sum(i * o for i, o in shapes)
    quant = sum(quantized_bytes(i * o, setup.finetune.double_quant) for i, o in shapes)
    layers = setup.model.num_layers
    return (params.total - layers * linear_elements) * w + layers * quant


def finetune_states(setup: Setup, params: ParamCount) -> ModelStates:
    """Per-device model states: the frozen base (sharded by ZeRO-3 too) plus the trainable parameters'
    weights, gradients, master weights and optimizer states (``strategies.zero.model_states``)."""
    t, s = setup.training, setup.strategy
    trainable = trainable_params(setup, params)
    # peft's fp32 adapters under --impl hf (config.trainable.fp32_adapters): fp32 weights, gradients and
    # optimizer states, no master copy — the fp32 recipe's, whatever the base's precision.
    recipe = Precision.FP32 if fp32_adapters(setup) else t.precision
    states = model_states(trainable, recipe, t.optimizer, s.zero, s.shard_group)
    # The base excludes the adapters; under full fine-tuning it includes the trainable weights (in states).
    in_base = 0 if setup.finetune.lora else trainable * t.precision.weight_bytes
    frozen_bytes = base_weight_bytes(setup, params) - in_base
    frozen = shard(frozen_bytes, s.shard_group, s.zero >= ZeroStage.PARAMETERS)
    return states.model_copy(update={"weights": states.weights + frozen})


def dequant_transient(setup: Setup) -> int:
    """QLoRA's per-layer transient: bitsandbytes dequantises one 4-bit weight to the compute dtype for its
    matmul (forward, and again for dX in backward) and frees it after; the largest linear's. 0 otherwise."""
    if setup.finetune.method is not Method.QLORA:
        return 0
    largest = max(i * o for i, o in base_linears(setup))
    return largest * setup.finetune.compute_dtype.bytes


def with_dequant(moments: dict[str, dict[str, int]], setup: Setup) -> dict[str, dict[str, int]]:
    """The peak's moments with QLoRA's ``dequant_transient`` in each but the optimizer step."""
    extra = dequant_transient(setup)
    if not extra:
        return moments
    return {
        name: m if name == "optimizer step" else {**m, "transient": m["transient"] + extra}
        for name, m in moments.items()
    }


def frozen_params(setup: Setup, params: ParamCount) -> int:
    """Parameters that do not train: the base (and frozen parts); with the adapters, peft's "all params"."""
    trainable = trainable_params(setup, params)
    return params.total + (trainable if setup.finetune.lora else 0) - trainable
