"""Settings of the whole suite.

One OpenMP thread per torch process in a pytest-xdist worker: ``-n auto`` (pyproject.toml) starts one
worker per core already, and torch's default of one intra-op thread per core then runs two OpenMP teams
on each core, whose threads spin while they wait for each other (tests/measure/test_moe.py: milliseconds
per tiny matmul that way on a loaded 2-core machine). ``OMP_NUM_THREADS`` is read when torch loads its
OpenMP runtime, so it is set here, before any test module imports torch; the processes a test starts (the
ranks of ``profile --nproc``, the CLI in a subprocess) inherit it. ``-n 0`` keeps torch's default.

The cyclic collector, once the tests are collected: what collection imported (torch, transformers,
torchtitan, peft, the test modules) lives to the end of the run, so it is frozen out of every later
collection; the youngest generation is collected every 10,000 allocations (Python's default 700) and the
oldest after 100 collections of the middle one (default 10). A worker of the full suite spent 15.3 s of
its 257 s of tests in the collector, 11.5 s of it in full collections over that heap; so tuned, 7.3 s
(2.5 s full), the whole run 266 → 260 s on the 2-core machine (December 2026; the youngest at 700 kept:
10.8 s). Cycles are still collected, later; a serial run of 4 test files peaked 4 % higher at these
thresholds (1.31 → 1.37 GB, without the freeze).

Compiled bytecode kept: a machine that sets ``PYTHONDONTWRITEBYTECODE`` (this project's does) makes every
process of the run compile memplan's modules from source on import — each pytest-xdist worker and each
process a test starts (the ranks of ``profile --nproc``, the CLI in a subprocess, the packaging checks):
importing ``memplan.cli`` and ``memplan.measure.distributed.nproc`` took 4.2 s of CPU that way against 3.4 s
from ``__pycache__`` (idle machine). The variable is dropped here, before xdist starts its workers, so the
first process to import a module writes its ``.pyc`` beside it (git ignores ``__pycache__/``) and every
later one reads it: the whole suite 353 → 343 s on the 2-core machine (December 2026, same commit, the
``__pycache__`` folders removed before each run).

``MEMPLAN_JIT=auto`` (unless set): a worker runs hundreds of fit searches, the long-lived process that
``memplan.reserved``'s rent-or-buy policy is for (its replays in Python until they have spent the compiled
replay's load, then compiled; tests/plan/, test_verdict.py and test_layout.py serially took 72.4 s with
the replays in Python, 67.4 s compiled from the first). Both paths give the same answers
(tests/test_allocator_jit.py); tests that need one set it.
"""

from __future__ import annotations

import gc
import os
import sys

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if "torch" in sys.modules:  # imported before this file (a plugin): too late for the variable
        sys.modules["torch"].set_num_threads(1)

os.environ.setdefault("MEMPLAN_JIT", "auto")

if os.environ.pop("PYTHONDONTWRITEBYTECODE", None) is not None:
    sys.dont_write_bytecode = False  # this process too: the modules it imports from here on


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


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze what collection built and collect the oldest generation less often (module docstring)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 10, 100)
