"""The first of ``Options``' fields: the model and how it trains (``memplan.options`` declares the rest, in
order after these: the field order is the options' order in every command's help).
"""

from __future__ import annotations

from memplan.config import Frozen, Optimizer, OptimizerImpl, Precision, TrainingConfig
from memplan.option_fields import MODEL, TRAINING, option

DEFAULT_SEQ = TrainingConfig().seq_len
"""``--seq`` when not given: 2048 tokens, or the model's context length (max_positions) if shorter."""


class TrainingOptions(Frozen):
    """The model and its training settings, the first fields of ``memplan.options.Options``."""

    model: str = option(
        "Model preset name or alias (e.g. 70b, llama-3-8b, mixtral-8x7b, gpt2), a preset .toml, a Hugging "
        "Face config.json or a Hub id (org/name: its config.json only, through the Hub cache; "
        "HF_HUB_OFFLINE, HF_TOKEN). Required. `memplan presets` lists them.",
        MODEL,
        default=...,
        flags=("-m",),
        show_default=False,
        min_length=1,
    )
    dropout: float | None = option(
        "Dropout probability 0 ≤ P < 1 for attention, residual and embedding dropout [default: the "
        "preset's own]",
        MODEL,
        metavar="P",
        show_default=False,
    )
    seq: int | None = option(
        f"Tokens per sequence s [default: {DEFAULT_SEQ}, or the model's context length if shorter]",
        TRAINING,
        metavar="TOKENS",
        flags=("-s",),
        show_default=False,
    )
    batch: int = option("Sequences per micro-batch b", TRAINING, default=1, metavar="N", flags=("-b",), gt=0)
    precision: Precision = option(
        "Precision recipe: dtype of weights, gradients, master copy, optimizer states, activations; "
        "bf16-mixed is DeepSpeed's (bf16 shards + an fp32 master), fsdp2-mixed FSDP2's MixedPrecisionPolicy "
        "(fp32 shards the optimizer steps, bf16 gathered copies, fp32 reduce-scatter; ZeRO-2/3 only)",
        TRAINING,
        default=Precision.BF16_MIXED,
    )
    optimizer: Optimizer = option("Optimizer", TRAINING, default=Optimizer.ADAMW)
    optimizer_impl: OptimizerImpl | None = option(
        "Whose code steps the optimizer (its step's temporaries differ): reference (memplan's own), "
        "for-loop / foreach / fused (torch.optim.AdamW), bitsandbytes (AdamW8bit, with --optimizer "
        "adamw-8bit) [default: reference under --impl reference; fused under --impl megatron (its "
        "FusedAdam, Transformer Engine's or Apex's), hf (transformers' adamw_torch_fused) and torchtitan "
        "(0.3.0's implementation = fused); otherwise as torch picks on --device: foreach on cuda, for-loop "
        "on cpu (torch.optim.optimizer._default_to_fused_or_foreach); bitsandbytes for adamw-8bit]",
        TRAINING,
        show_default=False,
    )
    clip_grad: bool | None = option(
        "Gradient-norm clipping before each optimizer step (its norm and rescale passes over the owned "
        "gradients, step time only) [default: on under --impl megatron, torchtitan and hf, as their "
        "training loops clip at 1.0; off under --impl reference, whose step does not clip]",
        TRAINING,
        show_default=False,
    )
