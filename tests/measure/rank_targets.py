"""Rank functions for tests/measure/test_rank_faults.py (a spawned process imports them by module name)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def _state(pid: int) -> str:
    """The process's state letter in /proc (``T``: stopped), ``""`` once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def stop_rank_1(rank: int, folder: str) -> None:
    """Record this rank's pid; rank 1 then stops itself (SIGSTOP), rank 0 waits as in a collective, once it
    has seen rank 1 stopped (``stopped`` written: the run's timeout came with a stopped rank)."""
    Path(folder, f"rank{rank}.pid").write_text(str(os.getpid()), encoding="ascii")
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    else:
        other = Path(folder, "rank1.pid")
        while not (other.exists() and other.read_text(encoding="ascii")):
            time.sleep(0.01)
        while _state(int(other.read_text(encoding="ascii"))) != "T":
            time.sleep(0.01)
        Path(folder, "stopped").write_text("", encoding="ascii")
    time.sleep(3600)


def describe(rank: int, folder: str) -> None:
    """Write what this rank sees: its environment's probe variable, whether torch was imported before this
    module ran (the fork server's preload), its SIGINT disposition and its parent."""
    import json
    import sys

    seen = {
        "probe": os.environ.get("MEMPLAN_RANK_PROBE"),
        "torch_preloaded": PRELOADED,
        "sigint_ignored": signal.getsignal(signal.SIGINT) is signal.SIG_IGN,
        "ppid": os.getppid(),
        "modules": "memplan.measure.distributed.nproc" in sys.modules,
    }
    Path(folder, f"rank{rank}.json").write_text(json.dumps(seen), encoding="ascii")


PRELOADED = "torch" in __import__("sys").modules
"""Whether torch was imported before this module (a spawned interpreter: no; a fork of the server: yes)."""
