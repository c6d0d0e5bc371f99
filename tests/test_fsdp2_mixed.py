"""torchtitan's FSDP2 mixed precision in the model states (``blocks.torchtitan.fsdp2_mixed_states``).

torchtitan builds the model in fp32 and shards it with ``MixedPrecisionPolicy(param_dtype=bfloat16,
reduce_dtype=float32)``: the fp32 shard is the parameter the optimizer steps (no master copy), the sharded
gradient comes back fp32, bf16 exists only while a unit is gathered. Derived by hand on the tiny model
(h 64, 4 heads, 2 kv, d 16, f 128, v 256, 2 layers, untied). A layer: wqkv (4 + 2·2)·16 × 64 = 8,192,
wo 64 × 64 = 4,096, w1 w3 w2 3 × 128 × 64 = 24,576, two norms 128: 36,992 elements; embedding and head
256 × 64 = 16,384 each; final norm 64. Ψ = 2 × 36,992 + 2 × 16,384 + 64 = 106,816; every dim 0 is even,
so a rank of dp 2 holds Ψ / 2 = 53,408 elements.
"""

from __future__ import annotations

from typing import Any

from memplan.analytic.states import ModelStates
from memplan.api import Options, build

PSI = 2 * 36_992 + 2 * 16_384 + 64
HALF = PSI // 2


def states(impl: str = "torchtitan", **kw: Any) -> ModelStates:
    return build(Options(model="tiny", seq=32, batch=2, impl=impl, **kw)).result.device.states


def test_zero3_holds_fp32_shards_and_no_master_copy() -> None:
    # fp32 shard 4 B, fp32 sharded gradient 4 B, AdamW m and v 2 × 4 B; no master copy
    assert states(zero=3, dp=2) == ModelStates(
        weights=4 * HALF, gradients=4 * HALF, master_weights=0, optimizer_states=8 * HALF
    )


def test_zero2_counts_the_gathered_bf16_copy_whole() -> None:
    # reshard_after_forward=False: the bf16 unsharded weights counted whole (2 B × Ψ); the fp32 shards
    # are the peak's zero2_shards_beside; gradients and AdamW's states as ZeRO-3's
    assert states(zero=2, dp=2) == ModelStates(
        weights=2 * PSI, gradients=4 * HALF, master_weights=0, optimizer_states=8 * HALF
    )


def test_the_step_holds_16_bytes_per_shard_element_either_way() -> None:
    # reference (DeepSpeed's split): 2 + 2 + 4 + 8 = 16; FSDP2's: 4 + 4 + 0 + 8 = 16
    titan, reference = states(zero=3, dp=2), states(zero=3, dp=2, impl="reference")
    assert reference == ModelStates(
        weights=2 * HALF, gradients=2 * HALF, master_weights=4 * HALF, optimizer_states=8 * HALF
    )
    assert titan.total == reference.total == 16 * HALF
    # before the first gradient: 12 B against 14 B per shard element
    assert titan.total - titan.gradients == 12 * HALF
    assert reference.total - reference.gradients == 14 * HALF


def test_without_fsdp_or_a_mixed_recipe_the_recipe_stays() -> None:
    # dp 1: no FSDP (torchtitan would autocast the fp32 model: not modelled, the recipe's split stays)
    assert states(zero=3, dp=1) == ModelStates(
        weights=2 * PSI, gradients=2 * PSI, master_weights=4 * PSI, optimizer_states=8 * PSI
    )
    # pure bf16: bf16 shards and bf16 AdamW states, no master: FSDP2 keeps the bf16 model's dtype
    assert states(zero=3, dp=2, precision="bf16") == ModelStates(
        weights=2 * HALF, gradients=2 * HALF, master_weights=0, optimizer_states=4 * HALF
    )


def test_the_fsdp2_mixed_recipe_types_it_under_the_reference() -> None:
    # --precision fsdp2-mixed: the same split on memplan's reference model, whose shards are one flat
    # ⌈Ψ/2⌉ = 53,408 elements (Ψ even): fp32 shard 4 B, fp32 sharded gradient 4 B, AdamW 8 B, no master
    assert states("reference", zero=3, dp=2, precision="fsdp2-mixed") == ModelStates(
        weights=4 * HALF, gradients=4 * HALF, master_weights=0, optimizer_states=8 * HALF
    )
    # ZeRO-2 (reshard_after_forward=False): the bf16 gathered copy whole, 2 B × Ψ
    assert states("reference", zero=2, dp=2, precision="fsdp2-mixed") == ModelStates(
        weights=2 * PSI, gradients=4 * HALF, master_weights=0, optimizer_states=8 * HALF
    )
    # under --impl torchtitan it is what its bf16-mixed already is (the trainer's policy)
    assert states(zero=3, dp=2, precision="fsdp2-mixed") == states(zero=3, dp=2)


def test_the_fsdp2_mixed_recipe_reduces_in_fp32() -> None:
    """FSDP2's ``reduce_dtype=float32``: the reduce-scatter moves 4 B per gradient element (2 under
    bf16-mixed), unless --reduce-dtype says otherwise."""
    from memplan.time.comm.dp import gradient_bytes

    def setup(**kw: Any) -> Any:
        return build(Options(model="tiny", seq=32, batch=2, zero=3, dp=2, **kw)).result.setup

    assert gradient_bytes(setup(precision="fsdp2-mixed")) == 4
    assert gradient_bytes(setup()) == 2
    assert gradient_bytes(setup(precision="fsdp2-mixed", reduce_dtype="bf16")) == 2


def test_the_fsdp2_mixed_recipe_needs_fsdp2() -> None:
    import pytest

    for kw in ({"zero": 3}, {"zero": 1, "dp": 2}, {"zero": 3, "dp": 2, "impl": "megatron"}):
        with pytest.raises(ValueError, match="precision: fsdp2-mixed"):
            build(Options(model="tiny", seq=32, batch=2, precision="fsdp2-mixed", **kw))


def test_the_optimizer_step_makes_no_fp32_gradient_copy() -> None:
    """memplan's reference optimizer upcasts a 16-bit gradient (``grad.float()``) but not an fp32 one: under
    FSDP2's mixed precision the step's transient is Adam's fp32 denominator alone. The largest shard it
    steps: the embedding [256, 64] over dp 2, 128 × 64 = 8,192 elements (the MLP's [128, 64] gives 4,096):
    4 B each, where bf16-mixed adds the 4 B fp32 gradient copy."""

    def transient(precision: str) -> int:
        r = build(Options(model="tiny", seq=32, batch=2, zero=3, dp=2, precision=precision)).result
        return r.device.peak.moments["optimizer step"]["transient"]

    assert transient("fsdp2-mixed") == 4 * 8_192
    assert transient("bf16-mixed") == (4 + 4) * 8_192
