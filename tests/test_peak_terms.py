"""The peak's smaller rules by hand (analytic/peak.py), in the fast, torch-free suite the mutation run uses
(docs/mutation.md); tests/measure/test_peak.py measures the moments they feed (torch).

T = b·s tokens, h the width.
"""

from __future__ import annotations

import pytest

from memplan.analytic.moments import layer_backward as lb
from memplan.analytic.moments import layer_saves
from memplan.blocks.inventory import Block, Kept, Role, Scope
from memplan.config import (
    Checkpointing,
    Device,
    DType,
    LossKind,
    ModelConfig,
    Offload,
    Parallel,
    Precision,
    Setup,
    StrategyConfig,
    TrainingConfig,
)
from memplan.engine import at_stage, estimate

B, S, H = 2, 64, 64
T = B * S


def setup(
    norm: str = "rmsnorm", precision: Precision = Precision.BF16_MIXED, layers: int = 4, **kw: object
) -> Setup:
    model = ModelConfig(
        hidden_size=H,
        num_layers=layers,
        num_heads=4,
        ffn_size=160,
        vocab_size=1000,
        norm=norm,
        max_positions=S,
    )
    return Setup(
        model=model,
        training=TrainingConfig(micro_batch=B, seq_len=S, precision=precision),
        device=Device.CPU,
        **kw,
    )


@pytest.mark.parametrize(
    ("norm", "precision", "shared"),
    [
        # LayerNorm saves its input as it is: the checkpoint's kept [T, h] storage, not a new one.
        ("layernorm", Precision.BF16_MIXED, 2 * T * H),
        ("layernorm", Precision.FP32, 4 * T * H),
        # Llama's RMSNorm upcasts a 16-bit input to fp32 first and saves the upcast: a new storage ...
        ("rmsnorm", Precision.BF16_MIXED, 0),
        # ... but an fp32 input is saved itself.
        ("rmsnorm", Precision.FP32, 4 * T * H),
    ],
)
def test_a_rerun_segment_counts_the_kept_input_once(norm: str, precision: Precision, shared: int) -> None:
    """n re-run layers are n working sets less the first norm's input when that is the kept checkpoint:
    rerun(2) − 2·rerun(1) = shared; nothing re-runs for no layer."""
    s = setup(norm, precision)
    assert layer_saves.segment_rerun_bytes(s, 0) == 0
    assert layer_saves.segment_rerun_bytes(s, 2) - 2 * layer_saves.segment_rerun_bytes(s, 1) == shared


def kept(scope: Scope, elements: int) -> Kept:
    return Kept(
        name="x",
        block=Block.EMBED,
        role=Role.RESIDUAL,
        shape=(elements,),
        dtype=DType.BF16,
        scope=scope,
        count=4,
        reason="",
    )


@pytest.mark.parametrize(
    ("strategy", "i", "alive"),
    [
        (StrategyConfig(), 2, 3),  # layers 0, 1, 2 hold their saves at layer 2's backward
        (StrategyConfig(checkpointing=Checkpointing.FULL), 2, 3),  # one kept input per layer up to 2
        # every-2: segments {0, 1} and {2, 3}: at layer 3, one kept input per segment, 2
        (StrategyConfig(checkpointing=Checkpointing.EVERY_K, checkpoint_every=2), 3, 2),
        (StrategyConfig(checkpointing=Checkpointing.EVERY_K, checkpoint_every=2), 1, 1),
    ],
)
def test_saves_alive_at_a_layers_backward(strategy: StrategyConfig, i: int, alive: int) -> None:
    """One layer's layer-scope saves are 10 bf16 elements (20 bytes); model-scope saves never count."""
    inventory = [kept(Scope.LAYER, 10), kept(Scope.MODEL, 1000)]
    assert layer_saves.saved_layers_up_to(setup(strategy=strategy), inventory, i) == alive * 20


def test_the_loop_labels_join_the_fused_losss_loss_backward() -> None:
    """Liger's fused loss keeps no save of the labels: the training loop's int64 labels [b, s] are alive
    beside every save at the loss backward (8·T bytes); the standard loss's nll_loss saves them."""
    for loss, labels in ((LossKind.FUSED, 8 * T), (LossKind.STANDARD, 0)):
        est = estimate(setup(loss=loss))
        assert est.peak.moments["loss backward"]["activations"] == est.activations + labels


# The head's saves (Llama's RMSNorm, the lm head, the loss, v = 1000): the fp32 upcast input [T, h] and rstd
# [T, 1] (fp32), the bf16 normalised input of the weight product [T, h], the lm head's input [T, h] (bf16),
# log_softmax's fp32 output [T, v] and nll_loss's int64 targets [T] and fp32 total weight (a scalar).
HEAD_SAVES = 4 * T * H + 4 * T + 2 * T * H + 2 * T * H + 4 * T * 1000 + 8 * T + 4


def test_offloaded_activations_bring_back_the_heads_saves_for_the_loss_backward() -> None:
    """save_on_cpu: at the loss backward the device holds the head's saves brought back and the ids and
    labels the training loop holds (2 · 8·T)."""
    est = estimate(setup(offload=Offload.ACTIVATIONS))
    assert est.peak.moments["loss backward"]["activations"] == HEAD_SAVES + 2 * 8 * T


def test_the_final_norms_backward_has_freed_the_loss_the_lm_head_and_the_norms_n_and_rstd() -> None:
    """By the final RMSNorm's backward peak the loss's log-probs [T, v] fp32, the lm head's input [T, h] and
    the norm's own n [T, h] (bf16) and rstd [T, 1] (fp32) are released (layer_backward.norm_saves_at_peak:
    its fp32 input remains)."""
    moments = estimate(setup()).peak.moments
    freed = 4 * T * 1000 + 2 * T * H + 2 * T * H + 4 * T
    assert moments["loss backward"]["activations"] - moments["final norm backward"]["activations"] == freed


def test_the_top_layers_backward_holds_every_save_but_the_heads() -> None:
    """Layer 3 of 4 (the top, where activations peak): every layer's saves and the embedding's are alive,
    the head's are freed but for the labels the training loop holds (8·T)."""
    est = estimate(setup())
    assert est.activations - est.peak.moments["layer backward"]["activations"] == HEAD_SAVES - 8 * T
    # No layer's backward has run yet: the gradients are the head's, lm head [v, h] and final norm [h], bf16.
    assert est.peak.moments["layer backward"]["gradients"] == 2 * (1000 * H + H)


def test_a_fully_checkpointed_layer_re_runs_one_layers_saves() -> None:
    """Full checkpointing's layer backward holds, beside what it would hold un-checkpointed, the saves of the
    one layer it re-ran: one layer's saves = the activations of 4 layers less those of 3 (RMSNorm in bf16
    shares no storage with the kept input)."""

    def moment(checkpointing: Checkpointing) -> dict[str, int]:
        return estimate(setup(strategy=StrategyConfig(checkpointing=checkpointing))).peak.moments[
            "layer backward"
        ]

    one_layer = estimate(setup()).activations - estimate(setup(layers=3)).activations
    assert moment(Checkpointing.FULL)["transient"] - moment(Checkpointing.NONE)["transient"] == one_layer


def test_selective_flash_re_runs_only_the_kernels_logsumexp() -> None:
    """Selective checkpointing re-runs the flash core on the q, k, v the checkpoint keeps: only its fp32
    logsumexp [b, a, s] is new."""
    s = setup(strategy=StrategyConfig(checkpointing=Checkpointing.SELECTIVE))
    assert lb.recompute_working_set(s) == 4 * B * 4 * S
    # The layer's backward peaks in its MLP (flash: no [s, s] scores), which runs before the core is
    # re-run: the same rise above the live set as without checkpointing (the live set lacks every lse).
    selective, plain = (estimate(x).peak.moments["layer backward"] for x in (s, setup()))
    assert selective["transient"] == plain["transient"]
    assert plain["activations"] - selective["activations"] == 4 * (4 * B * 4 * S)  # 4 layers' lse


def test_zero3_holds_fsdp2s_root_and_a_layer_at_each_backward_moment() -> None:
    """ZeRO-3 over 2 ranks, the reference's FSDP2 wrapping (a unit per layer and the root: embedding, final
    norm, untied head; ``analytic.fsdp.root``): Ψ = 2·1000·64 + 4 · (2·64 + 4·64² + 3·64·160) + 64 =
    316,992 parameters, a rank holds ⌈Ψ/2⌉ bf16. torch 2.13 gathers the root again at the loss and keeps it
    unsharded to the backward's end (2·1000·64 + 64 = 128,064 elements, bf16; every dim 0 even: no
    padding); beside it a layer (47,232 elements, bf16): the top one prefetched at the loss and the final
    norm, each layer's own at its backward; at the embedding's backward the root alone; the step none."""
    moments = estimate(setup(strategy=StrategyConfig(zero=3, dp=2))).peak.moments
    shard, root, layer = 316_992 // 2 * 2, 128_064 * 2, 47_232 * 2
    assert {name: m["weights"] for name, m in moments.items()} == {
        "loss backward": shard + root + layer,
        "final norm backward": shard + root + layer,
        "layer backward": shard + root + layer,
        "embedding backward": shard + root,
        "optimizer step": shard,
    }


def test_zero3_on_the_last_pipeline_stage_gathers_the_lm_head() -> None:
    """pp 2: the last stage holds layers 2-3, the final norm and the untied head, Ψ = 2 · 47,232 + 64 +
    1000·64 = 158,528 parameters, a rank ⌈Ψ/2⌉ of them in bf16; no embedding there, so the largest unit
    ZeRO-3 gathers is the [1000, 64] head (a layer is 47,232), bf16."""
    parallel = Parallel(pp=2)
    s = setup(strategy=StrategyConfig(zero=3, dp=2), parallel=parallel)
    s = s.model_copy(update={"training": s.training.model_copy(update={"grad_accum": 2})})
    moments = at_stage(estimate(s), 1).peak.moments
    shard, unit = 158_528 // 2 * 2, 1000 * 64 * 2
    assert moments["loss backward"]["weights"] == shard + unit
    assert moments["layer backward"]["weights"] == shard + unit
    assert moments["optimizer step"]["weights"] == shard


def test_every_k_bottom_layer_re_runs_one_layer_as_full_checkpointing_does() -> None:
    """At T = 8 tokens the gradients of the layers above dominate: the layer-backward moment is layer 0's.
    Every-2's segment {0, 1} has freed layer 1's re-run saves by then, so layer 0's backward holds one
    re-run layer and one kept input below it, as under full checkpointing: the same moment."""

    def layer_backward(checkpointing: Checkpointing, k: int) -> dict[str, int]:
        strategy = StrategyConfig(checkpointing=checkpointing, checkpoint_every=k)
        s = setup(strategy=strategy).model_copy(update={"training": TrainingConfig(micro_batch=1, seq_len=8)})
        return estimate(s).peak.moments["layer backward"]

    assert layer_backward(Checkpointing.EVERY_K, 2) == layer_backward(Checkpointing.FULL, 1)
