"""What a pipeline schedule holds at a stage's boundary (``pipeline_parallel.boundary_tensors``), counted by
hand from the schedules' code, per impl:

- torch's pipelining (reference): ``PipelineStage.fwd_cache`` keeps each sent output until its backward,
  ``Schedule1F1B``'s ``send_work`` one more (the warm-up's send of micro-batch w − 2); one receive buffer
  per micro-batch and direction (``_prepare_forward_infra``, ``_setup_backward_recv_info``);
- Megatron-core: ``deallocate_output_tensor`` leaves a 0-dim placeholder of each sent output, received
  tensors are the first layer's saved norm input; ``RotaryEmbedding.forward`` is lru_cached: one table per
  model chunk.
The measured side of the same counts (real gloo ranks) is tests/measure/test_distributed_pp.py.
"""

from __future__ import annotations

from typing import Any

from memplan.api import Options, setup_of
from memplan.config import Device, Impl
from memplan.engine import at_stage, estimate

MODEL, SEQ, H = "llama-3.2-1b", 64, 2048  # 16 layers, h 2048, RMSNorm


def _options(impl: Impl, **layout: Any) -> Options:
    device = Device.CUDA if impl is Impl.MEGATRON else Device.CPU  # Megatron's kernels are CUDA's
    return Options(model=MODEL, seq=SEQ, device=device, impl=impl, **layout)


def _held(impl: Impl = Impl.REFERENCE, **layout: Any) -> dict[int, dict[str, tuple[tuple[int, ...], int]]]:
    """Each pipeline stage's boundary tensors: name → (shape, count)."""
    est = estimate(setup_of(_options(impl, **layout)))
    p = est.setup.parallel.pp
    return {
        i: {k.name: (k.shape, k.count) for k in at_stage(est, i).tensors if k.name.startswith("pp.")}
        for i in range(p)
    }


def test_1f1b_keeps_outputs_in_flight_and_a_buffer_per_micro_batch() -> None:
    """pp 4, n 8, bf16-mixed (RMSNorm saves an fp32 copy: no buffer is a save). Stage i: w = min(4 − i, 8)
    forwards in flight, each sending but on the last stage, plus send_work's one when w ≥ 2; 8
    activation buffers on stages 1–3, 8 gradient buffers on stages 0–2; each [1, 64, 64]."""
    held = _held(gpus=4, pp=4, grad_accum=8)
    x = (1, SEQ, H)
    assert held[0] == {"pp.output": (x, 4 + 1), "pp.grad_recv": (x, 8)}
    assert held[1] == {"pp.output": (x, 3 + 1), "pp.recv": (x, 8), "pp.grad_recv": (x, 8)}
    assert held[2] == {"pp.output": (x, 2 + 1), "pp.recv": (x, 8), "pp.grad_recv": (x, 8)}
    assert held[3] == {"pp.recv": (x, 8)}  # the last stage sends nothing: its output is the loss


def test_sequence_parallel_sends_a_rank_its_s_over_t_tokens() -> None:
    held = _held(gpus=4, pp=2, tp=2, sp=True, grad_accum=4)
    assert held[0]["pp.output"] == ((1, SEQ // 2, H), 2 + 1)


def test_fp32_norm_input_is_the_received_buffer() -> None:
    """fp32 activations: RMSNorm's x.float() is x, so a forward in flight on a receiving stage saves its
    buffer as the first layer's norm input; pp 2, n 4: the last stage has 1 forward in flight, 4 − 1
    buffers more."""
    held = _held(gpus=2, pp=2, grad_accum=4, precision="fp32")
    assert held[1] == {"pp.recv": ((1, SEQ, H), 3)}


def test_interleaved_counts_each_virtual_stages_sends_and_receives() -> None:
    """pp 2, vpp 2, n 4 (4 layers per virtual stage). Rank 0 holds virtual stages 0 and 2, rank 1 stages 1
    and 3 (the last). Megatron's warm-up, 2(p − i − 1) + (m − 1)·p, plus the forward in flight: 5 on rank
    0 (forward j on chunk (j // 2) mod 2: chunks 0, 0, 1, 1, 0 — all send), 3 on rank 1 (chunks 0, 0, 1:
    the last one is virtual stage 3, which does not send). Receive buffers: n per receiving chunk (rank 0
    chunk 1; rank 1 both), gradient buffers n per sending chunk (rank 0 both; rank 1 chunk 0). No
    send_work output: that is Schedule1F1B's."""
    held = _held(gpus=2, pp=2, vpp=2, grad_accum=4)
    x = (1, SEQ, H)
    assert held[0] == {"pp.output": (x, 5), "pp.recv": (x, 4), "pp.grad_recv": (x, 8)}
    assert held[1] == {"pp.output": (x, 2), "pp.recv": (x, 8), "pp.grad_recv": (x, 4)}


def test_megatron_keeps_a_zero_dim_placeholder_per_sent_output() -> None:
    """deallocate_output_tensor: out.data = torch.empty([]) — shape (), one bf16 element; nothing else."""
    held = _held(Impl.MEGATRON, gpus=4, pp=4, grad_accum=8)
    assert held[0] == {"pp.output": ((), 4)}
    assert held[1] == {"pp.output": ((), 3)}
    assert held[3] == {}


def test_megatron_rope_table_once_per_model_chunk() -> None:
    """RotaryEmbedding.forward is lru_cached per module: a rank's m model chunks make m tables, whatever
    the forwards in flight (pp 2, vpp 2, n 4: rank 0 has 5 in flight and 2 chunks)."""
    est = estimate(setup_of(_options(Impl.MEGATRON, gpus=2, pp=2, vpp=2, grad_accum=4)))
    tensors = {k.name: k.count for k in at_stage(est, 0).tensors}
    assert tensors["rope.cos"] == tensors["rope.sin"] == 2
    assert tensors["attn.q"] == 5 * 4  # 5 chunk-forwards in flight, 4 layers each
