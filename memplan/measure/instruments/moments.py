"""The measured curve read at the estimate's timeline points (``memplan.timeline``), for ``profile
--timeline`` and ``--plot``: which stretch of the measured step each estimated point stands for.

The curve (``tracker.Curve``) carries the step's boundaries, noted by ``profile.StepRunner.step``: "start"
(a micro-batch begins), "forward i" (layer i's forward done), "forward" (the loss is computed), then when an
output gradient is ready, i.e. that block's backward begins: "backward lm_head" (the logits'), "backward
final_norm", "backward i" (layer i's; last to first), "backward embedding"; and the ends "backward" and
"optimizer step". Each estimated point is read from the last micro-batch:

- "forward: start", "forward: n/L layers", "forward: end": the live bytes at that boundary;
- "forward: layer n/L peak": the highest point of layer n's forward (from layer n − 1's boundary);
- "loss forward" (the chunked loss's forward, where modelled): as "forward: loss", the highest point from
  the last layer's forward to the forward's end;
- "loss backward": the highest point from the forward's end to "backward lm_head";
- "lm head backward" (where modelled): from "backward lm_head" to "backward final_norm";
- "final norm backward": the highest point from "backward final_norm" to the last layer's backward;
- "layer backward": the highest point over the layers' backward (to "backward embedding");
- "embedding backward": the highest point from there to the backward's end;
- "optimizer step": the highest point of the optimizer step.

The point taken is the stretch's highest (its sample index is where the plot puts the estimate). A point
whose boundaries were not noted reads None: checkpointed segments' forward points, and with reversible
layers (which note no layer boundary) the forward's layer points and the final norm's backward (its
stretch is read as part of the layers').
Pure Python (no torch): the curve is plain lists.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from memplan.measure.instruments.tracker import Curve

Reading = tuple[int, int] | None
"""(sample index, live bytes) on the measured curve, or None where the curve has no such stretch."""

_LAYERS = re.compile(r"forward: (\d+)/\d+ layers$")
_LAYER_PEAK = re.compile(r"forward: layer (\d+)/\d+ peak$")


def _highest(samples: Sequence[int], start: int | None, end: int | None) -> Reading:
    if start is None or end is None or end < start:
        return None
    i = max(range(start, end + 1), key=samples.__getitem__)
    return i, samples[i]


_FORWARD_NOTE = re.compile(r"forward \d+$")
"""A layer's forward note (``StepRunner.step``: "forward i" after layer i)."""


def read_points(curve: Curve, labels: Sequence[str]) -> list[Reading]:
    """The measured curve at each of ``labels`` (``memplan.timeline`` point labels), in order."""
    starts = [at for name, at in curve.notes if name == "start"]
    notes = [(name, at) for name, at in curve.notes if not starts or at >= starts[-1]]
    at = dict(notes)
    layer_bwd = [i for name, i in notes if name.startswith("backward ") and name[9:].isdigit()]
    fwd, bwd, opt = at.get("forward"), at.get("backward"), at.get("optimizer step")
    loss_end, head = at.get("backward lm_head", fwd), at.get("backward final_norm", fwd)
    embedding = at.get("backward embedding", bwd)
    first_layer = min(layer_bwd, default=embedding)
    last_forward = max((i for name, i in notes if _FORWARD_NOTE.match(name)), default=at.get("start"))
    s = curve.samples

    def read(label: str) -> Reading:
        if label == "forward: start":
            i = at.get("start")
        elif label == "forward: end":
            i = fwd
        elif m := _LAYERS.match(label):
            i = at.get(f"forward {int(m.group(1)) - 1}")
        elif m := _LAYER_PEAK.match(label):  # layer n's forward: from the boundary before it to its own
            n = int(m.group(1))
            return _highest(
                s, at.get("start") if n == 1 else at.get(f"forward {n - 2}"), at.get(f"forward {n - 1}")
            )
        elif label in ("forward: loss", "loss forward"):  # the head and the loss, after the last layer
            return _highest(s, last_forward, fwd)
        elif label == "loss backward":
            return _highest(s, fwd, loss_end)
        elif label == "lm head backward":
            return _highest(s, loss_end, head)
        elif label == "final norm backward":  # not apart from the layers' when they note nothing
            return _highest(s, head, first_layer) if layer_bwd else None
        elif label == "layer backward":
            return _highest(s, first_layer if layer_bwd else head, embedding)
        elif label == "embedding backward":
            return _highest(s, embedding, bwd)
        elif label == "optimizer step":
            return _highest(s, bwd, opt)
        else:
            i = None
        return None if i is None else (i, s[i])

    return [read(label) for label in labels]


def estimated_moments(est: Any) -> dict[str, int]:
    """The estimate's moments of forward and backward (``analytic.peak``), each less its ``optimizer``
    term: a measured step that builds no optimizer holds none of its states (and its master copy, where
    the recipe keeps one, is constant through forward and backward); the optimizer step's moment left out.
    Read against ``read_points`` by the torchtitan ranks' and transformers' peak runs."""
    return {
        name: sum(parts.values()) - parts["optimizer"]
        for name, parts in est.peak.moments.items()
        if name != "optimizer step"
    }


def moment_rows(estimated: dict[str, int], measured: dict[str, int | None]) -> list[dict[str, Any]]:
    """Each of ``estimated``'s moments beside its ``measured`` reading (None: the curve has no such stretch)
    and their difference: the ``moments`` of ``trace``'s ``peak`` and ``step_peak``."""
    rows = []
    for name, value in estimated.items():
        got = measured.get(name)
        rows.append(
            {
                "moment": name,
                "estimated": value,
                "measured": got,
                "delta": None if got is None else got - value,
            }
        )
    return rows
