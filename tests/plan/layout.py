"""The engine's estimate of a setup under a layout: the tests' shorthand."""

from __future__ import annotations

from memplan.config import Parallel, Setup
from memplan.engine import Result, estimate


def plan(setup: Setup, parallel: Parallel | None = None) -> Result:
    """``estimate`` of ``setup`` under the layout ``parallel`` (default: the setup's own)."""
    return estimate(setup if parallel is None else setup.model_copy(update={"parallel": parallel}))
