"""``memplan calibrate``: microbenchmarks on this machine's device, written to a GPU preset file that
``--gpu FILE`` takes (``memplan.measure.calibrate`` measures, ``memplan.time.calibration`` writes).
torch is imported inside the command only."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from memplan.cli.common import console, fail, plain, user_errors
from memplan.cli.measure import INSTALL, torch_available
from memplan.presets import gpu_text, load_gpu
from memplan.time.calibration import calibration, preset_text


def calibrate(
    gpu: Annotated[str, typer.Option("--gpu", help="The GPU preset of this machine's device (name or file)")],
    out: Annotated[Path, typer.Option("--out", help="The GPU file to write, e.g. my-h100.toml")],
    name: Annotated[
        str | None, typer.Option("--name", help=plain("Its name [default: the preset's + -calibrated]"))
    ] = None,
    nproc: Annotated[
        int | None,
        typer.Option("--nproc", min=2, help="Also time an all-reduce over N local ranks (one node's link)"),
    ] = None,
    small: Annotated[
        bool | None,
        typer.Option(
            "--small/--full", help=plain("CPU-sized benchmarks (a few seconds) [default: --small on CPU]")
        ),
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the measured fractions as one JSON object")
    ] = False,
) -> None:
    """Measure GEMMs, element-wise bandwidth, the eager element-wise chains, attention and the launch gap on
    this device and write a GPU file with them (a [calibrated] table) that the step time uses:
    `memplan estimate --gpu FILE`.

    Example: memplan calibrate --gpu h100-sxm --out my-h100.toml
    """
    with user_errors():
        base = load_gpu(gpu)
        text = gpu_text(gpu)
        if out.exists() and out.is_dir():
            raise ValueError(f"out: {out} is a folder; give a file name, e.g. --out {out / 'gpu.toml'}")
        if not torch_available():
            fail(INSTALL)
        if nproc is not None and nproc > base.topology.gpus_per_node:
            raise ValueError(
                f"nproc: {nproc} ranks leave {base.name}'s node of {base.topology.gpus_per_node}; calibrate "
                f"measures one node's link: --nproc ≤ {base.topology.gpus_per_node}"
            )
        from memplan.measure.calibrate import all_reduce_busbw, measure

        m = measure(small)
        busbw = all_reduce_busbw(nproc, small) if nproc else None
        c = calibration(
            base,
            m.matmul_flops,
            m.copy_bytes,
            m.attention_flops,
            m.launch_s,
            m.device,
            busbw,
            m.chains,
            m.attention_curve,
        )
        written = preset_text(text, name or f"{base.name}-calibrated", c)
        load_gpu_text_check(written, out)
    if as_json:
        typer.echo(json.dumps({"out": str(out), "calibrated": c.model_dump()}, allow_nan=False))
    else:
        console().print(
            f"{out}: matmul {c.matmul:.3g}, memory {c.memory:.3g}, attention {c.attention or 0:.3g} of "
            f"{base.name}'s peaks on {c.device}; use --gpu {out}"
        )


def load_gpu_text_check(text: str, out: Path) -> None:
    """Write ``text`` to ``out`` and read it back as a GPU preset (a one-line error if it does not load)."""
    try:
        out.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"out: cannot write {out} ({exc.strerror}); choose a writable path") from None
    load_gpu(str(out))


def register(app: typer.Typer) -> None:
    app.command()(calibrate)
