"""torchrun's environment, read without importing torch (the CLI asks before it loads torch)."""

from __future__ import annotations

import os

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""What torchrun sets in each process it starts."""


def torchrun_world() -> int | None:
    """The world size when this process was started by torchrun (or a launcher setting its environment),
    else None: ``--nproc`` may then be left out (torchrun's own ``--nproc-per-node`` swallows ``--nproc``
    as an abbreviation of itself when it follows the script)."""
    if not all(k in os.environ for k in TORCHRUN_ENV):
        return None
    return int(os.environ["WORLD_SIZE"])
