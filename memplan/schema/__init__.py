"""The published JSON Schemas of memplan's ``--json`` outputs (``memplan schema [--command NAME]``).

- estimate.py — ``estimate --json``'s (``estimate_schema``, ``contract_keys``: the contract of
  docs/architecture.md), built from parts.py (the number types, ``obj``), settings.py (``setup``, typed from
  the config fields) and fit_time.py (``verdict``, ``fit``, ``time``, ``host_fit``, ``timeline``);
- commands.py — every command's (``command_schema``), each holding the estimate's under ``$defs.estimate``.

Pure Python, no torch; loaded by ``memplan schema`` and the tests only. Known limitations: see each module
(JSON Schema cannot state the sums between keys; tests/test_properties.py checks them).
"""

from memplan.schema.commands import COMMANDS, command_schema
from memplan.schema.estimate import SCHEMA_ID, contract_keys, estimate_schema
from memplan.schema.parts import SCHEMA_DRAFT

__all__ = ["COMMANDS", "SCHEMA_DRAFT", "SCHEMA_ID", "command_schema", "contract_keys", "estimate_schema"]
