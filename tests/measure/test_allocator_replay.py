"""Issue #22 item 1, the measured side: a recorded allocation stream fed through the allocator model.

On CPU the tracker (memplan/measure/instruments/tracker.py) records every storage's allocation and free in
order; on a
GPU the allocator's own history does (``_record_memory_history``, read by ``cuda_history_events``). The
replay of the recorded stream asks for exactly the bytes the tracker counted, so its requested peak is the
tracker's peak; the allocator model then adds what torch's allocator would have reserved.
"""

from __future__ import annotations

from memplan.analytic.allocator import Alloc, Free, replay
from memplan.api import Options, setup_of
from memplan.config import Device
from memplan.measure.instruments.tracker import cuda_history_events
from memplan.measure.runs.profile import StepRunner, cpu_tracking


def test_cuda_history_becomes_a_stream_of_requests() -> None:
    # A synthetic device trace: segment events are the allocator's decisions (left out); a block's
    # first free_requested frees it (its free_completed is ignored); an address is reused afterwards.
    trace = [
        {"action": "segment_alloc", "addr": 0, "size": 2 << 20},
        {"action": "alloc", "addr": 0, "size": 1000, "stream": 7},
        {"action": "alloc", "addr": 1024, "size": 24},
        {"action": "free_requested", "addr": 0, "size": 1000},
        {"action": "free_completed", "addr": 0, "size": 1000},
        {"action": "alloc", "addr": 0, "size": 512},
    ]
    events = cuda_history_events(trace)
    assert events == [Alloc(0, 1000, 7), Alloc(1, 24, 0), Free(0), Alloc(3, 512, 0)]


def test_the_tracked_step_replays_to_the_trackers_peak() -> None:
    setup = setup_of(Options(model="tiny", seq=32, precision="fp32", device=Device.CPU))
    runner = StepRunner(setup, "cpu")
    runner.step(lambda _: None, {})  # a first step: the optimizer's states exist, as in profile
    runner.opt.zero_grad()
    with cpu_tracking(runner) as tracker:
        runner.step(lambda _: None, {})
    r = replay(tracker.events)
    # requested bytes follow the tracker's count event by event: the same peak and the same end
    assert r.requested_peak == tracker.peak and r.requested == tracker.current
    sizes = [e.size for e in tracker.events if isinstance(e, Alloc)]
    assert r.allocated_peak >= r.requested_peak
    # the tiny model's tensors are all ≤ 1 MiB: small pool only, whole 2 MiB segments
    assert max(sizes) <= 1 << 20 and r.reserved_peak % (2 << 20) == 0
    assert r.reserved_peak == r.segments * (2 << 20) >= r.allocated_peak
