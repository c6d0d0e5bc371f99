"""The token embedding [v, h] (a gather: no FLOPs), learned positions [max_positions, h] when used, and the
embedding dropout."""

from __future__ import annotations

from memplan.blocks import dropout_rule
from memplan.blocks.inventory import Block, Dims, Role, Rule, save
from memplan.blocks.profiles import dropout_keeps, hidden_dropouts, profile_of
from memplan.config import DType, ModelConfig, PositionType, Setup
from memplan.config.trainable import embedding_trains

INT64 = DType.INT64
B, R = Block, Role


def embedding_params(m: ModelConfig) -> tuple[int, int]:
    """The token embedding [v, h] and the learned position table [max_positions, h] (0 with RoPE)."""
    h = m.hidden_size
    return m.vocab_size * h, (m.max_positions * h if m.position is PositionType.LEARNED else 0)


def embedding_rules(setup: Setup, dims: Dims) -> list[Rule]:
    b, s, h = dims.b, dims.s, dims.h
    rules = [
        save(B.EMBED, "ids", (b, s), INT64, R.TOKEN_IDS, "token ids: the embedding gradient is a scatter-add")
    ]
    if profile_of(setup).embed_scale_tensor:  # transformers' Gemmas scale whatever embed_scale says
        why = "the √h normaliser, a 0-dim tensor: d(embedding) = dY·normaliser"
        rules.append(save(B.EMBED, "normalizer", (), dims.act, R.PARAM_DERIVED, why))
    if setup.model.position is PositionType.LEARNED:
        why = "position ids for the position table's scatter-add"
        rules.append(save(B.EMBED, "positions", (s,), INT64, R.TOKEN_IDS, why))
    if profile_of(setup).vocab_parallel_embedding_mask and setup.parallel.tp > 1:
        why = "the rank's vocabulary mask, [b, s, 1] in A: d(embedding) = dY·mask"
        rules.append(save(B.EMBED, "vocab_mask", (b, s, 1), dims.act, R.TOKEN_IDS, why))
    keeps = dropout_keeps(setup, dims.act)
    return rules + dropout_rule(B.EMBED, "dropout_mask", hidden_dropouts(setup)[1], (b, s, h), keeps)


def loop_ids_bytes(setup: Setup, dims: Dims) -> int:
    """The training loop's int64 ids [b, s] when the embedding keeps a copy, not them: torchtitan's
    ``Embedding.forward`` on a tensor-parallel rank (models/common/embedding.py) looks up
    ``(input - offset).clamp(0, rows - 1)``, a new [b, s] its gather saves (the ``ids`` save), while the
    loop still holds the ids it passed (``Profile.vocab_parallel_embedding_mask``)."""
    if profile_of(setup).vocab_parallel_embedding_mask and setup.parallel.tp > 1:
        return 8 * dims.tokens
    return 0


def unsaved_ids_bytes(setup: Setup, dims: Dims) -> int:
    """The training loop's int64 ids [b, s] where no save holds them: a frozen embedding (fine-tuning,
    ``--freeze embeddings``) has no backward, so its lookup keeps nothing, while the loop still holds the
    ids it passed (measured: tests/measure/test_peak.py's LoRA peaks)."""
    return 0 if embedding_trains(setup) else 8 * dims.tokens
