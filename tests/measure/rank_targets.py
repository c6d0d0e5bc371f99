"""Rank functions for tests/measure/test_rank_faults.py (a spawned process imports them by module name)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def stop_rank_1(rank: int, folder: str) -> None:
    """Record this rank's pid; rank 1 then stops itself (SIGSTOP), rank 0 waits as in a collective."""
    Path(folder, f"rank{rank}.pid").write_text(str(os.getpid()), encoding="ascii")
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(3600)
