"""FSDP2's copy kernels on the compute stream (``memplan.time.dp_copies``), derived by hand on the tiny
model.

Source read (torch 2.13, torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py):
- ``foreach_all_gather_copy_out``: ``split_with_sizes_copy(all_gather_output, ..., out=out)`` on the
  current stream — reads the gathered output, writes the unsharded parameters: 2 × its bytes;
- ``foreach_reduce``: ``foreach_reduce_scatter_copy_in`` (``chunk_cat`` of the unsharded gradients into
  the reduce dtype's input) before ``reduce_scatter_stream.wait_stream(current_stream)``: on the current
  stream, (2 B bf16 gradient + the reduce dtype's bytes) an element; no division kernel for fp32/bf16
  (``_get_gradient_divide_factors`` returns no factors, ``ReduceOp.AVG``).

The tiny model (presets/models/tiny.toml; tests/plan/test_titan_fsdp2_comm.py's table): 106,816
parameters in all, torchtitan's [norm, lm_head] unit 16,448 (kept gathered from forward to backward).
"""

from __future__ import annotations

import pytest

from memplan.api import Options, build
from memplan.engine import Result
from memplan.presets import load_gpu
from memplan.time import dp_copies
from memplan.time.comm.collectives import communication
from memplan.time.predict import predict
from memplan.time.timing import peak_flops

H100 = load_gpu("h100")
ALL = 106_816
HEAD_UNIT = 64 + 256 * 64
HBM = 0.80 * 3350e9  # efficiency.MEMORY × the H100 SXM's HBM3 bandwidth (presets/gpus/h100-sxm.toml)


def result(**options: object) -> Result:
    return build(Options(model="tiny", seq=32, batch=2, **options)).result  # type: ignore[arg-type]


def copies(r: Result) -> int:
    c, rows = communication(r, H100.topology)
    return dp_copies.copy_bytes(c.setup, rows)


def test_torchtitan_zero3() -> None:
    """torchtitan, ZeRO-3 over dp 2, 4 micro-batches, fp32 reduce; per micro-batch:
      copy-outs  forward 2 · 106,816 · 2 B + backward 2 · (106,816 − 16,448) · 2 B = 427,264 + 361,472
      copy-in    106,816 · (2 + 4) B                                                = 640,896
    1,429,632 B a micro-batch, × 4 = 5,718,528 B."""
    r = result(impl="torchtitan", reduce_dtype="fp32", zero=3, dp=2, gpus=2, grad_accum=4)
    assert copies(r) == 4 * (2 * ALL * 2 + 2 * (ALL - HEAD_UNIT) * 2 + ALL * 6) == 5_718_528


def test_torchtitan_zero2_and_bf16_reduce() -> None:
    """ZeRO-2 (``reshard_after_forward=False``): one gather a micro-batch; bf16 reduce: 2 + 2 B an element.
    4 · (2 · 106,816 · 2 + 106,816 · 4) = 4 · 854,528 = 3,418,112 B."""
    r = result(impl="torchtitan", reduce_dtype="bf16", zero=2, dp=2, gpus=2, grad_accum=4)
    assert copies(r) == 4 * (2 * ALL * 2 + ALL * 4) == 3_418_112


def test_torchtitan_under_pp_once_a_step() -> None:
    """pp 2 × dp 2: torch's pipeline stage gathers each unit once a step and reduce-scatters once
    (``comm.dp._titan_fsdp2_rows``). The busiest stage holds one layer and the embedding or the head; its
    rows' bytes give 2 · AG + RS · (2 + 4)/4, whatever the stage."""
    r = result(impl="torchtitan", reduce_dtype="fp32", zero=3, dp=2, pp=2, gpus=4, grad_accum=4)
    c, rows = communication(r, H100.topology)
    dp = [row for row in rows if row.dimension == "dp"]
    assert [row.count for row in dp] == [1, 1]
    ag, rs = (row.bytes for row in dp)
    assert dp_copies.copy_bytes(c.setup, rows) == 2 * ag + rs // 4 * 6


def test_reference_zero3_bf16_gradients() -> None:
    """The reference's ZeRO-3 (FSDP2 per layer and root), bf16-mixed, gradients reduced in their own bf16,
    2 micro-batches: every unit gathered in forward and again in backward, reduce-scattered each.
    2 · (2 · 2 · 106,816 · 2 + 106,816 · (2 + 2)) = 2 · 1,281,792 = 2,563,584 B."""
    r = result(zero=3, dp=2, gpus=2, grad_accum=2)
    assert copies(r) == 2 * (2 * 2 * ALL * 2 + ALL * 4) == 2_563_584


@pytest.mark.parametrize(
    "options",
    [
        {"zero": 2, "dp": 2, "gpus": 2},  # the reference's ZeRO-2 rows are DeepSpeed's
        {"zero": 3, "dp": 1, "gpus": 1},  # nothing sharded
        {"zero": 3, "dp": 2, "gpus": 2, "impl": "megatron"},  # Megatron's own buffers
        {"zero": 0, "dp": 2, "gpus": 2, "impl": "megatron"},  # its DDP reduces main_grad in place
        {"zero": 0, "dp": 2, "gpus": 2},  # the reference all-reduces each gradient in place
        {"zero": 0, "dp": 1, "gpus": 1, "impl": "torchtitan"},  # no DDP on one rank
    ],
)
def test_not_charged_without_fsdp2_or_ddp(options: dict[str, object]) -> None:
    assert copies(result(**options)) == 0


def test_charged_whole_at_hbm_rate_in_the_step() -> None:
    """The part is the bytes at ``MEMORY`` × HBM, and the step holds it: removing it gives the step the
    other parts add up to."""
    r = result(impl="torchtitan", reduce_dtype="fp32", zero=3, dp=2, gpus=2, grad_accum=4)
    pr = predict(r, H100, peak_flops(H100, r.setup.training.precision))
    assert pr.dp_copies_s == pytest.approx(5_718_528 / HBM, rel=1e-12)
    assert pr.parts()["dp copies"] == pr.dp_copies_s
    assert sum(pr.parts().values()) == pytest.approx(pr.step_time_s, rel=1e-12)


@pytest.mark.parametrize("impl", ["torchtitan", "hf"])
def test_ddp_copies_each_gradient_into_its_bucket_and_back(impl: str) -> None:
    """torch DDP (ZeRO 0, gradient_as_bucket_view=False): ``mul_out`` into the bucket (read, write) and
    ``copy_bucket_to_grad`` back (read, write) on every gradient it all-reduces, once a step (its
    accumulation micro-batches under ``no_sync``): 4 × the all-reduce's bytes. The tiny model's bf16
    gradients (``--reduce-dtype`` not given: their own dtype): 4 · 106,816 · 2 = 854,528 B."""
    r = result(impl=impl, zero=0, dp=2, gpus=2, grad_accum=4)
    assert copies(r) == 4 * ALL * 2 == 854_528
