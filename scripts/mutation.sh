#!/usr/bin/env bash
# Mutation testing of the estimate's core with mutmut 3 (docs/mutation.md has the last run's kill rate and
# every survivor explained). Configuration: pyproject.toml [tool.mutmut] — which modules are mutated and
# which fast, torch-free tests judge each mutant.
#
#   scripts/mutation.sh [MINUTES]
#
# MINUTES (default 25) bounds the run's wall time; the verdicts found by then are in mutants/ (delete it for
# a fresh run). To mutate fewer modules, edit only_mutate: runs narrowed by mutant names stop at mutmut's
# clean-test step here (docs/mutation.md). One worker: the machine is shared. The summary is printed at the
# end and written to mutants/summary.txt (python benchmarks/mutation_summary.py reads mutants/ at any time).
set -euo pipefail
cd "$(dirname "$0")/.."
minutes="${1:-25}"
# mutmut imports the mutated copy in mutants/; a PYTHONPATH naming a checkout would shadow it. scripts/
# holds the pytest plugin (memplan_mutmut.py) that clears memplan's memo caches in each mutant's run.
export PYTHONPATH="$PWD/scripts${MUTATION_PYTHONPATH:+:$MUTATION_PYTHONPATH}"
# The mutated tree reads its own presets (memplan/_presets → ../presets, as the checkout's; also_copy brings
# presets/). Without the link memplan._presets resolves through the editable install, possibly to another
# checkout whose presets this code does not accept.
mkdir -p mutants/memplan && ln -sfn ../presets mutants/memplan/_presets
timeout --signal=INT "$((minutes * 60))" python -m mutmut run --max-children 1 || true
python benchmarks/mutation_summary.py | tee mutants/summary.txt
