"""One spawn per world size for the tests of ``profile --nproc`` (tests/measure/test_distributed*.py; the
test of tensor with sequence parallelism keeps its own, the one CLI → ``launch`` → spawn the whole way).

Each spawned rank runs ``nproc._spawned`` — what ``launch`` runs in a rank — for every layout of its
world size in turn, each with its own rendezvous port, process group, mesh, model, optimizer and report
folder, so that the N processes start once per world size, not once per layout (forks of the worker's
fork server, which imported torch once: ``spawn.START_METHOD``). What the layouts of one batch share is
the Python process alone (imported modules, torch's caches); ``run_rank`` builds everything it measures
from the setup.

The tests reach the reports through the session fixture ``nproc_runs`` (tests/measure/conftest.py):
``reports(setup, nproc)`` for a direct launch, ``serve(monkeypatch)`` for the CLI, whose ``launch`` is
then answered from the batch after checking that the CLI asked for a setup of the batch, equal field by
field. A test that uses them carries ``xdist_group("nproc2")`` or ``("nproc4")`` (pyproject.toml's
``--dist loadgroup``): the tests of one batch run on one worker, which spawns it once.

NB: a rank that fails ends its whole batch: every test of that world size then errors with the rank's
last error line. A test run alone still spawns its whole batch (every layout below of its world size).
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from memplan.api import Options, setup_of
from memplan.config import Device, MoEConfig, Setup
from memplan.measure.distributed import nproc as dist_mod
from memplan.measure.distributed.launch.spawn import free_port, spawn_ranks
from memplan.measure.distributed.nproc import _spawned

SEQ = 32
N = 4  # micro-batches per step with a pipeline (grad_accum; 1F1B needs n ≥ p)
TIMEOUT_S = 300  # per layout: a loaded 2-core machine starts torch processes slowly; a hang still ends


def tiny(**layout: Any) -> Setup:
    """The tiny model at seq 32 in fp32 on CPU, as ``profile -m tiny --device cpu --seq 32 --precision
    fp32`` with ``layout``'s options builds it (``precision`` among them: that recipe instead)."""
    return setup_of(Options(model="tiny", seq=SEQ, device=Device.CPU, **{"precision": "fp32", **layout}))


def tiny_moe(**layout: Any) -> Setup:
    """``tiny`` with every MLP a mixture of 4 experts, top-2 (its experts' width the tiny model's ffn)."""
    setup = tiny(**layout)
    model = setup.model.model_copy(update={"moe": MoEConfig(experts=4, top_k=2)})
    return setup.model_copy(update={"model": model})


def layouts(nproc: int) -> list[Setup]:
    """Every layout the tests launch on ``nproc`` ranks (the tests that use them, in order)."""
    if nproc == 2:
        return [
            tiny(gpus=2, zero=3),  # test_distributed.py: zero3
            tiny(gpus=2, zero=1),  # test_distributed.py: zero1
            tiny(gpus=2, pp=2, grad_accum=N),  # test_distributed_pp.py: pp2
            tiny(gpus=2, zero=3, precision="fsdp2-mixed"),  # test_distributed.py: FSDP2's mixed precision
            tiny(gpus=2, zero=3, checkpointing="full"),  # test_distributed.py: checkpointing under FSDP2
            tiny(gpus=2, zero=1, reversible=True),  # test_distributed.py: reversible layers over dp
            tiny(gpus=2, pp=2, grad_accum=N, checkpointing="every-2"),  # test_distributed_pp.py
            tiny_moe(gpus=2, zero=3),  # test_distributed.py: a mixture of experts under FSDP2
            tiny(gpus=2, zero=3, fp8="tensorwise", precision="bf16-mixed"),  # test_distributed.py: float8
        ]
    if nproc == 4:
        return [
            tiny(gpus=4, tp=2, zero=3),  # test_distributed.py: tp_dp
            tiny(gpus=4, tp=2, zero=1),  # test_distributed.py: ZeRO-1 over tp ranks (CLI)
            tiny(gpus=4, pp=2, zero=3, grad_accum=N),  # test_distributed_pp.py: pp2_dp2 (CLI)
            tiny(gpus=4, tp=2, pp=2, grad_accum=N),  # test_distributed_pp_tp.py
            tiny(gpus=4, tp=2, zero=3, precision="fsdp2-mixed"),  # test_distributed.py: and DTensor's
            tiny(gpus=4, tp=2, sp=True, pp=2, grad_accum=N),  # test_distributed_pp.py: SP in the stages
        ]
    raise ValueError(f"nproc: no layouts on {nproc} ranks; add them to tests/measure/spawned.py")


def _port(folder: Path, rank: int) -> int:
    """This layout's rendezvous port: rank 0 picks a free one just before its store listens on it (as
    ``launch`` does in the parent) and publishes it in ``folder``; the other ranks read it there."""
    file = folder / "port"
    if rank == 0:
        port = free_port()
        (folder / "port.tmp").write_text(str(port), encoding="ascii")
        (folder / "port.tmp").replace(file)  # whole or absent: a rename
        return port
    deadline = time.monotonic() + TIMEOUT_S
    while not file.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: no rendezvous port from rank 0 in {folder}")
        time.sleep(0.01)
    return int(file.read_text(encoding="ascii"))


def run_layouts(rank: int, world: int, setups: list[Setup], out: str) -> None:
    """A spawned rank: ``_spawned`` (init, ``run_rank``, its report, destroy) for each layout in turn."""
    for i, setup in enumerate(setups):
        folder = Path(out, str(i))
        _spawned(rank, world, _port(folder, rank), setup, False, str(folder))


def launch_all(setups: list[Setup], nproc: int) -> list[list[dict[str, Any]]]:
    """Every rank's report of every setup (rank order within each), from one spawn of ``nproc`` ranks."""
    with tempfile.TemporaryDirectory(prefix="memplan-nproc-") as out:
        for i in range(len(setups)):
            Path(out, str(i)).mkdir()
        spawn_ranks(run_layouts, (nproc, setups, out), nproc, TIMEOUT_S * len(setups), out)
        return [
            [json.loads(Path(out, str(i), f"rank{r}.json").read_text(encoding="utf-8")) for r in range(nproc)]
            for i in range(len(setups))
        ]


class Runs:
    """The batches launched so far, by world size, each launched when a test first asks for it."""

    def __init__(self) -> None:
        self._batches: dict[int, list[tuple[Setup, list[dict[str, Any]]]]] = {}

    def reports(self, setup: Setup, nproc: int) -> list[dict[str, Any]]:
        """What ``launch(setup, nproc)`` returns: every rank's report, rank order."""
        if nproc not in self._batches:
            setups = layouts(nproc)
            self._batches[nproc] = list(zip(setups, launch_all(setups, nproc), strict=True))
        for launched, reports in self._batches[nproc]:
            if launched == setup:
                return reports
        raise AssertionError(f"not among the layouts launched on {nproc} ranks: {setup!r}")

    def serve(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """The CLI's ``launch`` answered from the batches (the setup it asks for must be one of them)."""

        def launch(setup: Setup, nproc: int, cuda: bool = False, **_: Any) -> list[dict[str, Any]]:
            assert cuda is False
            return self.reports(setup, nproc)

        monkeypatch.setattr(dist_mod, "launch", launch)
