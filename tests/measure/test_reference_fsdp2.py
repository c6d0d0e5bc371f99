"""Issue #22: the reference model's ZeRO-3 (FSDP2 ``fully_shard`` per layer and on the root, as
measure/distributed/parallelize.py ``shard_dp`` wraps it) per rank, at every moment of the estimate, against
torch 2.13 run on the fake process group with every storage tracked (measure/distributed/reference_peak.py).

What torch 2.13 does there, read from torch/distributed/fsdp/_fully_shard/ (``analytic.fsdp.root``'s
docstring has the lines): the root is resharded after its forward (``shard_dp`` passes
``reshard_after_forward=True``, so ``FSDPState._lazy_init`` leaves the root's ``post_forward_mesh_info``),
gathered again by its pre-backward hook on the loss, which prefetches the top layer; it stays unsharded,
its gradients unsharded, until ``_root_post_backward_final_callback`` (its inputs need no gradient).
"""

from __future__ import annotations

from typing import Any

import pytest

from memplan.analytic.fsdp.root import root_gathered
from memplan.config import (
    Attention,
    Device,
    ModelConfig,
    Setup,
    StrategyConfig,
    TrainingConfig,
    ZeroStage,
)
from memplan.engine import estimate
from memplan.measure.distributed.reference_peak import measure_reference_rank
from memplan.measure.distributed.titan_peak import estimated_moments

LLAMA: dict[str, Any] = {
    "hidden_size": 64,
    "num_layers": 3,
    "num_heads": 4,
    "num_kv_heads": 2,
    "ffn_size": 160,
}
GPT: dict[str, Any] = {
    "hidden_size": 64,
    "num_layers": 3,
    "num_heads": 4,
    "ffn_size": 256,
    "norm": "layernorm",
    "mlp": "gelu",
    "position": "learned",
    "tied_embeddings": False,
    "qkv_bias": True,
    "out_bias": True,
    "mlp_bias": True,
}


def make(
    arch: dict[str, Any],
    vocab: int,
    dp: int = 2,
    precision: str = "fp32",
    attention: str = "flash",
    b: int = 2,
    s: int = 32,
    positions: int = 64,
) -> Setup:
    return Setup(
        model=ModelConfig(**arch, vocab_size=vocab, max_positions=positions),
        training=TrainingConfig(micro_batch=b, seq_len=s, precision=precision, optimizer="adamw"),
        strategy=StrategyConfig(attention=Attention[attention.upper()], zero=ZeroStage.PARAMETERS, dp=dp),
        device=Device.CPU,
    )


CASES = {
    # a large vocabulary: the loss backward is the peak, with the root gathered and the top layer prefetched
    "llama v4096": make(LLAMA, 4096),
    # LayerNorm, biases, learned positions (in the root unit), eager attention: a middle layer tops the
    # layers (the top one holds no reduce-scatter input, the bottom one prefetches nothing)
    "gpt v4096 eager": make(GPT, 4096, attention="eager"),
    # a small vocabulary, 16-bit, four ranks: the layers' backward is the peak
    "llama v64 bf16 dp4": make(LLAMA, 64, dp=4, precision="bf16", s=64),
}


@pytest.mark.parametrize("name", list(CASES))
def test_every_moment_equals_what_torch_runs(name: str) -> None:
    setup = CASES[name]
    assert root_gathered(setup)
    est = estimate(setup)
    run = measure_reference_rank(setup)
    estimated = estimated_moments(est)
    assert run.moments(list(estimated)) == estimated
    assert run.peak == max(estimated.values())


def test_the_root_and_the_prefetched_top_layer_at_the_loss_by_hand() -> None:
    """The tiny Llama of ``make(LLAMA, 4096)``: h 64, 3 layers, 4 heads of 16 over 2 kv heads, SwiGLU 160,
    v 4096, untied, fp32, dp 2 (every dim 0 even: no padding).
    Root unit: embed 4096·64 + final norm 64 + head 4096·64 = 524,352 elements · 4 B = 2,097,408 B.
    Layer: 2 norms 2·64 + W_Q 64·64 + W_K, W_V 2·32·64 + W_O 64·64 + gate, up, down 3·160·64
    = 128 + 4,096 + 4,096 + 4,096 + 30,720 = 43,136 elements · 4 B = 172,544 B.
    At the loss's backward both are unsharded beside the rank's shards (before: one gathered unit, the
    largest of a layer, the embedding, the head: 4096·64·4 = 1,048,576 B)."""
    setup = make(LLAMA, 4096)
    root, layer = 524_352 * 4, 43_136 * 4
    est = estimate(setup)
    moments = est.peak.moments
    weights = est.device.states.weights
    assert weights == (524_352 + 3 * 43_136) // 2 * 4  # Ψ = 653,760: Ψ/2 in fp32
    assert moments["loss backward"]["weights"] == weights + root + layer
    assert moments["final norm backward"]["weights"] == weights + root + layer


def test_the_heads_gradient_is_held_to_the_end_by_hand() -> None:
    """Same model. From the lm head's backward to the backward's end the root holds its unsharded
    gradients: head [4096, 64] and final norm [64], fp32 = (262,144 + 64)·4 = 1,048,832 B, at every
    layer's moment beside the layers' sharded gradients above it; at the embedding's backward also the
    embedding's [4096, 64] (1,048,576 B) while the root's sharded gradients (524,352/2·4 = 1,048,704 B,
    in the model states) do not exist yet."""
    setup = make(LLAMA, 4096)
    est = estimate(setup)
    head = (262_144 + 64) * 4
    layer_shard = 43_136 // 2 * 4
    moments = est.peak.moments
    # the layer moment is layer 1's (a middle one) or another: its gradients are the head's and the
    # sharded ones of the layers above it (0, 1 or 2 layers)
    assert moments["layer backward"]["gradients"] in {head + k * layer_shard for k in range(3)}
    grads = est.device.states.gradients
    assert grads == (524_352 + 3 * 43_136) // 2 * 4  # Ψ/2 in fp32
    embedding = moments["embedding backward"]
    assert embedding["gradients"] == grads - 1_048_704 + head + 1_048_576
    # the root unit is still unsharded (2,097,408 B) and layer 0's reduce-scatter input held (172,544 B)
    assert embedding["weights"] == est.device.states.weights + 2_097_408


def test_the_roots_reduce_scatter_under_fsdp2_mixed_precision_by_hand() -> None:
    """From torch's ``foreach_reduce`` (not measured: the reference run sets no mixed-precision policy):
    the root's unsharded bf16 gradients are copied into the fp32 flat input, then cleared, and the output
    (the root's fp32 shard) made, while the last parameter's unsharded gradient, the lm head's, stays bound
    to the dim-0 check's loop variable (``for i, (fsdp_param, unsharded_grad) in enumerate(...)``) until
    the function returns. v 4096, h 64, 4 tokens, dp 2: the input, (2·4096·64 + 64)·4 = 2,097,408 B, and
    the lm head's bf16 gradient, 4096·64·2 = 524,288 B, beside every sharded gradient (the root's made),
    exceed the still-unsharded bf16 root (1,048,704 B) beside layer 0's fp32 input (172,544 B) and
    [T, h] bf16 (512 B): the embedding moment is the reduce-scatter's output. (The lingering gradient is
    measured under torchtitan's ZeRO-3: tests/hf/test_torchtitan_peak.py.)"""
    setup = make(LLAMA, 4096, precision="fsdp2-mixed", b=1, s=4)
    est = estimate(setup)
    moment = est.peak.moments["embedding backward"]
    assert moment["transient"] == 2_097_408 + 524_288 + 8  # + the loss scalar and its seed gradient
    assert moment["gradients"] == est.states.gradients


def test_where_it_is_not_modelled_zero3_keeps_one_gathered_unit() -> None:
    tied = make({**LLAMA, "tied_embeddings": True}, 4096)
    assert not root_gathered(tied)
    assert not root_gathered(make(LLAMA, 4096, dp=1))
