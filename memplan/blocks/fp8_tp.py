"""torchao's float8 tensor-parallel plan (``--fp8-tp``): what a torchtitan block keeps when its linears'
inputs are cast before tensor parallelism moves them.

torchtitan's 2024 ``apply_tp`` laid out float8 blocks with torchao's ``PrepareFloat8ModuleInput``,
``Float8ColwiseParallel`` and ``Float8RowwiseParallel`` (torchao/float8/float8_tensor_parallel.py;
``measure.distributed.titan_fp8_tp`` runs that plan). Each casts a block's input with
``hp_tensor_to_float8_dynamic`` before the linear sees it, so the ``Float8Linear`` finds it already float8
(``tensor_already_casted_to_fp8``) and saves the float8 tensor — its data (1 byte an element) and its fp32
scale — where 0.3.0's plan saves the bf16 input and casts it again in backward (blocks/fp8.py):

- the attention's and the MLP's input: the norm's output cast on its sequence shard and all-gathered in
  float8 (the gathered data keeps the shard's scale: torchao's float8 all-gather returns a
  ``Float8TrainingTensor`` of the gathered data and the same scale), one copy W1 and W3 share;
- W_O's input, the attention output [T, a·d/t], cast on the rank (``Float8RowwiseParallel``'s input): a
  float8 copy beside the flash core's own bf16 output, which the core keeps for its backward; under
  context parallelism torch's ring keeps its merged output itself (``attn.merged_out``) and the bf16
  [T, a·d/t] was W_O's input alone: the float8 copy replaces it (traced on pipeline stages with cp 2);
- W_down's input [T, f/t] cast the same way: the float8 copy instead of the bf16 product.

Traced (``trace --impl torchtitan --fp8 tensorwise --tp 2 --sp --fp8-tp``, tests/hf/test_fp8_tp.py): the
tiny model's layer 10,224 B below 0.3.0's plan's, every save by name.
"""

from __future__ import annotations

from memplan.blocks.inventory import Role, Rule, save
from memplan.config import DType, Setup

SCALE_DTYPE = DType.FP32
"""A tensorwise scale: one fp32 (torchao's ``amax_to_scale``; ``blocks.fp8.SCALE`` bytes)."""


def applies(setup: Setup) -> bool:
    """``--fp8-tp`` (its rules, ``config.impl_rules.check_fp8_tp``, allow it with torchtitan's tensorwise
    float8, tp and sp only)."""
    return setup.impl.fp8_tp


def cast(rule: Rule, part: str, why: str) -> list[Rule]:
    """``rule``'s tensor as its float8 cast: the data (``float8_e4m3fn``, one byte an element) and its
    tensorwise fp32 scale (0-d, ``SCALE`` bytes)."""
    data = save(rule.block, part, rule.shape, DType.FP8_E4M3, rule.role, why)
    scale = save(rule.block, f"{part}_scale", (), SCALE_DTYPE, Role.PARAM_DERIVED, "its tensorwise scale")
    return [data, scale]


def layer_rules(rules: list[Rule]) -> list[Rule]:
    """A torchtitan layer's saves (``activations.layer_rules``) under the float8 plan (module docstring)."""
    out: list[Rule] = []
    ring = any(r.name == "attn.merged_out" for r in rules)  # the ring's core keeps its own output
    for r in rules:
        if r.name in ("attn.input", "mlp.input"):
            out += cast(
                r, r.name.split(".")[1], "float8 input, cast on the shard and all-gathered: dW = Xᵀ·dY"
            )
        elif r.name == "mlp.down_input":
            out += cast(r, "down_input", "float8 input of W_down, cast on the rank: dW = Xᵀ·dY")
        elif r.name == "attn.out":
            kept = [] if ring else [r]  # the flash core's output, kept for its backward
            out += [*kept, *cast(r, "out_fp8", "float8 input of W_O, cast on the rank: dW = Xᵀ·dY")]
        else:
            out.append(r)
    return out
