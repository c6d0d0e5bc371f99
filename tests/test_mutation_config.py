"""The mutation run's configuration (scripts/mutation.sh, pyproject [tool.mutmut], docs/mutation.md) stays
runnable: what it mutates exists, the tests that judge mutants exist and stay torch-free (fast), and the
summary counts verdicts as mutmut defines them. The run itself is not part of the suite."""

from __future__ import annotations

import json
import os
import tomllib
from glob import glob
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def mutmut_config() -> dict[str, list[str]]:
    config: dict[str, list[str]] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]
    return config


def test_every_mutated_glob_names_source_files() -> None:
    config = mutmut_config()
    for pattern in config["only_mutate"]:
        assert any(pattern.startswith(src) for src in config["source_paths"]), pattern
        matched = [p for p in glob(str(ROOT / pattern)) if p.endswith(".py")]
        assert matched, f"{pattern} matches no Python file"


def test_selected_tests_exist_and_stay_torch_free() -> None:
    # Each mutant runs the selected tests that reach it; the measured (torch) tests take seconds each and
    # would not fit the run's time bound.
    for path in mutmut_config()["pytest_add_cli_args_test_selection"]:
        text = (ROOT / path).read_text()
        assert "import torch" not in text and "memplan.measure" not in text, path


def test_script_is_executable_and_results_are_ignored() -> None:
    script = ROOT / "scripts" / "mutation.sh"
    assert os.access(script, os.X_OK)
    assert "--max-children 1" in script.read_text()
    assert "mutants/" in (ROOT / ".gitignore").read_text().split()


def test_summary_counts_mutmuts_verdicts(tmp_path: Path) -> None:
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import mutation_summary as ms  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    # mutmut's exit codes (mutmut.stats.status_by_exit_code): 1 killed, 0 survived, 33 no tests, 36
    # timeout, None not yet checked.
    codes = {"a__mutmut_1": 1, "a__mutmut_2": 1, "a__mutmut_3": 0, "a__mutmut_4": 33, "a__mutmut_5": 36}
    codes["a__mutmut_6"] = None  # type: ignore[assignment]
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "x.py.meta").write_text(json.dumps({"exit_code_by_key": codes}))
    results = ms.read(tmp_path)
    assert results == {
        "m/x.py": {
            "a__mutmut_1": "killed",
            "a__mutmut_2": "killed",
            "a__mutmut_3": "survived",
            "a__mutmut_4": "no tests",
            "a__mutmut_5": "timeout",
            "a__mutmut_6": "not checked",
        }
    }
    from collections import Counter

    # 2 killed of 5 checked (the unchecked one is not counted; no tests and a timeout are not kills).
    assert ms.kill_rate(Counter(results["m/x.py"].values())) == pytest.approx(2 / 5)


def test_plugin_empties_memplans_memo_caches(monkeypatch: pytest.MonkeyPatch) -> None:
    import functools
    import sys
    import types

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import memplan_mutmut  # type: ignore[import-not-found]

    module = types.ModuleType("memplan._mutation_probe")

    @functools.lru_cache(maxsize=4)
    def square(x: int) -> int:
        return x * x

    square.__module__ = module.__name__
    module.square = square  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    square(3)
    assert square.cache_info().currsize == 1
    assert memplan_mutmut.clear_memplan_caches() >= 1
    assert square.cache_info().currsize == 0
    # mutmut's stats run (which test reaches which function) clears them before every test too; a
    # mutant's run (after its session start) does not.
    square(3)
    monkeypatch.setenv("MUTANT_UNDER_TEST", "memplan.x__mutmut_1")
    memplan_mutmut.pytest_runtest_setup(None)
    assert square.cache_info().currsize == 1
    monkeypatch.setenv("MUTANT_UNDER_TEST", "stats")
    memplan_mutmut.pytest_runtest_setup(None)
    assert square.cache_info().currsize == 0


def test_plugin_empties_the_pieces_dict_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    # memplan.pieces memoises whole estimates' pieces in a plain dict (_PIECES), beyond any cache_clear:
    # left full, a forked mutant run's estimate answers with the unmutated pieces (a false survivor).
    from tiny_setup import tiny_setup

    from memplan import pieces
    from memplan.engine import estimate

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import memplan_mutmut

    estimate(tiny_setup())
    assert pieces._PIECES
    memplan_mutmut.clear_memplan_caches()
    assert not pieces._PIECES
