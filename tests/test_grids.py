"""The pairwise grids the family tests run (``tests/grids.py``): every pair of two axes' values covered,
the defaults first, the whole product on request."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests import grids


@given(st.lists(st.integers(1, 4), min_size=1, max_size=5))
def test_every_pair_of_values_is_covered(sizes: list[int]) -> None:
    axes = [[f"{i}:{v}" for v in range(n)] for i, n in enumerate(sizes)]
    cases = grids.pairwise(*axes)
    assert cases[0] == tuple(axis[0] for axis in axes)
    assert len(set(cases)) == len(cases)
    for i, j in itertools.combinations(range(len(axes)), 2):
        assert {(c[i], c[j]) for c in cases} == set(itertools.product(axes[i], axes[j]))


def test_the_family_grids_are_smaller_than_their_products() -> None:
    """``each_case``'s axes (attention 2 × checkpointing 3 × cache 2 = 12): 6 cases, its pairs' least."""
    cases = grids.pairwise(["flash", "eager"], ["none", "full", "full-reentrant"], [True, False])
    assert len(cases) == 6
    assert len(grids.pairwise([0, 1], [0, 1], [0, 1], [0, 1])) == 6  # of 16


def test_full_grids_run_every_combination(monkeypatch: pytest.MonkeyPatch) -> None:
    assert grids.grid([0, 1], [0, 1], [0, 1]) == grids.pairwise([0, 1], [0, 1], [0, 1])
    monkeypatch.setattr(grids, "FULL", True)
    assert grids.grid([0, 1], [0, 1], [0, 1]) == list(itertools.product([0, 1], [0, 1], [0, 1]))


def test_only_allowed_cases_and_their_pairs() -> None:
    """A pair no allowed case holds is not asked for (test_matrix: reversible layers under checkpointing)."""
    cases = grids.pairwise([0, 1], [0, 1], [0, 1], allowed=lambda c: not (c[0] and c[1]))
    assert all(not (a and b) for a, b, _ in cases)
    assert {(c[0], c[2]) for c in cases} == {(0, 0), (0, 1), (1, 0), (1, 1)}


def test_unhashable_values_and_repeats() -> None:
    assert len(grids.pairwise([{"a": 1}, {}], [[1], [2]], [0, 1])) == 4
    with pytest.raises(ValueError, match="repeats"):
        grids.pairwise([0, 0], [1], [2])
