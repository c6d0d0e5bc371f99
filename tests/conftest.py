"""Settings of the whole suite.

One OpenMP thread per torch process in a pytest-xdist worker: ``-n auto`` (pyproject.toml) starts one
worker per core already, and torch's default of one intra-op thread per core then runs two OpenMP teams
on each core, whose threads spin while they wait for each other (tests/measure/test_moe.py: milliseconds
per tiny matmul that way on a loaded 2-core machine). ``OMP_NUM_THREADS`` is read when torch loads its
OpenMP runtime, so it is set here, before any test module imports torch; the processes a test starts (the
ranks of ``profile --nproc``, the CLI in a subprocess) inherit it. ``-n 0`` keeps torch's default.

``MEMPLAN_JIT=auto`` (unless set): a worker runs hundreds of fit searches, the long-lived process that
``memplan.reserved``'s rent-or-buy policy is for (its replays in Python until they have spent the compiled
replay's load, then compiled; tests/plan/, test_verdict.py and test_layout.py serially took 72.4 s with
the replays in Python, 67.4 s compiled from the first). Both paths give the same answers
(tests/test_allocator_jit.py); tests that need one set it.
"""

from __future__ import annotations

import os
import sys

if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if "torch" in sys.modules:  # imported before this file (a plugin): too late for the variable
        sys.modules["torch"].set_num_threads(1)

os.environ.setdefault("MEMPLAN_JIT", "auto")


def _build_the_cli_once() -> None:
    """typer's ``CliRunner.invoke`` converts the Typer app to its click group on every call
    (``typer.testing._get_command``, typer 0.29): 20–50 ms an invocation, a fifth to a half of a small
    ``memplan estimate`` run in the suite's thousands of invocations. The group is a definition built from
    the app's registered commands, which no test changes: built once per app here, as a process running
    ``memplan`` builds it once."""
    import functools

    import typer.testing

    typer.testing._get_command = functools.cache(typer.testing._get_command)  # type: ignore[attr-defined]


_build_the_cli_once()
