"""Float8 training of the layers' linears (``--fp8 tensorwise|rowwise``, torchao's ``Float8Linear`` as
torchtitan converts them: every linear of the layers, not the lm head; Megatron's Transformer Engine
linears under ``--impl megatron``).

torchao quantizes the three products of a linear Y = X·Wᵀ ("Quantized Training", docs.pytorch.org/ao):
``Y = to_fp8(X) @ to_fp8(Wᵀ)``, ``dX = to_fp8(dY) @ to_fp8(W)``, ``dW = to_fp8(Xᵀ) @ to_fp8(dY)``: the
GEMMs run at the GPU's FP8 peak (``peak_tflops.fp8``, ``MATMUL_FP8`` × their wave and roofline efficiency with
1-byte operands), and each of the six ``to_fp8`` is a dynamic-scaling cast, memory-bound:
- tensorwise: an amax reduction over the tensor (reads e bytes an element), then the scaled cast (reads e,
  writes 1): 2e + 1 per element;
- rowwise: a row's amax and its cast in one pass (reads e, writes 1): e + 1.
X is [T, in], W [in, out], dY [T, out] per linear (e the activation bytes).

Under torchao's float8 tensor-parallel plan (``--fp8-tp``) the layers' inputs are cast once on their
sequence shard and each output gradient once, before the collectives (``float8_plan_casts``); its
per-cast amax all-reduce over the tp group (a scalar) is not charged.

Under ``--impl megatron`` the casts are Transformer Engine's (``te_cast_bytes``): each writes the rowwise
and columnwise float8 copies at once, the norm computes the amax of W_QKV's and W_fc1's input (current
scaling) or writes the float8 copy itself (delayed scaling), the weights are cast once a step and X is not
cast again in backward. Delayed scaling adds, per forward and per backward of a model chunk, the amax
buffer's copy and the history update (``te_amax_bytes``) and the buffer's all-reduce
(``time.comm.collectives``'s ``fp8_rows``).

Known limitations (NB): a mixture of experts' router GEMM (Megatron's own linear, 16-bit) is timed with the
layer's GEMMs at the float8 rate (Qwen3 30B-A3B: [T, 2,048]·[2,048, 128], 0.5 % of the layer's linear FLOPs);
TE's grouped GEMM is taken as fast as one GEMM of its shape per expert. Rowwise's CUTLASS GEMM is taken as
fast as cuBLAS's tensorwise one (torchao calls tensorwise the fastest recipe; no figure in view); casts fused
into a neighbouring op by torch.compile, under ``--fp8-all-gather`` the once-a-step amax pass over the fp32
shards (``precompute_float8_dynamic_scale_for_fsdp``), and current scaling's per-tensor amax all-reduces (TE's
``with_amax_reduction`` under sequence parallelism) are not modelled (nor TE's float8 all-gather of the
sequence-parallel input: the tp collectives keep 16-bit sizes); the launch gaps of delayed scaling's two
kernels a reduction (µs each) are not charged. The memory: blocks/fp8.py (the saved activations are bf16's;
the casts' temporaries join the peak), blocks/te_fp8.py.
"""

from __future__ import annotations

from memplan.blocks import fp8 as blocks_fp8
from memplan.blocks import mxfp8, te_fp8
from memplan.config import Fp8Recipe, Impl, Setup
from memplan.presets import GpuPreset
from memplan.time import gemm


def enabled(setup: Setup) -> bool:
    return setup.impl.fp8 is not Fp8Recipe.NONE


def peak(setup: Setup, gpu: GpuPreset) -> float:
    """FP8 dense peak FLOP/s (MXFP8's GEMMs too: the B200 datasheet gives one FP8 figure); a one-line
    ``ValueError`` where the GPU has none, or for ``--fp8 mxfp8`` on a GPU before Blackwell (TE's
    ``_compute_mxfp8_support``: compute capability 10.x; 12.0+ "not supported ... yet")."""
    if gpu.peak_tflops.fp8 is None:
        raise ValueError(
            f"fp8: {gpu.name} has no FP8 tensor cores; drop --fp8 or choose an FP8 GPU (H100, ...)"
        )
    if setup.impl.fp8 is Fp8Recipe.MXFP8 and not blackwell(gpu):
        cc = gpu.compute_capability or "unknown"
        raise ValueError(
            f"fp8: --fp8 mxfp8 needs a Blackwell GPU (Transformer Engine: compute capability 10.x); "
            f"{gpu.name} has {cc}; use --fp8 tensorwise or delayed, or --gpu b200"
        )
    return gpu.peak_tflops.fp8 * 1e12


def blackwell(gpu: GpuPreset) -> bool:
    """Compute capability 10.x: TE's MXFP8 support (``_compute_mxfp8_support``)."""
    return gpu.compute_capability is not None and gpu.compute_capability.split(".")[0] == "10"


def per_element(setup: Setup) -> int:
    """Bytes one cast moves per element (module docstring)."""
    e = setup.training.precision.activation_dtype.bytes
    return 2 * e + 1 if setup.impl.fp8 is Fp8Recipe.TENSORWISE else e + 1


def cast_bytes(setup: Setup) -> tuple[int, int]:
    """One layer's casts on one rank, (forward: X and Wᵀ; backward: dY twice, W and Xᵀ); 0 without fp8.
    Under ``--impl megatron``: Transformer Engine's (``te_cast_bytes``)."""
    if not enabled(setup):
        return 0, 0
    if setup.impl.impl is Impl.MEGATRON:
        return te_cast_bytes(setup)
    forward = backward = weights = 0
    for g in gemm.layer_gemms(setup):
        x, w, dy = g.count * g.rows * g.inner, g.count * g.inner * g.cols, g.count * g.rows * g.cols
        forward += x + w
        backward += 2 * dy + w + x
        weights += w
    per = per_element(setup)
    if setup.impl.fp8_tp:
        forward, backward = float8_plan_casts(setup, weights)
    if blocks_fp8.all_gather(setup):
        # --fp8-all-gather: no weight cast in the linear; FSDP2's pre-all-gather casts the rank's fp32 shard
        # with the precomputed scale (``hp_tensor_and_scale_to_float8``: reads 4 B, writes 1 B an element),
        # before the forward's gather and the backward's (ZeRO-3 reshards the block after forward)
        shard = -(-weights // setup.strategy.shard_group)
        return (forward - weights) * per + 5 * shard, (backward - weights) * per + 5 * shard
    return forward * per, backward * per


def float8_plan_casts(setup: Setup, weights: int) -> tuple[int, int]:
    """Elements one layer casts on one rank under torchao's float8 tensor-parallel plan (``--fp8-tp``,
    blocks/fp8_tp.py; traced: measure/distributed/titan_fp8_tp.py), (forward, backward), ``weights`` the
    rank's weight elements (each cast once in forward and once in backward, as without the plan):
    - forward: the attention's and the MLP's inputs once each on their sequence shard [T/t, h] (W1 and W3
      share the gathered cast), W_O's input [T, a·d/t] and W_down's [T, f/t] on the rank;
    - backward: each output gradient once (``NoopFwToFloat8BwDynamic``; the linear finds it float8 for dX
      and dW): W_QKV's [T, (a + 2·kv)·d/t], W1's and W3's [T, f/t] on the rank, W_O's and W_down's on
      their sequence shard [T/t, h]; the saved inputs are float8 already (no Xᵀ cast)."""
    m, t = setup.model, setup.parallel.tp
    tokens = setup.training.micro_batch * setup.training.seq_len // setup.parallel.cp
    shard = tokens // t * m.hidden_size
    q, qkv, f = m.num_heads * m.dim // t, (m.num_heads + 2 * m.kv_heads) * m.dim // t, m.ffn // t
    forward = weights + 2 * shard + tokens * (q + f)
    backward = weights + tokens * (qkv + 2 * f) + 2 * shard
    return forward, backward


def te_cast_bytes(setup: Setup) -> tuple[int, int]:
    """One layer's Transformer Engine casts on one rank (blocks/te_fp8.py), e the activation bytes. Each
    cast writes the rowwise and the columnwise (transposed) float8 copies at once: 2 bytes written per
    element. Float8CurrentScaling (``Float8CurrentScalingQuantizer``: ``tex.quantize`` after
    ``nvte_compute_amax``): its amax is a pass of its own (e read) except where a kernel before it computes
    it:
    - X of W_QKV and W_fc1 (``LayerNormLinear``): TE's norm forward for a current-scaling quantizer is
      ``FUSED_NORM_AMAX_FP8`` (csrc/extensions/normalization.cpp: "Compute norm and amax in high precision,
      then quantize to FP8"), so the cast reads the norm's 16-bit output and writes 2: e + 2 per element,
      on the rank's s/t shard with sequence parallelism (the float8 rowwise copy is what is all-gathered);
    - X of W_O and W_fc2 (``Linear``), and of a mixture of experts' ``GroupedLinear`` fc1 and fc2 (the
      dispatched tokens, the weighted activation; ``te_gemms``): amax, then the cast: 2e + 2;
    - W: 2e + 2 per element on a step's first micro-batch only (the cached workspace,
      ``is_first_microbatch``), spread over the step's ``grad_accum`` micro-batches (rounded down);
    - backward: dY once (``grad_output_preprocess``), 2e + 2 — X and W are not cast again (their
      columnwise copies are saved).
    DelayedScaling (``Float8Quantizer``): the scale is known before the cast, which records the amax in
    the same pass — "reduces tensor reads per quantization from two to one" (TE's docs,
    fp8_delayed_scaling.rst) — so X of W_O and W_fc2, W and dY cost e + 2; X of W_QKV and W_fc1: the norm
    kernel writes the float8 rowwise copy itself (normalization.cpp: ``IsFloat8Quantizers`` →
    ``Impl::FULLY_FUSED``; its 1 byte an element replaces the e-byte output ``time.compute`` charges the
    norm), then ``nvte_transpose`` reads it and writes the columnwise copy (rmsnorm_api.cpp / ln_api.cpp,
    "Compute FP8 transpose if required"): 1 + 2 − e per element. Where the GPU's float8 GEMMs take any
    layout (``te_fp8.copies``: Blackwell) no columnwise copy is written: each cast writes 1 byte an element,
    not 2, and the norm's float8 output needs no ``nvte_transpose`` (1 − e). Plus the amax reduction's
    kernels (``te_amax_bytes``). MXFP8BlockScaling (``mx_cast_bytes``): every cast reads e and writes both
    copies and both scale grids in one kernel (the block amaxes are its own); the norm runs unfused
    (normalization.cpp: ``IsMXFP8Quantizers`` → ``FULLY_FUSED`` only with ``NVTE_NORM_FWD_USE_CUDNN``), so
    its inputs cost the same.
    NB: the GEMMs' float8 outputs are not used (``output_quantizer`` off), the activation function and the
    attention core run in 16-bit; under sequence parallelism the columnwise copy of the norms' output is
    charged on the rank's shard in the forward (TE makes it from the rowwise copy re-gathered in backward)."""
    if setup.impl.fp8 is Fp8Recipe.MXFP8:
        return mx_cast_bytes(setup)
    e = setup.training.precision.activation_dtype.bytes
    shard = setup.parallel.tp if setup.parallel.sp else 1
    per_step = setup.training.grad_accum
    delayed = setup.impl.fp8 is Fp8Recipe.DELAYED
    c = te_fp8.copies(setup.impl)  # float8 copies written: 1 where the GPU takes any layout (no transpose)
    cast = e + c if delayed else 2 * e + c  # an unfused cast: (amax pass e) + read e + write the copies
    norm_cast = 1 + 2 * (c - 1) - e if delayed else e + c  # after the norm (docstring)
    forward = backward = 0
    for g, after_norm in te_gemms(setup):
        x, w, dy = g.count * g.rows * g.inner, g.count * g.inner * g.cols, g.count * g.rows * g.cols
        forward += x // shard * norm_cast if after_norm else x * cast
        forward += w * cast // per_step
        backward += dy * cast
    amax_f, amax_b = te_amax_bytes(setup)
    return forward + amax_f, backward + amax_b


def mx_cast_bytes(setup: Setup) -> tuple[int, int]:
    """One layer's MXFP8 casts on one rank (``te_cast_bytes``): per tensor [r, c], e·r·c read and
    ``mxfp8.both_bytes(r, c)`` written — X [T, in] (the norms' outputs on the rank's s/t shard under
    sequence parallelism), W [out, in] once a step (÷ grad_accum, rounded down), dY [T, out]."""
    e = setup.training.precision.activation_dtype.bytes
    shard = setup.parallel.tp if setup.parallel.sp else 1
    per_step = setup.training.grad_accum

    def cast(rows: int, cols: int) -> int:
        return e * rows * cols + mxfp8.both_bytes(rows, cols)

    forward = backward = 0
    for g, after_norm in te_gemms(setup):  # an expert's GEMM: each of its ``count`` casts with its grids
        forward += g.count * cast(g.rows // shard if after_norm else g.rows, g.inner)
        forward += g.count * cast(g.cols, g.inner) // per_step
        backward += g.count * cast(g.rows, g.cols)
    return forward, backward


def te_gemms(setup: Setup) -> list[tuple[gemm.Gemm, bool]]:
    """One layer's Transformer Engine GEMMs on a rank (``gemm.layer_gemms``) and whether a TE norm makes
    their input (``LayerNormLinear``): W_QKV yes, W_O no; a dense layer's W_fc1 yes, W_fc2 no; a mixture
    of experts' ``GroupedLinear`` fc1 and fc2 (``count`` local experts, each on its S·ep/E rows) no: the
    pre-MLP norm is a ``TENorm`` of its own whose 16-bit output the router reads and the dispatcher moves,
    and the router's GEMM is Megatron's own (not cast; ``config.impl_rules.check_fp8``: no shared
    experts)."""
    g = gemm.layer_gemms(setup)
    if setup.model.moe is None:
        qkv, out, fc1, fc2 = g
        return [(qkv, True), (out, False), (fc1, True), (fc2, False)]
    qkv, out, _router, fc1, fc2 = g
    return [(qkv, True), (out, False), (fc1, False), (fc2, False)]


def te_amax_bytes(setup: Setup) -> tuple[int, int]:
    """One layer's share of delayed scaling's amax reduction, (forward, backward): the buffer's copy and
    the history roll and scale update (``te_fp8.amax_update_bytes``); 0 under current scaling."""
    if setup.impl.fp8 is not Fp8Recipe.DELAYED:
        return 0, 0
    rows = setup.impl.fp8_amax_history_len
    return te_fp8.amax_update_bytes(True, rows), te_fp8.amax_update_bytes(False, rows)
