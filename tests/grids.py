"""Pairwise grids: every pair of two factors' values in some case, not every combination.

A family's exactness test crosses independent switches — the preset, the attention kernel, the
checkpointing, ``use_cache``, dropout — and the full product of five two-valued switches is 32 traces of
the same model. What such a test exists to catch is a switch the estimate models wrongly alone or in
combination with another (a kernel's saves under checkpointing, a cache kept with dropout): every value
of each switch, and every pair of values of two switches, is in at least one case of a pairwise covering
array, which ``pairwise`` builds (greedy, deterministic: the first case of the product order that covers
the most pairs not yet covered, so the product's first case — the defaults — always comes first). A
switch that interacts in threes would need its three-way combinations written out as cases of their own.

``MEMPLAN_FULL_GRIDS=1`` runs every such test on its whole product instead (e.g. before a release, or
after a change to a family's code): the same assertions, all combinations, some minutes longer. The
README's suite runs the covering arrays, which keeps it within its five minutes on two cores.
(tests/measure/test_matrix.py's nine axes, 6,144 combinations, stay pairwise either way.)
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Sequence
from typing import Any

import pytest

FULL = os.environ.get("MEMPLAN_FULL_GRIDS", "") == "1"


def pairwise(
    *axes: Sequence[Any], allowed: Callable[[tuple[Any, ...]], bool] | None = None
) -> list[tuple[Any, ...]]:
    """Cases (tuples, one value per axis, in ``axes``' order) covering every pair of values of every two
    axes that some ``allowed`` case holds (every case allowed without it); with fewer than three axes the
    (allowed) product itself, a pair of axes being its own product."""
    product = [c for c in itertools.product(*axes) if allowed is None or allowed(c)]
    if len(axes) < 3:
        return product
    index = [{v: k for k, v in enumerate(_keys(axis))} for axis in axes]

    def pairs(case: tuple[Any, ...]) -> frozenset[tuple[int, int, int, int]]:
        at = [index[i][_key(v)] for i, v in enumerate(case)]
        return frozenset((i, at[i], j, at[j]) for i, j in itertools.combinations(range(len(case)), 2))

    covers = [pairs(c) for c in product]
    todo = set().union(*covers)
    chosen: list[tuple[Any, ...]] = []
    while todo:
        best = max(range(len(product)), key=lambda k: len(covers[k] & todo))  # the first of the most
        chosen.append(product[best])
        todo -= covers[best]
    return chosen


def grid(*axes: Sequence[Any]) -> list[tuple[Any, ...]]:
    """``pairwise(*axes)``, or their whole product under ``MEMPLAN_FULL_GRIDS=1``."""
    return list(itertools.product(*axes)) if FULL else pairwise(*axes)


def _key(value: Any) -> Any:
    """A hashable stand-in for a value (a dict of fields, a list) to index it by."""
    return repr(value)


def _keys(axis: Sequence[Any]) -> list[Any]:
    keys = [_key(v) for v in axis]
    if len(set(keys)) != len(keys):
        raise ValueError(f"pairwise: an axis repeats a value: {list(axis)}")
    return keys


def pairwise_cases(argnames: str, *axes: Sequence[Any]) -> pytest.MarkDecorator:
    """``pytest.mark.parametrize(argnames, grid(*axes))``: one axis per comma-separated name."""
    return pytest.mark.parametrize(argnames, grid(*axes))
