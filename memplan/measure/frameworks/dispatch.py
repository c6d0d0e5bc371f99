"""Which framework runner traces a setup (``--impl hf``, ``--impl torchtitan``): the top of the frameworks
room, so that the runners import only the shared step (``frameworks.step``), never this dispatcher."""

from __future__ import annotations

from collections.abc import Callable

from memplan.config import Impl, Setup
from memplan.measure.instruments.measured import Measured


def check_traceable(setup: Setup) -> Callable[[Setup], Measured]:
    """The function that runs ``setup.impl``'s own code (``measure_hf``, ``measure_titan``), after its
    one-line errors (a framework not runnable here, or not installed)."""
    impl = setup.impl.impl
    if impl is Impl.HF:
        from memplan.measure.frameworks.hf import check_peft, measure_hf
        from memplan.measure.frameworks.hf_config import require_transformers

        require_transformers()
        check_peft(setup)
        return measure_hf
    if impl is Impl.TORCHTITAN:
        from memplan.measure.frameworks.titan import check_titan, measure_titan

        check_titan(setup)
        return measure_titan
    raise ValueError(
        f"impl: trace --impl {impl.value} is not runnable here; trace --impl hf runs transformers' code, "
        "--impl torchtitan torchtitan's Llama, trace (--impl reference) memplan's reference model"
    )
