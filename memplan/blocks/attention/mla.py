"""Multi-head latent attention (``ModelConfig.mla``; DeepSeek-V2 §2.1, arXiv:2405.04434), as transformers'
``DeepseekV2Attention`` / ``DeepseekV3Attention`` (5.x) run it: its parameters, its projections' FLOPs and
what its ops keep for backward, up to the attention core.

Shapes: a heads, r_q = ``q_lora_rank``, r_kv = ``kv_lora_rank``, d_n, d_r, d_v the per-head widths
(``config.mla``), d_q = d_n + d_r, T = b·s tokens, A the activation dtype. What the forward keeps:
- ``q_a_proj`` and ``kv_a_proj_with_mqa`` read the attention norm's output (``attn.input``, one storage);
- ``q_a_layernorm`` and ``kv_a_layernorm``: an RMSNorm each (``norm.rms_rules``: fp32 x, rstd, normalised
  x), and ``q_b_proj`` / ``kv_b_proj`` their outputs [b, s, r]; with fp32 activations ``kv_nope.to(fp32)``
  is the split view itself, so the norm keeps the whole ``kv_a_proj_with_mqa`` output [b, s, r_kv + d_r];
- RoPE on q_rot and k_rot multiplies by the per-forward tables (kept once, ``constants.constant_rules``):
  ``q_rot * cos`` keeps cos, not q_rot (cos needs no gradient);
- ``torch.cat((q_pass, q_rot))`` and ``key_states[..., :d_n].copy_(k_nope)`` (``expand_kv``) make new
  [b, a, s, d_q] q and k; v is a strided view of ``kv_b_proj``'s output [b, s, a·(d_n + d_v)];
- the core (``attention.core_of``): eager ``matmul(q, kᵀ)`` keeps q and k; ``matmul(P, v)`` keeps v's view,
  hence all of ``kv_b_proj``'s output, when b = 1, and a contiguous [b·a, s, d_v] copy when b > 1 (the
  fold to 3-D cannot view it); SDPA on CPU runs the math kernel (q and k widths differ from v's:
  ``attention.core_of``), which keeps q·√scale and kᵀ·√scale in fp32 and v upcast to fp32 (16-bit A).

Known limitations (NB): torch's CUDA SDPA picks the memory-efficient kernel for MLA (flash needs equal
widths); not modelled (``blocks.hf.deepseek.check`` refuses it). Tensor parallelism of MLA (the latents
replicated, the heads split) is not modelled (refused there too).
"""

from __future__ import annotations

from memplan.blocks import linear_params, mm
from memplan.blocks.attention.core import Core, core_of
from memplan.blocks.inventory import Block, Dims, Role, Rule, save
from memplan.blocks.norm import rms_rules
from memplan.config import DType, MLAConfig, ModelConfig, Setup

FP32 = DType.FP32
B, R = Block, Role


def mla_of(m: ModelConfig) -> MLAConfig:
    assert m.mla is not None  # NB: called for MLA models only
    return m.mla


def mla_params(m: ModelConfig) -> tuple[int, int, int, int]:
    """(q, k, v, o) as ``attention.attention_params`` splits them: q the query path (``q_a_proj`` h×r_q
    with ``attention_bias``, ``q_a_layernorm`` r_q, ``q_b_proj`` r_q×a·d_q; or ``q_proj`` h×a·d_q); k
    ``kv_a_proj_with_mqa`` h×(r_kv + d_r) (+ bias), ``kv_a_layernorm`` r_kv and the key rows of ``kv_b_proj``
    r_kv×a·d_n; v its value rows r_kv×a·d_v; o ``o_proj`` a·d_v×h (+ bias)."""
    c, h, a, bias = mla_of(m), m.hidden_size, m.num_heads, m.qkv_bias
    q_out = a * c.qk_head_dim
    if c.q_lora_rank is None:
        q = linear_params(h, q_out, False)
    else:
        q = linear_params(h, c.q_lora_rank, bias) + c.q_lora_rank + c.q_lora_rank * q_out
    k = linear_params(h, c.kv_lora_rank + c.qk_rope_head_dim, bias) + c.kv_lora_rank
    k += c.kv_lora_rank * a * c.qk_nope_head_dim
    v = c.kv_lora_rank * a * c.v_head_dim
    return q, k, v, linear_params(a * c.v_head_dim, h, m.out_bias)


def mla_projection_flops(m: ModelConfig, dims: Dims) -> int:
    """Forward FLOPs of the projections: q (``q_a_proj`` and ``q_b_proj``, or ``q_proj``),
    ``kv_a_proj_with_mqa``, ``kv_b_proj`` and ``o_proj``, 2·T·in·out each."""
    c, t, h, a = mla_of(m), dims.tokens, dims.h, dims.a
    q_out = a * c.qk_head_dim
    q = mm(t, h, q_out) if c.q_lora_rank is None else mm(t, h, c.q_lora_rank) + mm(t, c.q_lora_rank, q_out)
    kv = mm(t, h, c.kv_lora_rank + c.qk_rope_head_dim) + mm(
        t, c.kv_lora_rank, a * (c.qk_nope_head_dim + c.v_head_dim)
    )
    return q + kv + mm(t, a * c.v_head_dim, h)


def mla_projection_rules(setup: Setup, dims: Dims) -> list[Rule]:
    """What the projections, the latents' norms and the q/k assembly keep, and the q, k, v the core reads
    (module docstring)."""
    c, b, s, act = mla_of(setup.model), dims.b, dims.s, dims.act
    rules = [save(B.ATTN, "input", (b, s, dims.h), act, R.LINEAR_INPUT, "input of q_a_proj and kv_a_proj")]
    if c.q_lora_rank is not None:
        rq = c.q_lora_rank
        rules += rms_rules(setup, B.ATTN, "q_a_norm.", (b, s, rq))
        rules.append(
            save(B.ATTN, "q_b_input", (b, s, rq), act, R.LINEAR_INPUT, "input of q_b_proj: dW = Xᵀ·dY")
        )
    norm = rms_rules(setup, B.ATTN, "kv_a_norm.", (b, s, c.kv_lora_rank))
    if act is FP32:  # x.to(fp32) is the split view of kv_a_proj_with_mqa's output: pow keeps all of it
        why = "kv_a_proj_with_mqa's output: the norm's fp32 input is a view of it"
        whole = save(
            B.ATTN, "kv_a_norm.input", (b, s, c.kv_lora_rank + c.qk_rope_head_dim), FP32, R.NORM_INPUT, why
        )
        norm = [whole if r.name == "attn.kv_a_norm.input" else r for r in norm]
    rules += norm
    why = "input of kv_b_proj (the latent, or its KV-cache copy): dW = Xᵀ·dY"
    rules.append(save(B.ATTN, "kv_b_input", (b, s, c.kv_lora_rank), act, R.LINEAR_INPUT, why))
    return rules + core_input_rules(setup, dims)


def core_input_rules(setup: Setup, dims: Dims) -> list[Rule]:
    """q, k and v as the core keeps them (module docstring)."""
    c, b, s, a, act = mla_of(setup.model), dims.b, dims.s, dims.a, dims.act
    dq, dv = c.qk_head_dim, c.v_head_dim
    core = core_of(setup)
    if core is Core.FLASH:  # NB: refused for MLA (blocks.hf.deepseek.check); the kernel's inputs
        return [
            save(B.ATTN, n, (b, a, s, w), act, R.ATTN_QKV, "flash input")
            for n, w in (("q", dq), ("k", dq), ("v", dv))
        ]
    upcast = core is Core.MATH and act is not FP32
    dtype = FP32 if core is Core.MATH else act
    if upcast:
        why = "v upcast to fp32 by SDPA's math kernel, for P·V: dP = dO·Vᵀ"
        v = save(B.ATTN, "v", (b, a, s, dv), FP32, R.ATTN_QKV, why)
    elif b == 1:
        why = "kv_b_proj's output: P·V keeps v, a strided view of it (b = 1 folds without a copy)"
        v = save(B.ATTN, "kv_b_output", (b, s, a * (c.qk_nope_head_dim + dv)), act, R.ATTN_QKV, why)
    else:
        why = "v copied contiguous by matmul's fold to [b·a, s, d_v] (a strided view, b > 1), for P·V"
        v = save(B.ATTN, "v", (b, a, s, dv), act, R.ATTN_QKV, why)
    scaled = " (·√scale, fp32: SDPA's math kernel)" if core is Core.MATH else ""
    return [
        save(
            B.ATTN, "q", (b, a, s, dq), dtype, R.ATTN_QKV, f"cat(q_nope, q_rot){scaled} for QKᵀ: dK = dSᵀ·Q"
        ),
        save(B.ATTN, "k", (b, a, s, dq), dtype, R.ATTN_QKV, f"cat(k_nope, k_rot){scaled} for QKᵀ: dQ = dS·K"),
        v,
    ]


def value_save_over_gradient(setup: Setup, dims: Dims) -> int:
    """What P·V's backward frees of the eager core's v beyond the dV [b, a, s, d_v] it makes, which the
    attention's moment counts as equal: at b = 1 P·V keeps v as a strided view of ``kv_b_proj``'s whole
    output [b, s, a·(d_n + d_v)] (``core_input_rules``), its last use, so the key rows' T·a·d_n go too
    (measured at DeepSeek-V2-Lite's widths, s 512: its dense layer's softmax backward 2,097,152 B below
    the A-dtype reading). 0 for other models, other cores and b > 1 (a contiguous copy of dV's size)."""
    if setup.model.mla is None or core_of(setup) is not Core.EAGER or dims.b != 1:
        return 0
    return dims.tokens * dims.a * mla_of(setup.model).qk_nope_head_dim * dims.act.bytes
