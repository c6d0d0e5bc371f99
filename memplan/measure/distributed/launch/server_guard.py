"""Imported first by the ranks' fork server (``spawn.PRELOAD``): the server dies with the process that
started it, even by SIGKILL, and its ranks with it.

multiprocessing's fork server exits only when every holder of its "alive" pipe's write end is gone, and
each process it forks is handed one (multiprocessing/forkserver.py ``connect_to_new_process``: "all client
processes own the write end"): a rank kept it running after its caller died, and a rank's own
``PR_SET_PDEATHSIG`` (``spawn._die_with_parent``), tied to the server, never fired. So the server asks the
kernel for SIGKILL when its starter dies (``prctl(PR_SET_PDEATHSIG)``, Linux) before it imports torch; the
ranks then follow it. ``STARTER`` names the starter's pid in the server's environment (set around the
server's start by ``spawn._fork_server``): a starter that died before the ``prctl`` ends the server at
once. Torch-free: it runs before the server's other imports.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from contextlib import suppress

STARTER = "MEMPLAN_FORK_SERVER_STARTER"
"""The environment variable that holds the fork server's starter's pid while it starts."""


def guard() -> None:
    """SIGKILL this process when its parent dies; exit now if the starter is already gone."""
    starter = os.environ.pop(STARTER, None)
    if starter is None:  # imported elsewhere than in a fork server memplan started
        return
    if sys.platform.startswith("linux"):
        with suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    if os.getppid() != int(starter):  # the starter died before the prctl
        os._exit(1)


guard()
