"""pytest plugin for the mutation run only (scripts/mutation.sh loads it): each mutant's tests start from
empty memo caches.

mutmut forks every mutant's test run from a process that has already run the whole test selection once
(to learn which tests reach which function). memplan memoises its pieces (``functools`` caches in
engine.py and analytic/), so a forked run would get the unmutated code's cached answers and every mutant
of a memoised function would survive unseen. Clearing them at session start makes the mutant run.

The same caches hide who calls what when mutmut first runs the selection to learn which tests reach which
function (its "stats" run, ``MUTANT_UNDER_TEST=stats``): a function a memoised estimate calls is recorded
for the first test that computes the estimate only, and each of its mutants is then judged by that test
alone. In the stats run the caches are therefore also cleared before every test, so each test is recorded
against every function its estimates call.
"""

from __future__ import annotations

import os
import sys
from typing import Any


def clear_memplan_caches() -> int:
    """Clear every ``functools`` cache held by a module-level name in memplan, and call each memplan
    module's own ``clear_caches()`` (``memplan.pieces`` memoises the pieces in a plain dict, ``_PIECES``,
    which no ``cache_clear`` reaches); how many were cleared."""
    cleared = 0
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "memplan" or name.startswith("memplan.")):
            continue
        for attr, value in list(vars(module).items()):
            clear = getattr(value, "cache_clear", None)
            if callable(clear) and getattr(value, "__module__", None) == name:
                clear()
                cleared += 1
            elif attr == "clear_caches" and callable(value) and getattr(value, "__module__", None) == name:
                value()
                cleared += 1
    return cleared


def pytest_sessionstart(session: Any) -> None:
    clear_memplan_caches()


def pytest_runtest_setup(item: Any) -> None:
    if os.environ.get("MUTANT_UNDER_TEST") == "stats":
        clear_memplan_caches()
