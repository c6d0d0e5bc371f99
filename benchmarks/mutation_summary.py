"""Summarise the last mutmut run (scripts/mutation.sh): mutants per status, per mutated file, the kill rate
and the surviving mutants' names (``mutmut show NAME`` prints one's diff). Reads mutants/**/*.meta, which
mutmut writes as it goes, so a run cut short by its time bound is summarised as far as it got.

Kill rate = killed / checked, where checked counts every mutant given a verdict: a mutant no selected test
reaches ("no tests") or that timed out counts as not killed.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

# mutmut's own exit-code → verdict table (mutmut.stats.status_by_exit_code), restated so this reads the
# results without importing mutmut (which loads its configuration at import).
STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests", 34: "skipped"}
TIMEOUTS = {36, -24, 24, 152, 255}
NOT_CHECKED = {None, 2}


def status(code: int | None) -> str:
    if code in NOT_CHECKED:
        return "not checked"
    if code in TIMEOUTS:
        return "timeout"
    return STATUS.get(code, "suspicious") if code is not None else "not checked"


def read(root: Path) -> dict[str, dict[str, str]]:
    """{mutated file: {mutant name: status}}."""
    out: dict[str, dict[str, str]] = {}
    for meta in sorted(root.rglob("*.py.meta")):
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        source = str(meta.relative_to(root))[: -len(".meta")]
        out[source] = {name: status(code) for name, code in codes.items()}
    return out


def kill_rate(counts: Counter[str]) -> float | None:
    checked = sum(n for s, n in counts.items() if s not in ("not checked", "skipped"))
    return counts["killed"] / checked if checked else None


def summary(results: dict[str, dict[str, str]]) -> str:
    lines = [f"{'file':<40} {'mutants':>7} {'killed':>7} {'survived':>8} {'no tests':>8} {'other':>6}"]
    total: Counter[str] = Counter()
    for source, by_name in results.items():
        c = Counter(by_name.values())
        total += c
        other = sum(n for s, n in c.items() if s not in ("killed", "survived", "no tests"))
        counts = f"{len(by_name):>7} {c['killed']:>7} {c['survived']:>8} {c['no tests']:>8} {other:>6}"
        lines.append(f"{source:<40} {counts}")
    rate = kill_rate(total)
    lines.append(f"total: {dict(sorted(total.items()))}")
    rate_text = "n/a (nothing checked)" if rate is None else f"{rate:.1%} of checked mutants"
    lines.append(f"kill rate: {rate_text}")
    not_killed = ("survived", "no tests")
    survivors = [n for by_name in results.values() for n, s in by_name.items() if s in not_killed]
    lines.append(f"not killed ({len(survivors)}):")
    lines.extend(f"  {n}" for n in survivors)
    return "\n".join(lines)


def main() -> int:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "mutants")
    if not root.is_dir():
        print(f"{root}: no mutmut results; run scripts/mutation.sh first", file=sys.stderr)
        return 2
    print(summary(read(root)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
