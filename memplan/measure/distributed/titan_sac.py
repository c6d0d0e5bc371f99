"""torchtitan's ``SelectiveAC`` inside pipeline stages (``--impl torchtitan --pp P [--vpp M] --checkpointing
selective``): each block call's cache of saved op outputs held in ``pipeline.InFlightRecorder`` from the
call's forward until the cache lets its storage go.

torchtitan wraps each block in ``checkpoint_wrapper(context_fn=lambda:
create_selective_checkpoint_contexts(_get_custom_policy()))`` (``distributed/activation_checkpoint.py``
``SelectiveAC._wrap_block``): ``context_fn`` runs once per checkpoint call, so every micro-batch's forward of
a block gets a fresh policy — its own ``forward_mm_count`` / ``recompute_mm_count`` — and a fresh cache
(torch's ``_CachingTorchDispatchMode.storage``: op key → call index → the op's detached outputs). Under the
pipeline schedules a block runs several forwards before their backwards (1F1B's warm-up, the interleaved
schedule's chunks), each with its own counter and cache: the policy picks the same mm calls in each, and a
cache lives from its forward until its re-run consumes each entry (``_CachedTorchDispatchMode``: the entry
becomes ``_CONSUMED``) and the checkpoint's frame is dropped with that micro-batch's graph.

``hold_sac(blocks)`` wraps each block's ``context_fn`` to catch the cache it makes, and after each block
call's forward labels every cached tensor ``sac · <op>`` in the block's layer and holds its storage until
freed (``InFlightRecorder.hold(..., until_freed=True)``): the recorder's maximum then counts the caches of
every forward in flight, as autograd's saves of a non-checkpointed block are counted.

Known limitations:
- NB: the block's re-run saves during its backward (held by the checkpoint's recomputation hooks, not
  autograd's recorder) are not seen: the recorder's maximum is taken over the forward's holds, as the
  estimate's in-flight saves are (``checkpointing``'s NB on the peak).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

from memplan.measure.distributed.pipeline import InFlightRecorder
from memplan.measure.frameworks.titan import cached_tensors
from memplan.measure.instruments.record import _RECORDER, layer_scope


@contextmanager
def hold_sac(blocks: dict[int, Any]) -> Iterator[None]:
    """Each ``SelectiveAC`` block (layer index → ``CheckpointWrapper``) with its caches held per call in the
    active ``InFlightRecorder`` (module docstring); the blocks restored after."""
    latest: dict[int, Any] = {}
    saved: list[tuple[Any, Any]] = []
    handles = []
    for i, block in blocks.items():
        fn = block.checkpoint_fn  # partial(torch.utils.checkpoint.checkpoint, context_fn=..., ...)
        make = fn.keywords["context_fn"]

        def context_fn(make: Any = make, i: int = i) -> Any:
            modes = make()
            latest[i] = modes[0].storage  # this call's cache, filled by its forward
            return modes

        saved.append((block, fn))
        block.checkpoint_fn = partial(fn.func, *fn.args, **{**fn.keywords, "context_fn": context_fn})
        handles.append(block.register_forward_hook(partial(_hold_latest, latest, i)))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for block, fn in saved:
            block.checkpoint_fn = fn


def _hold_latest(latest: dict[int, Any], i: int, *_: Any) -> None:
    """After block ``i``'s forward: its call's cached tensors held until their storage is freed."""
    recorder = _RECORDER.get()
    storage = latest.pop(i, None)
    if not isinstance(recorder, InFlightRecorder) or storage is None:
        return
    with layer_scope(i):
        for name, t in cached_tensors(storage):
            recorder.label(t, name)
            recorder.hold(t, name, until_freed=True)
