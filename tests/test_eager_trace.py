"""benchmarks/eager_trace.py on a hand-written trace: each kernel in its phase (the launching thread and
time), class and aten op, an element-wise op's bytes from its input shapes."""

from __future__ import annotations

from typing import Any

from benchmarks.eager_trace import group, op_bytes

MAIN, AUTOGRAD = 1, 2


def _op(xid: int, tid: int, ts: float, name: str, dims: list[Any], types: list[str]) -> dict[str, Any]:
    args = {"External id": xid, "Input Dims": dims, "Input type": types}
    return {"cat": "cpu_op", "pid": MAIN, "tid": tid, "ts": ts, "dur": 1.0, "name": name, "args": args}


def _kernel(xid: int, corr: int, tid: int, ts: float, name: str, dur: float) -> list[dict[str, Any]]:
    launch = {"cat": "cuda_runtime", "pid": MAIN, "tid": tid, "ts": ts, "args": {"correlation": corr}}
    kernel = {"cat": "kernel", "name": name, "ts": ts + 1, "dur": dur}
    kernel["args"] = {"External id": xid, "correlation": corr}
    return [launch, kernel]


def _args(dims: list[Any], types: list[str]) -> dict[str, Any]:
    return {"Input Dims": dims, "Input type": types}


def test_bytes_by_input_shapes() -> None:
    # bf16 [2, 4] · fp32 [2, 4] → fp32: reads 16 + 32, writes 32
    assert op_bytes("aten::mul", _args([[2, 4], [2, 4]], ["c10::BFloat16", "float"])) == 80
    # in place: reads both, writes the first; copy_: writes the destination, reads the source
    assert op_bytes("aten::add_", _args([[8], [8], []], ["float", "float", "Scalar"])) == 96
    assert op_bytes("aten::copy_", _args([[8], [8], []], ["c10::BFloat16", "float", ""])) == 48
    # a reduction reads its input; a list input is not counted
    assert op_bytes("aten::sum", _args([[4, 8], []], ["float", "ScalarList"])) == 128
    assert op_bytes("aten::cat", _args([[[2], [2]], []], ["TensorList", "Scalar"])) == 0


def test_phases_classes_and_ops() -> None:
    events = [
        _op(1, MAIN, 0.0, "aten::mm", [[2, 2], [2, 2]], ["c10::BFloat16"] * 2),
        _op(2, MAIN, 5.0, "aten::mul", [[4], [4]], ["float", "float"]),
        _op(3, AUTOGRAD, 10.0, "aten::_flash_attention_backward", [], []),
        _op(4, MAIN, 20.0, "aten::lerp_", [[4], [4], []], ["float", "float", "Scalar"]),
        *_kernel(1, 11, MAIN, 0.5, "nvjet_gemm", 3.0),
        *_kernel(2, 12, MAIN, 5.5, "elementwise_kernel", 2.0),
        *_kernel(3, 13, AUTOGRAD, 10.5, "pytorch_flash::flash_bwd_kernel", 7.0),
        *_kernel(4, 14, MAIN, 20.5, "lerp_kernel", 1.0),
    ]
    g = group(events)
    assert g[("forward", "gemm", "aten::mm")] == [1, 0, 3.0]
    assert g[("forward", "elementwise", "aten::mul")] == [1, 48, 2.0]
    assert g[("backward", "flash", "aten::_flash_attention_backward")] == [1, 0, 7.0]
    assert g[("optimizer", "elementwise", "aten::lerp_")] == [1, 48, 1.0]
