"""The reference transformer: built from the same Setup as the estimate, implementing every strategy.

It is written op by op so that each tensor autograd saves is a named tensor (``label``) the inventory of
memplan/analytic/activations.py describes: RMSNorm as Llama's reference code (fp32 upcast), LayerNorm as
``native_layer_norm``, attention eager (explicit matmul, causal ``masked_fill``, softmax, dropout) or flash
(the SDPA flash kernel called directly, so its logsumexp can be named), SwiGLU or GELU MLPs, residual
dropout through ``native_dropout`` (a bool mask on every device), and the loss in the variant the setup
names (memplan/measure/reference/loss.py: standard, torchtune's chunked, Liger's fused), its saves named too.

With an ``MoEConfig`` every MLP is a mixture-of-experts block (router, top-k, sort-based dispatch, E experts,
shared experts and gate; memplan/measure/reference/moe.py, which also holds the dense MLP).

Strategies: ``torch.utils.checkpoint`` (non-reentrant) around segments of k layers (full = k 1) or around
the attention core (selective); reversible layers as RevNet coupling in an ``autograd.Function`` that keeps
only the stack's last outputs and rebuilds every layer's input in backward.

Devices: ``cpu`` runs the CPU kernels (real or fake tensors); ``cuda`` the CUDA ones; ``meta`` the CUDA code
path with the meta device's kernels, which return what the CUDA kernels return (``CUDA_KERNELS``), so CI
checks the CUDA-only saves (the flash RNG state, fp32 LayerNorm statistics, dropout masks) without a GPU.

Known limitations: the CPU flash kernel has no dropout (flash with attention dropout needs CUDA or meta).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from memplan.config import (
    Attention,
    Checkpointing,
    ModelConfig,
    NormType,
    PositionType,
    Precision,
    Setup,
)
from memplan.measure.instruments.record import label, layer_scope, note_kept
from memplan.measure.reference.fp8 import check_convertible, convert_layers
from memplan.measure.reference.lora import apply_finetune
from memplan.measure.reference.loss import head_loss
from memplan.measure.reference.moe import Mlp, MoEMlp, check_moe, dense_mlp
from memplan.measure.reference.reversible import reversible_stack

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def torch_dtype(precision: Precision) -> torch.dtype:
    """The dtype the model's weights and activations live in under a precision recipe."""
    return TORCH_DTYPES[precision.activation_dtype.value]


# ----------------------------------------------------------------------------------------------------
# Ops with named saves
# ----------------------------------------------------------------------------------------------------
def dropout(x: Tensor, p: float, mask_name: str) -> Tensor:
    """``native_dropout``: a bool mask on CPU and CUDA alike (F.dropout's CPU path saves A-dtype noise)."""
    if p == 0:
        return x
    out, mask = torch.native_dropout(x, p, True)
    label(mask, mask_name)
    return out


def rms_norm(x: Tensor, weight: Tensor, eps: float, prefix: str) -> Tensor:
    """Llama's RMSNorm: fp32 statistics, cast back before the weight."""
    x32 = label(x.float(), f"{prefix}.input")
    rstd = label(torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps), f"{prefix}.rstd")
    normed = label((x32 * rstd).to(x.dtype), f"{prefix}.normed")
    return weight * normed


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float, prefix: str) -> Tensor:
    label(x, f"{prefix}.input")
    out, mean, rstd = torch.native_layer_norm(x, (x.shape[-1],), weight, bias, eps)
    label(mean, f"{prefix}.mean")
    label(rstd, f"{prefix}.rstd")
    return out


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x·cos + rotate_half(x)·sin; the muls save cos and sin (x needs no saving: cos does not need grad)."""
    return x * cos + rotate_half(x) * sin


def rope_tables(positions: Tensor, d: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and sin [s, d] at ``positions`` (0…s−1, or one context-parallel rank's tokens)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, device=positions.device, dtype=torch.float32) / d))
    freqs = torch.outer(positions.to(torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return label(emb.cos().to(dtype), "rope.cos"), label(emb.sin().to(dtype), "rope.sin")


def repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    """[b, kv, s, d] → [b, kv·n_rep, s, d] (a copy when n_rep > 1), as Llama's eager attention does."""
    if n_rep == 1:
        return x
    b, kv, s, d = x.shape
    return x[:, :, None].expand(b, kv, n_rep, s, d).reshape(b, kv * n_rep, s, d)


# ----------------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------------
def check_runnable(setup: Setup, device: torch.device | str) -> None:
    """Raise ValueError (field and fix) for a setup the reference model cannot run on this device."""
    check_convertible(setup)
    flash = setup.strategy.attention is Attention.FLASH
    if torch.device(device).type not in CUDA_KERNELS and flash and setup.model.attn_dropout > 0:
        # NB: an error, not a silent switch to eager attention: eager keeps the s×s probabilities, so the
        # run would trace (and check) other tensors than the flash estimate the user asked about.
        raise ValueError(
            f"dropout: {setup.model.name}'s attention dropout (attn_dropout {setup.model.attn_dropout:g}) "
            "cannot run in the CPU flash kernel, which has no dropout; add --attention eager or --dropout 0, "
            "or --device cuda (CUDA's kernels)"
        )


CUDA_KERNELS = ("cuda", "meta")
"""Devices whose kernels give CUDA's outputs: a GPU, and the meta device, whose shape functions mirror the
CUDA kernels' outputs (the flash kernel's [2] uint64 RNG state and [] uint64 offset, ``native_layer_norm``'s
fp32 statistics) while allocating nothing: ``trace --device cuda`` runs there, on CPU."""


def make_norm(m: ModelConfig, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """The norm module holding the weights (and bias); the forward is ``rms_norm`` / ``layer_norm``."""
    if m.norm is NormType.LAYERNORM:
        return nn.LayerNorm(m.hidden_size, eps=m.norm_eps, dtype=dtype, device=device)
    return nn.RMSNorm(m.hidden_size, eps=m.norm_eps, dtype=dtype, device=device)


class Layer(nn.Module):
    def __init__(self, setup: Setup, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        m = setup.model
        h, qd, kvd = m.hidden_size, m.q_width, m.kv_width

        def linear(fan_in: int, fan_out: int, bias: bool) -> nn.Linear:
            return nn.Linear(fan_in, fan_out, bias=bias, dtype=dtype, device=device)

        self.attn_norm, self.mlp_norm = make_norm(m, dtype, device), make_norm(m, dtype, device)
        self.q, self.k, self.v = (
            linear(h, qd, m.qkv_bias),
            linear(h, kvd, m.qkv_bias),
            linear(h, kvd, m.qkv_bias),
        )
        self.o = linear(qd, h, m.out_bias)
        if m.qk_norm:  # Qwen3's q_norm / k_norm: RMSNorm over head_dim
            self.q_norm = nn.RMSNorm(m.dim, eps=m.norm_eps, dtype=dtype, device=device)
            self.k_norm = nn.RMSNorm(m.dim, eps=m.norm_eps, dtype=dtype, device=device)
        # The MLP: a dense one of width ffn_size, or an MoE block (router, experts of width ffn_size).
        self.mlp: nn.Module = MoEMlp(m, m.moe, dtype, device) if m.moe else Mlp(m, m.ffn, dtype, device)

    def forward(self, body: Callable[..., Tensor], *args: Any) -> Tensor:
        """Run ``body(*args)`` (``Reference.layer_body``) as this module's call, so that module hooks fire
        per layer (FSDP2's all-gather and reshard, memplan/measure/distributed/nproc.py)."""
        return body(*args)


class Consts:
    """Per-forward tensors every layer reads: RoPE tables and the causal mask (each one storage)."""

    def __init__(self, cos: Tensor | None, sin: Tensor | None, mask: Tensor | None) -> None:
        self.cos, self.sin, self.mask = cos, sin, mask

    def tensors(self) -> list[Tensor]:
        return [t for t in (self.cos, self.sin, self.mask) if t is not None]


class Reference(nn.Module):
    """A decoder-only transformer that runs the Setup's strategy for real (or under FakeTensorMode)."""

    def __init__(self, setup: Setup, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.setup = setup
        m = setup.model
        dev = torch.device(device)
        self.dtype = dtype = torch_dtype(setup.training.precision)
        check_runnable(setup, dev)
        check_moe(m.moe)
        self.embed = nn.Parameter(torch.empty(m.vocab_size, m.hidden_size, dtype=dtype, device=dev))
        self.pos = (
            nn.Parameter(torch.empty(m.max_positions, m.hidden_size, dtype=dtype, device=dev))
            if m.position is PositionType.LEARNED
            else None
        )
        self.layers = nn.ModuleList(Layer(setup, dtype, dev) for _ in range(m.num_layers))
        self.final_norm = make_norm(m, dtype, dev)
        self.head = (
            None
            if m.tied_embeddings
            else nn.Parameter(torch.empty(m.vocab_size, m.hidden_size, dtype=dtype, device=dev))
        )
        self.ring: Any = None  # a torch.distributed.ProcessGroup
        """With context parallelism: the (fake) group whose rank this model runs
        (measure/reference/context.py)."""
        self.recompute_phase: Callable[[], AbstractContextManager[Any]] = nullcontext
        self.on_layer: Callable[[str, int], None] | None = None  # progress: ("forward"|"backward", layer)
        self.on_note: Callable[[str], None] | None = None  # the curve's "backward <block>" boundaries
        self._recomputing = False
        self.reset_parameters()
        apply_finetune(self)  # LoRA adapters and frozen parameters (memplan/measure/reference/lora.py)
        convert_layers(self, setup)  # --fp8: torchao's Float8Linear (memplan/measure/reference/fp8.py)

    # -- set-up ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2 style init: N(0, 0.02) matrices, zero biases, unit norm weights."""
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)

    @property
    def head_weight(self) -> Tensor:
        return self.embed if self.head is None else self.head

    # -- blocks ---------------------------------------------------------------------------------------
    def norm(self, module: nn.Module, x: Tensor, prefix: str) -> Tensor:
        eps = self.setup.model.norm_eps
        if isinstance(module, nn.LayerNorm):
            return layer_norm(x, module.weight, module.bias, eps, prefix)
        assert isinstance(module, nn.RMSNorm)
        return rms_norm(x, module.weight, eps, prefix)

    def attention_core(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        """[b, a, s, d] q, [b, kv, s, d] k and v → [b, s, a·d], the input of W_O."""
        b, a, s, d = q.shape
        if self.setup.strategy.attention is Attention.FLASH:
            out = self.flash(q, k, v)
            # The kernel writes out in q's [b, s, a, d] layout, so this reshape is a view.
            return label(out.transpose(1, 2).reshape(b, s, a * d), "attn.out")
        n_rep = a // k.shape[1]
        q = label(q.contiguous(), "attn.q")
        k = label(repeat_kv(k, n_rep).contiguous(), "attn.k")
        v = label(repeat_kv(v, n_rep).contiguous(), "attn.v")
        scores = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(d))  # [b, a, s, s]
        assert mask is not None
        probs = label(torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1), "attn.probs")
        p = self.setup.model.attn_dropout
        if p > 0:
            probs = label(dropout(probs, p, "attn.dropout_mask"), "attn.probs_dropped")
        ctx = torch.matmul(probs, v)  # [b, a, s, d]
        # Always a contiguous [b, s, a·d] tensor (a copy unless the transpose is one already), so W_O's
        # input is this very storage and never an unnamed copy made inside F.linear.
        return label(ctx.transpose(1, 2).contiguous().view(b, s, a * d), "attn.out")

    def flash(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        p = self.setup.model.attn_dropout
        if self.ring is not None:
            from memplan.measure.reference.context import ring_flash

            out, lse = ring_flash(q, k, v, self.ring)
            # Head-major after the merge's re-concatenation on every rank but the last: W_O's input is
            # then a copy, and the saved output a tensor of its own.
            label(out, "attn.merged_out")
        elif q.device.type in CUDA_KERNELS:
            res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, p, True, False)
            out, lse, seed, offset = res[0], res[1], res[6], res[7]
            label(seed, "attn.philox_seed")
            label(offset, "attn.philox_offset")
        else:
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, p, True)
        label(lse, "attn.lse")
        return out

    def attention(self, layer: Layer, x: Tensor, c: Consts) -> Tensor:
        m = self.setup.model
        y = label(self.norm(layer.attn_norm, x, "attn_norm"), "attn.input")
        q, k, v = (self.heads(proj(y)) for proj in (layer.q, layer.k, layer.v))
        label(v, "attn.v")
        if m.qk_norm:  # on [b, s, n, d] before the heads' transpose and RoPE, as Qwen3Attention
            q = self.norm(layer.q_norm, q.transpose(1, 2), "attn.q_norm").transpose(1, 2)
            k = self.norm(layer.k_norm, k.transpose(1, 2), "attn.k_norm").transpose(1, 2)
        if c.cos is not None and c.sin is not None:
            q, k = apply_rope(q, c.cos, c.sin), apply_rope(k, c.cos, c.sin)
        label(q, "attn.q")
        label(k, "attn.k")
        if self.setup.strategy.checkpointing is Checkpointing.SELECTIVE:
            inputs = [q, k, v] + ([c.mask] if c.mask is not None else [])
            for t in inputs:
                note_kept(t)
            out = checkpoint(self._recomputable(self.attention_core), q, k, v, c.mask, use_reentrant=False)
        else:
            out = self.attention_core(q, k, v, c.mask)
        return dropout(layer.o(out), m.resid_dropout, "attn.resid_dropout_mask")

    def heads(self, t: Tensor) -> Tensor:
        """[b, s, n·d] → [b, n, s, d]; n and s from the projection's output: a tensor-parallel rank's W_Q
        holds a/t heads, and under sequence parallelism x held s/t tokens but the projection sees all s."""
        b, s, _ = t.shape
        return t.view(b, s, -1, self.setup.model.dim).transpose(1, 2)

    def mlp(self, layer: Layer, x: Tensor) -> Tensor:
        y = label(self.norm(layer.mlp_norm, x, "mlp_norm"), "mlp.input")
        block = layer.mlp
        if isinstance(block, MoEMlp):
            out = block(y)
        else:
            out = dense_mlp(cast(Mlp, block), y, self.setup.model, "mlp")
        return dropout(out, self.setup.model.resid_dropout, "mlp.resid_dropout_mask")

    def layer(self, i: int, x: Tensor, c: Consts) -> Tensor:
        layer = self.layers[i]
        assert isinstance(layer, Layer)
        out = cast(Tensor, layer(self.layer_body, layer, i, x, c))
        if self.on_layer is not None and not self._recomputing:
            on_layer = self.on_layer
            on_layer("forward", i)
            if out.requires_grad:
                out.register_hook(lambda _grad: on_layer("backward", i))
        return out

    def layer_body(self, layer: Layer, i: int, x: Tensor, c: Consts) -> Tensor:
        with layer_scope(i):
            x = x + self.attention(layer, x, c)
            return x + self.mlp(layer, x)

    # -- strategies -----------------------------------------------------------------------------------
    def _recomputable(self, fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
        """Wrap a checkpointed function so its second call (the recompute in backward) is marked."""
        calls = 0

        def run(*args: Any) -> Tensor:
            nonlocal calls
            calls += 1
            if calls == 1:
                return fn(*args)
            self._recomputing = True
            try:
                with self.recompute_phase():
                    return fn(*args)
            finally:
                self._recomputing = False

        return run

    def segments(self) -> Iterator[range]:
        k, n = self.setup.strategy.segment, len(self.layers)  # a pipeline stage's own layers
        for start in range(0, n, k):
            yield range(start, min(start + k, n))

    def run_layers(self, x: Tensor, c: Consts) -> Tensor:
        s = self.setup.strategy
        if s.reversible:
            return reversible_stack(self, x, c)
        if not s.segment:
            for i in range(len(self.layers)):
                x = self.layer(i, x, c)
            return x
        for seg in self.segments():

            def run_segment(x: Tensor, *_consts: Tensor | None, seg: range = seg) -> Tensor:
                for i in seg:
                    x = self.layer(i, x, c)
                return x

            with layer_scope(seg[0]):
                note_kept(label(x, "layer.input"))
                for t in c.tensors():
                    note_kept(t)
            x = checkpoint(self._recomputable(run_segment), x, c.cos, c.sin, c.mask, use_reentrant=False)
        return x

    # -- forward --------------------------------------------------------------------------------------
    def positions(self, s: int, device: torch.device) -> Tensor:
        """Positions of the s tokens this model runs: 0…s−1, or one context-parallel rank's head-tail
        chunks of the whole sequence."""
        if self.ring is None:
            return torch.arange(s, device=device)
        import torch.distributed as dist

        from memplan.measure.reference.context import head_tail_positions

        cp = dist.get_world_size(self.ring)
        return head_tail_positions(s * cp, cp, dist.get_rank(self.ring), device)

    def consts(self, s: int, device: torch.device) -> Consts:
        m = self.setup.model
        cos = sin = mask = None
        if m.position is PositionType.ROPE:
            cos, sin = rope_tables(self.positions(s, device), m.dim, m.rope_theta, self.dtype)
        if self.setup.strategy.attention is Attention.EAGER:
            mask = label(torch.ones(s, s, dtype=torch.bool, device=device).triu(1), "attn.causal_mask")
        return Consts(cos, sin, mask)

    def forward(self, ids: Tensor, labels: Tensor) -> Tensor:
        x = self.embedding(ids)
        x = self.run_layers(x, self.consts(ids.shape[1], ids.device))
        return self.loss(self.final(x), labels)

    # The forward's pieces, which a pipeline stage runs a part of (measure/distributed/pipeline.py).
    def embedding(self, ids: Tensor) -> Tensor:
        """[b, s] ids → the first layer's [b, s, h] input (scaled, learned positions added, dropout)."""
        m = self.setup.model
        with layer_scope(None):
            x = self.embed_tokens(label(ids, "embed.ids"))
            x = x * m.hidden_size**0.5 if m.embed_scale else x  # a Python float: saves nothing
            if self.pos is not None:
                positions = label(self.positions(ids.shape[1], ids.device), "embed.positions")
                x = x + F.embedding(positions, self.pos)
            return self.note_backward(dropout(x, m.embd_dropout, "embed.dropout_mask"), "embedding")

    def final(self, x: Tensor) -> Tensor:
        """The final norm of the last layer's output."""
        with layer_scope(None):
            return self.note_backward(self.norm(self.final_norm, x, "final_norm"), "final_norm")

    def loss(self, y: Tensor, labels: Tensor) -> Tensor:
        """The lm head and the loss over the final norm's output y."""
        with layer_scope(None):
            return head_loss(
                self.setup,
                y,
                self.head_weight,
                labels,
                lambda t: self.note_backward(self.logits(t), "lm_head"),
            )

    def embed_tokens(self, ids: Tensor) -> Tensor:
        """[b, s] ids → [b, s, h] (a vocabulary-parallel rank overrides this: distributed.py)."""
        return F.embedding(ids, self.embed)

    def logits(self, y: Tensor) -> Tensor:
        """[b, s, h] → [b, s, v] logits of the lm head (vocabulary-parallel: distributed.py)."""
        return F.linear(y, self.head_weight)

    def note_backward(self, t: Tensor, block: str) -> Tensor:
        """With ``on_note`` set (``profile``'s curve): note "backward <block>" when t's gradient is ready,
        where the backward of the block that made t begins (the lm head's, the final norm's, the
        embedding's)."""
        if self.on_note is not None and t.requires_grad:
            on_note = self.on_note
            t.register_hook(lambda _grad: on_note(f"backward {block}"))
        return t
