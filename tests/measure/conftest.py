"""Fixtures of tests/measure: the spawned ``profile --nproc`` batches (tests/measure/spawned.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.measure.spawned import Runs


@pytest.fixture(scope="session")
def nproc_runs() -> Runs:
    """Every layout of a world size launched by one spawn, when a test first asks for that world size."""
    from tests.measure.spawned import Runs

    return Runs()
