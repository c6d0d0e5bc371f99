"""The model states' side of the peak: the optimizer step's temporaries for the largest tensor it steps,
and the weights ZeRO-3 (or parameter offload) gathers onto the device at once. Split from
``analytic.peak``, which composes them into its moments.
"""

from __future__ import annotations

from memplan.analytic.params import ParamCount
from memplan.analytic.states import shard
from memplan.blocks import fp8, te_fp8
from memplan.blocks.torchtitan import fsdp2_mixed
from memplan.config import Offload, Optimizer, PositionType, Precision, Setup, ZeroStage


def optimizer_transient(setup: Setup, largest: int) -> int:
    """Temporaries of the reference optimizer (measure/reference/optim.py) for the largest tensor it steps
    (``largest_step_tensor``: a whole parameter, or under ZeRO one rank's shard of it).

    The gradient is upcast to fp32 (4 bytes/element) by the mixed recipes and by 8-bit Adam unless it is
    fp32 already; then Adam's denominator √v̂ + ε and Lion's update (state dtype), or for 8-bit Adam the
    dequantised fp32 m and v and the fp32 denominator (12 bytes/element) — and once the denominator is
    freed, |m| in its place while the fp32 absmax scalar is made (+ 4 bytes). SGD updates in place.
    """
    precision, opt = setup.training.precision, setup.training.optimizer
    upcast = opt is Optimizer.ADAMW_8BIT or precision.master_bytes > 0
    # FSDP2's mixed precision hands the optimizer fp32 sharded gradients: no copy (``grad.float()`` is not
    # called on an fp32 gradient, measure/reference/optim.py)
    fp32_grads = precision is Precision.FP32 or fsdp2_mixed(setup)
    per_element = 4 if upcast and not fp32_grads else 0
    per_element += {
        Optimizer.ADAMW: precision.state_bytes,
        Optimizer.ADAMW_8BIT: 12,
        Optimizer.LION: precision.state_bytes,
    }.get(opt, 0)
    return largest * per_element + (4 if opt is Optimizer.ADAMW_8BIT else 0)


def weight_shapes(setup: Setup) -> list[tuple[int, int]]:
    """The model's 2-D parameter shapes as torch lays them out: an nn.Linear's weight is [out, in]
    (W_Q [a·d, h], W_K and W_V [kv·d, h], W_O [h, a·d], gate / up [f, h], down [h, f]); the embedding
    and the lm head [v, h]; learned positions [max_positions, h].
    NB: 1-D parameters (norms, biases) are left out: [n] shards to ⌈n/dp⌉ elements, never more than a
    matrix with n rows (a bias [out] beside its weight [out, in]; a norm [h] beside W_O [h, a·d])."""
    m = setup.model
    h, f = m.hidden_size, m.ffn
    shapes = [(m.vocab_size, h), (m.q_width, h), (m.kv_width, h), (h, m.q_width), (f, h), (h, f)]
    if m.position is PositionType.LEARNED:
        shapes.append((m.max_positions, h))
    return shapes


def largest_step_tensor(setup: Setup) -> int:
    """Elements of the largest tensor one rank's optimizer steps at once.

    Without ZeRO (or dp 1): the largest whole parameter. With ZeRO ≥ 1 a rank steps only its shard of
    each parameter. Modelled as PyTorch FSDP2 (``fully_shard``) shards, per parameter: each parameter is
    cut along dim 0 into dp chunks as ``torch.chunk`` cuts it, so rank 0 holds ⌈rows/dp⌉ rows (the last
    ranks fewer, or none) and steps a [⌈rows/dp⌉, cols] local tensor (FSDP2's DTensor ``Shard(0)``;
    torch.distributed.fsdp ``FSDPParam._init_sharded_param``). The largest shard is the largest of
    ⌈rows/dp⌉·cols over the parameters — not always the largest parameter's.
    NB: DeepSpeed's ZeRO instead steps one flat fp32 partition of ⌈Ψ/dp⌉ elements (states.py's padding
    follows it); with its fused Adam the temporaries are per partition, not per tensor, which this does
    not model (memplan's reference optimizer steps one tensor at a time, as FSDP2 with a per-tensor
    optimizer does).
    Under context parallelism the shards are over dp × cp, as the states' (``Setup.state_shards``;
    torchtitan's ``dp_shard_cp`` mesh).
    """
    s = setup.strategy
    shards = setup.state_shards
    sharded = s.zero >= ZeroStage.OPTIMIZER and shards > 1
    return max(shard(rows, shards, sharded) * cols for rows, cols in weight_shapes(setup))


def zero3_gather(p: ParamCount, setup: Setup) -> int:
    """Weights of the largest unit ZeRO-3 gathers at once (a layer, or the embedding / head), from the
    other ranks or, with parameter offload, from the host."""
    s = setup.strategy
    offloaded = Offload.PARAMS in setup.offload  # gathered from the host even at dp 1
    if not offloaded and (s.zero < ZeroStage.PARAMETERS or s.shard_group == 1):
        return 0
    weight = setup.training.precision.weight_bytes
    # a block's converted weights gathered in float8 under --fp8-all-gather (blocks.fp8.gathered_saving),
    # Megatron FSDP's float8 primary weights with their transposes (blocks.te_fp8.gathered_saving)
    saving = fp8.gathered_saving(setup) + te_fp8.gathered_saving(setup, setup.model)
    return max(p.layer.total * weight - saving, max(p.embedding, p.lm_head) * weight)
