"""The lm head [h, v] (absent when tied to the embedding) and the loss: logits upcast to fp32 as Megatron and
HF do, an explicit ``log_softmax`` + ``nll_loss``. The final norm before it is a ``norm`` block."""

from __future__ import annotations

from memplan.analytic.inventory import Block, Dims, Role, Rule, save
from memplan.blocks import mm
from memplan.config import DType, ModelConfig, Setup

FP32, INT64 = DType.FP32, DType.INT64
B, R = Block, Role


def lm_head_params(m: ModelConfig) -> int:
    return 0 if m.tied_embeddings else m.hidden_size * m.vocab_size


def lm_head_rules(setup: Setup, dims: Dims) -> list[Rule]:
    """The lm head's input and the loss's saves."""
    b, s, h, v = dims.b, dims.s, dims.h, dims.v
    return [
        save(B.LM_HEAD, "input", (b, s, h), dims.act, R.LINEAR_INPUT, "input of the lm head: dW = Xᵀ·dY"),
        save(
            B.LOSS,
            "log_probs",
            (b * s, v),
            FP32,
            R.LOG_PROBS,
            "log_softmax output of the fp32 logits: d = p − onehot",
        ),
        save(B.LOSS, "labels", (b, s), INT64, R.LABELS, "targets of nll_loss"),
        save(B.LOSS, "total_weight", (), FP32, R.LOSS_SCALAR, "nll_loss's normaliser (a fp32 scalar)"),
    ]


def lm_head_flops(dims: Dims) -> int:
    return mm(dims.tokens, dims.h, dims.v)


def loss_backward_transient(dims: Dims) -> int:
    """nll_loss's gradient and log_softmax's input gradient, both fp32 [T, v]."""
    return 2 * 4 * dims.tokens * dims.v
