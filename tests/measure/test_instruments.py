"""Instruments: saved-tensor recorder, FLOP meter, live-memory tracker, CUDA peak helper.

Hand-computed byte counts use fp32 (4 B/element) unless said otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode, flop_registry, sdpa_backward_flop

from memplan.measure.instruments.record import (
    FlopMeter,
    NameTotal,
    SavedRecord,
    SavedTensorRecorder,
    label,
    layer_scope,
    note_kept,
    register_cpu_sdpa_formulas,
)
from memplan.measure.instruments.tracker import CudaPeak, LiveMemoryTracker, cuda_peak

aten = torch.ops.aten
B, H, S = 2, 16, 4  # batch, hidden, sequence


# ---------------------------------------------------------------------------------------------------------
# Saved-tensor recorder
# ---------------------------------------------------------------------------------------------------------


def _tiny_block() -> SavedTensorRecorder:
    """Linear → masked softmax → dropout, in layer 0; backward under pause. Deterministic shapes only."""
    torch.manual_seed(0)
    w = torch.randn(H, H, requires_grad=True)
    x = torch.randn(B, S, H, requires_grad=True)
    mask = torch.ones(S, H, dtype=torch.bool).tril()
    with SavedTensorRecorder([w]) as rec:
        with layer_scope(0):
            h = label(x * 1.0, "attn_norm.input")  # x * python float saves nothing
            q = label(F.linear(h, w), "attn.q")  # saves h (as a 2-D view) and w (a parameter)
            scores = q.masked_fill(mask, 0.0)  # saves the bool mask, unlabelled
            probs = label(torch.softmax(scores, -1), "attn.probs")  # saves its output
            out, keep = torch.native_dropout(probs, 0.1, True)  # saves a bool mask
            label(keep, "attn.dropout_mask")
        loss = out.sum()
        with rec.pause():
            loss.backward()
    return rec


def test_recorder_names_dedupes_views_and_excludes_parameters() -> None:
    rec = _tiny_block()
    fp32 = B * S * H * 4
    assert rec.records == [
        SavedRecord("attn_norm.input", 0, (B, S, H), "fp32", fp32),
        SavedRecord("unlabelled", 0, (S, H), "bool", S * H),  # unlabelled: the layer it was saved in
        SavedRecord("attn.probs", 0, (B, S, H), "fp32", fp32),
        SavedRecord("attn.dropout_mask", 0, (B, S, H), "bool", B * S * H),
    ]
    assert rec.by_name()["attn.probs"] == NameTotal(1, fp32)
    assert rec.total_bytes == 2 * fp32 + S * H + B * S * H
    assert rec.per_layer_bytes(0) == rec.total_bytes
    assert rec.per_layer_bytes(None) == 0


def test_recorder_view_and_base_count_once() -> None:
    x = torch.randn(4, 6, requires_grad=True)
    with SavedTensorRecorder() as rec:
        y = x.exp()  # saves its output y
        (y.view(6, 4).sin() + y.t().cos()).sum()  # saves two views of y
    assert rec.records == [SavedRecord("unlabelled", None, (4, 6), "fp32", 96)]


def test_a_saved_partial_view_counts_its_whole_storage() -> None:
    # Only a slice of y is saved, but its storage (all of y) stays alive: 4·6 fp32 = 96 bytes, not the
    # slice's 2·6·4 = 48 (issue #13 item 8: a recorder counting the view would undercount).
    x = torch.randn(4, 6, requires_grad=True)
    with SavedTensorRecorder() as rec:
        y = x * 2.0  # saves nothing (a Python scalar)
        y[:2].sin().sum()  # saves the view y[:2]
    assert rec.records == [SavedRecord("unlabelled", None, (2, 6), "fp32", 96)]


def test_forget_freed_drops_saves_on_a_discarded_branch() -> None:
    # max(dim) saves its [4, 1] int64 indices (32 B) on a node only `branch` holds; its values are read for
    # their shape only (zeros_like), so the node and its indices die when `branch` goes: saved, never kept.
    # The loss path's sin keeps its fp32 [4, 6] input (96 B) alive.
    x = torch.randn(4, 6, requires_grad=True)
    with SavedTensorRecorder() as rec:
        y = x * 2.0  # saves nothing (a Python scalar)
        branch = y.max(dim=-1, keepdim=True).values
        noise = torch.zeros_like(branch)
        loss = (y.sin() + noise).sum()
        del branch
        rec.forget_freed()
    assert rec.records == [SavedRecord("unlabelled", None, (4, 6), "fp32", 96)]
    assert loss.requires_grad


def test_recorder_excludes_parameter_views() -> None:
    w = torch.randn(3, 5, requires_grad=True)
    x = torch.randn(2, 3)  # needs no grad, so w's gradient needs x: x is saved
    with SavedTensorRecorder([w]) as rec:
        (x @ w).sum()
        (w.t() * 2.0).sum()
        torch.mm(w.t(), w).sum()  # saves w.t() and w: both excluded
    assert [r.shape for r in rec.records] == [(2, 3)]


def test_fake_tensor_mode_records_equal_real() -> None:
    real = _tiny_block().records
    with FakeTensorMode():
        fake = _tiny_block().records
    assert fake == real


def test_pause_and_first_label_wins() -> None:
    x = torch.randn(8, requires_grad=True)
    with SavedTensorRecorder() as rec:
        y = label(label(x.exp(), "first"), "second")
        with rec.pause():
            x.sin()  # would save x
        y.sum()
    assert [(r.name, r.shape) for r in rec.records] == [("first", (8,))]


def test_label_is_inert_without_recorder() -> None:
    x = torch.randn(3)
    assert label(x, "unused") is x
    assert note_kept(x) is x
    with SavedTensorRecorder() as rec:
        x.requires_grad_(True).exp()
    assert [r.name for r in rec.records] == ["unlabelled"]  # the earlier label did not leak in


def test_note_kept_for_non_reentrant_checkpoint() -> None:
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)
    with SavedTensorRecorder([w]) as rec:
        h = x * 3.0
        with layer_scope(5):
            y = checkpoint(
                lambda t: torch.tanh(t @ w).exp(), note_kept(h, "layer.input"), use_reentrant=False
            )
        note_kept(h)  # same storage again: still one record
        with rec.pause():
            y.sum().backward()  # recompute saves are not counted
    assert rec.records == [SavedRecord("layer.input", 5, (4, 8), "fp32", 128)]


# ---------------------------------------------------------------------------------------------------------
# FLOP meter
# ---------------------------------------------------------------------------------------------------------


def _qkv(b: int, a: int, kv: int, s: int, d: int) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    return tuple(torch.randn(b, n, s, d, requires_grad=True) for n in (a, kv, kv))


def _explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # GQA: broadcast kv heads
    probs = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, -1)  # [b, a, s, s]
    return probs @ v  # [b, a, s, d]


def _forward_backward_flops(fn: Callable[[], torch.Tensor]) -> dict[str, int]:
    with FlopMeter() as meter:
        with meter.phase("forward"):
            out = fn()
        with meter.phase("backward"):
            out.sum().backward()
    return meter.totals


@pytest.mark.parametrize(("a", "kv"), [(4, 4), (4, 2), (6, 1)])
def test_cpu_sdpa_counts_like_explicit_matmuls(a: int, kv: int) -> None:
    b, s, d = 2, 8, 16
    q, k, v = _qkv(b, a, kv, s, d)
    gqa = a != kv
    flash = _forward_backward_flops(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa))
    eager = _forward_backward_flops(lambda: _explicit_attention(q, k, v))
    assert flash["forward"] == eager["forward"] == 4 * b * a * s * s * d  # QKᵀ + PV, kv plays no part
    assert eager["backward"] == 8 * b * a * s * s * d  # dQ, dK, dP, dV
    assert flash["backward"] == 10 * b * a * s * s * d  # + recomputed QKᵀ


@pytest.mark.parametrize(("a", "kv", "is_causal"), [(4, 4, True), (8, 2, False)])
def test_cpu_sdpa_backward_matches_torch_cuda_formula(a: int, kv: int, is_causal: bool) -> None:
    b, s, d = 1, 12, 8
    q, k, v = _qkv(b, a, kv, s, d)
    flops = _forward_backward_flops(
        lambda: F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=a != kv)
    )
    cuda_formula = sdpa_backward_flop(q.shape, q.shape, k.shape, v.shape, out_val=None)  # dO has q's shape
    assert flops["backward"] == cuda_formula


def test_registration_is_idempotent_and_feeds_flop_counter_mode() -> None:
    register_cpu_sdpa_formulas()
    register_cpu_sdpa_formulas()
    assert aten._scaled_dot_product_flash_attention_for_cpu in flop_registry
    q, k, v = _qkv(1, 2, 2, 4, 8)
    with FlopCounterMode(display=False) as counter:
        F.scaled_dot_product_attention(q, k, v)
    assert counter.get_total_flops() == 4 * 1 * 2 * 4 * 4 * 8


def test_phases_nest_and_match_flop_counter_mode() -> None:
    w = torch.randn(32, 16, requires_grad=True)
    x = torch.randn(3, 5, 16)
    with FlopCounterMode(display=False) as counter:
        F.linear(x, w).sum().backward()
    with FlopMeter() as meter:
        with meter.phase("forward"):
            y = F.linear(x, w)  # 2·15·16·32
        with meter.phase("backward"):
            with meter.phase("recompute"):
                F.linear(x, w)
            y.sum().backward()  # dW only (x needs no grad): 2·15·16·32
        F.linear(x, w)  # outside any phase
    fwd = 2 * 15 * 16 * 32
    assert meter.totals == {"forward": fwd, "backward": fwd, "recompute": fwd, "unphased": fwd}
    assert meter.by_op["backward"] == {"aten.mm": fwd}
    assert meter.totals["forward"] + meter.totals["backward"] == counter.get_total_flops()


def test_flop_meter_under_fake_tensors() -> None:
    with FakeTensorMode():
        q, k, v = _qkv(2, 8, 2, 64, 32)
        flops = _forward_backward_flops(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    assert flops == {"forward": 4 * 2 * 8 * 64 * 64 * 32, "backward": 10 * 2 * 8 * 64 * 64 * 32}


# ---------------------------------------------------------------------------------------------------------
# Live memory
# ---------------------------------------------------------------------------------------------------------


def _chain() -> LiveMemoryTracker:
    """A chain whose live set is written next to each line (bytes)."""
    w = torch.zeros(256)  # 1024, created before the tracker: only counted through track()
    with LiveMemoryTracker() as mem:
        mem.track([w, w.view(16, 16)])  # 1024 (one storage)
        a = torch.ones(256)  # 2048
        b = a * 2  # 3072
        v = b.view(16, 16)  # view: 3072
        del a  # 2048
        c = torch.cat([v, w.view(16, 16)])  # +2048 = 4096 ← peak of "forward"
        mem.mark("forward")
        del b  # v still holds b's storage: 4096
        c.add_(1)  # in place: 4096
        del v  # 3072
        d = c.sum()  # +4 = 3076
        mem.mark("rest")
    del c, d  # frees keep being counted after exit: 1024
    return mem  # w dies with this frame: 0


@pytest.mark.parametrize("fake", [False, True])
def test_live_memory_exact_on_a_chain(fake: bool) -> None:
    if fake:
        with FakeTensorMode():
            mem = _chain()
    else:
        mem = _chain()
    assert mem.peak == 4096
    assert [(m.label, m.current, m.peak) for m in mem.marks] == [
        ("forward", 4096, 4096),
        ("rest", 3076, 4096),
    ]
    assert mem.current == 0


def test_live_memory_through_backward() -> None:
    with LiveMemoryTracker() as mem:
        x = torch.randn(64, requires_grad=True)  # 256
        y = x.exp()  # 512; exp saves its output y
        z = y.sum()  # 516
        del y  # still saved by autograd: 516
        mem.mark("forward")
        z.backward()  # ones_like seed 4 + x.grad 256 = 776; then y and the seed die
        mem.mark("backward")
    assert [(m.current, m.peak) for m in mem.marks] == [(516, 516), (516, 776)]
    assert x.grad is not None


class _FakeCuda:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.allocated = 1000

    def synchronize(self, device: int | None = None) -> None:
        self.calls.append("sync")

    def reset_peak_memory_stats(self, device: int | None = None) -> None:
        self.calls.append("reset")

    def memory_allocated(self, device: int | None = None) -> int:
        return self.allocated

    def max_memory_allocated(self, device: int | None = None) -> int:
        return 5000

    def memory_stats(self, device: int | None = None) -> dict[str, Any]:
        return {"reserved_bytes.all.peak": 6144, "num_alloc_retries": 1}


def test_cuda_peak_logic() -> None:
    api = _FakeCuda()
    with cuda_peak(0, api=api) as peak:
        api.calls.append("work")
    assert api.calls == ["sync", "reset", "work", "sync"]
    assert peak == CudaPeak(baseline=1000, peak=5000, reserved_peak=6144, alloc_retries=1)
    assert peak.peak_above_baseline == 4000
