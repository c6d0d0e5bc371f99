"""Step time, throughput and training days from FLOPs; MFU and HFU from a measured step time.

FLOPs of one step (B sequences = micro-batch × micro-batches × dp):
- model FLOPs, as MFU counts them: ``flops.model``, defined once in analytic/flops.py (forward + backward
  without any re-computation: the flash kernel's internal re-computation of S is not counted). For full
  training that is 3 × the forward (Korthikanti et al. 2022 App. A; PaLM App. B); for GPT with eager
  attention exactly Korthikanti's 72·B·L·s·h²·(1 + s/(6h) + v/(12hL)).
- hardware FLOPs, as HFU counts them: everything that runs, ``flops.total`` (recompute included).

Three ways to the step time, one of them per call:
- predicted (the default): ``predict.predict`` — compute per kernel class at its achievable fraction of
  peak, plus the communication that is not hidden, plus the pipeline bubble (docs/step-time.md);
- at an assumed MFU (``--mfu``): the devices run the model FLOPs and the checkpoint recompute
  (``flops.recompute``) at ``mfu × peak``, and a pipeline adds its 1F1B bubble, the fraction (p − 1)/(m·n)
  of the step for n micro-batches and m virtual stages (Narayanan et al. 2021 §2.2):

      step = (model + recompute) / (devices · peak · mfu) · (1 + (p − 1)/(m·n))

  so with neither recompute nor pipeline the achieved MFU is the assumed one (communication is part of
  what an MFU below 1 stands for);
- measured (``--step-time``): MFU = model / (time · devices · peak), HFU = hardware / (same); a step time
  shorter than model / (devices · peak), an MFU over 1, is refused (a mistyped time or a wrong layout) —
  under ``--fp8`` shorter than model / (devices · FP8 peak), every model FLOP at the FP8 peak (below).
The communication table (``comm``) comes with every basis.

Peak FLOP/s per device: the GPU preset's dense figure for the precision's compute dtype (bf16, fp16, or
plain fp32 for the fp32 recipe: PyTorch does not use TF32 for matmuls by default). Under ``--fp8`` too:
MFU and HFU stay against that 16-bit peak, as torchtitan reports them (its ``get_peak_flops``: "hardcoded
BF16 type peak flops", float8 runs included), so they can pass 1 where the float8 GEMMs run on the FP8
peak (``Timing.fp8_peak_flops_per_device``: about 2× the 16-bit one on the presets with FP8); a measured
step is refused only below every model FLOP at the FP8 peak, the fastest the devices could run it.

Known limitations (NB): the prediction's own (``predict``, ``comm``, ``compute``).
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict

from memplan.config import Precision, Setup
from memplan.engine import Result
from memplan.presets import GpuPreset
from memplan.time import async_tp, fp8, tp_overlap
from memplan.time.predict import Prediction, Unstaged, predict

SECONDS_PER_DAY = 86_400
MIN_MFU = 1e-6
"""The smallest ``--mfu`` taken: below a millionth of the peak the value is a mistype (``1e-320`` made
the step time overflow to infinity), not a measurement."""


class Timing(BaseModel):
    """One optimizer step of the whole job on ``devices`` devices."""

    model_config = ConfigDict(frozen=True, defer_build=True)  # built on first use (start-up)
    devices: int
    peak_flops_per_device: float
    """FLOP/s (dense, the precision's compute dtype): what MFU and HFU are against, ``--fp8`` too."""
    fp8_peak_flops_per_device: float | None
    """The dense FP8 FLOP/s ``--fp8``'s GEMMs run at (None without ``--fp8``): MFU, against the 16-bit
    peak, can pass 1 up to this over ``peak_flops_per_device`` (module docstring)."""
    global_batch: int
    tokens_per_step: int
    model_flops_per_step: int
    hardware_flops_per_step: int
    recompute_flops_per_step: int
    bubble: float
    """Pipeline bubble as a fraction of the busy time, (p − 1)/(m·n)."""
    step_time_s: float
    tokens_per_s: float
    mfu: float
    hfu: float
    assumed_mfu: float | None
    """The assumption the step time comes from (``--mfu``); None when predicted or measured."""
    basis: str
    """``predicted``, ``assumed`` (``--mfu``) or ``measured`` (``--step-time``)."""
    prediction: Prediction
    """The predicted step: its parts, and the communication table (whatever the basis)."""
    training_tokens: int | None
    training_days: float | None

    def to_json(self) -> dict[str, object]:
        out = self.model_dump(exclude={"prediction"})
        out["predicted"] = self.prediction.to_json()
        out["communication"] = out["predicted"].pop("communication")
        return out


def peak_flops(gpu: GpuPreset, precision: Precision) -> float:
    """Dense peak FLOP/s of one device for the recipe's matmul dtype."""
    tf = gpu.peak_tflops
    per_dtype = {
        Precision.BF16_MIXED: tf.bf16,
        Precision.BF16: tf.bf16,
        Precision.FSDP2_MIXED: tf.bf16,
        Precision.FP16_MIXED: tf.fp16,
    }
    return per_dtype.get(precision, tf.fp32) * 1e12


def bubble(p: Result) -> float:
    """1F1B bubble fraction (p − 1)/(m·n) (Narayanan et al. 2021 §2.2.1; interleaved §2.2.2)."""
    par = p.parallel
    return (par.pp - 1) / (par.vpp * p.micro_batches)


def assumed_seconds(p: Result, peak: float, mfu: float) -> float:
    """The step at an assumed ``mfu`` (module docstring): the model FLOPs and the checkpoint recompute of
    the whole job's micro-batches at ``mfu`` × ``peak`` on each of its devices, stretched by the bubble.
    It reads the FLOPs, the layout and the micro-batches, never the ZeRO stage (``search.mfu_bound``)."""
    per_step = p.micro_batches * p.setup.strategy.dp  # micro-batches of the whole job per step
    model, recompute = p.flops.model * per_step, p.flops.recompute * per_step
    return (model + recompute) / (p.devices * peak * mfu) * (1 + bubble(p))


def fp8_peak_flops(setup: Setup, gpu: GpuPreset) -> float | None:
    """The dense FP8 FLOP/s ``--fp8``'s GEMMs run at (``Timing.fp8_peak_flops_per_device``); None without
    ``--fp8``. ``ValueError`` where ``--fp8`` meets a GPU without FP8 (``fp8.peak``)."""
    return fp8.peak(setup, gpu) if fp8.enabled(setup) else None


def mfu_ceiling(setup: Setup, gpu: GpuPreset) -> float:
    """The most MFU a step can reach: 1, every model FLOP at the peak; under ``--fp8`` the FP8 peak over
    the 16-bit one, every model FLOP at the FP8 peak (module docstring)."""
    fp8_peak = fp8_peak_flops(setup, gpu)
    return 1.0 if fp8_peak is None else fp8_peak / peak_flops(gpu, setup.training.precision)


def check_time_inputs(
    mfu: float | None, step_time: float | None, tokens: float | None, ceiling: float = 1.0
) -> float | None:
    """The MFU the step time is to come from (None when predicted or measured); a one-line
    ``ValueError`` for a value out of range. ``ceiling``: the most MFU the step can reach
    (``mfu_ceiling``)."""
    if mfu is not None and step_time is not None:
        raise ValueError("mfu: give either --mfu (to estimate the step time) or --step-time (to measure MFU)")
    if step_time is not None and not (math.isfinite(step_time) and step_time > 0):
        raise ValueError(
            f"step-time: must be finite positive seconds, got {step_time}; e.g. --step-time 13.75"
        )
    assumed = mfu
    if assumed is not None and not MIN_MFU <= assumed <= ceiling:
        why = " (--fp8: up to its FP8 peak over the 16-bit one)" if ceiling != 1 else ""
        raise ValueError(f"mfu: must be in [{MIN_MFU:g}, {ceiling:g}]{why}, got {assumed}; e.g. --mfu 0.4")
    if tokens is not None and not (math.isfinite(tokens) and tokens >= 1):
        raise ValueError(f"tokens: must be a positive number of tokens, got {tokens}; e.g. --tokens 300e9")
    return assumed


def timing(
    p: Result,
    gpu: GpuPreset,
    *,
    mfu: float | None = None,
    step_time: float | None = None,
    tokens: int | None = None,
    shared: Unstaged | None = None,
) -> Timing:
    """Time of one step of plan ``p`` on ``gpu``: predicted, or from an assumed ``mfu`` or a measured
    ``step_time`` (s); ``gpu.topology`` places the communication.

    ``tokens``: a training budget to turn into days; ``shared``: ``predict.unstaged`` of a plan that differs
    from ``p`` in the ZeRO stage alone (the same answer, sooner). Raises ``ValueError`` for a non-positive
    input.
    """
    ceiling = mfu_ceiling(p.setup, gpu)
    assumed = check_time_inputs(mfu, step_time, tokens, ceiling)
    tp_overlap.check_node(p.setup, gpu.topology)
    async_tp.check_node(p.setup, gpu.topology)
    per_step = p.micro_batches * p.setup.strategy.dp  # micro-batches of the whole job per step
    model = p.flops.model * per_step
    recompute = p.flops.recompute * per_step
    hardware = p.flops.total * per_step
    peak = peak_flops(gpu, p.setup.training.precision)
    capacity = p.devices * peak
    b = bubble(p)
    predicted = predict(p, gpu, peak, shared)
    fp8_peak = fp8_peak_flops(p.setup, gpu)
    if assumed is not None:
        seconds, basis = assumed_seconds(p, peak, assumed), "assumed"
    elif step_time is not None:
        seconds, basis = step_time, "measured"
    else:
        seconds, basis = predicted.step_time_s, "predicted"
    if not (math.isfinite(seconds) and seconds > 0):  # a GPU file's extreme figures (gt=0, finite)
        raise ValueError(
            f"gpu: {gpu.name}'s figures give a step time of {seconds:g} s; check the GPU file's "
            "peak_tflops, hbm_bandwidth_gbps and topology bandwidths (finite GB/s and TFLOP/s)"
        )
    # every model FLOP at the devices' peak (MFU 1), under --fp8 at the FP8 peak (MFU the peaks' ratio)
    fastest = model / (capacity * ceiling)
    if basis == "measured" and seconds < fastest:
        achieved = model / (seconds * capacity)
        mfu_text = f"{achieved:,.0%}" if math.isfinite(achieved) else "unbounded"
        most = f"{ceiling:.0%} (its FP8 peak)" if fp8_peak else "100%"
        at = "at its FP8 peak" if fp8_peak else "at peak"
        raise ValueError(
            f"step-time: {seconds:.4g} s is faster than {p.devices} × {gpu.name} {at} "
            f"({fastest:.4g} s for this step's model FLOPs): MFU {mfu_text} > {most}; give the measured "
            f"seconds per optimizer step, at least --step-time {fastest:.6g}, or check --gpus and "
            "--global-batch"
        )
    tokens_per_step = p.global_batch * p.setup.training.seq_len
    rate = tokens_per_step / seconds
    return Timing(
        devices=p.devices,
        peak_flops_per_device=peak,
        fp8_peak_flops_per_device=fp8_peak,
        global_batch=p.global_batch,
        tokens_per_step=tokens_per_step,
        model_flops_per_step=model,
        hardware_flops_per_step=hardware,
        recompute_flops_per_step=recompute,
        bubble=b,
        step_time_s=seconds,
        tokens_per_s=rate,
        mfu=model / (seconds * capacity),
        hfu=hardware / (seconds * capacity),
        assumed_mfu=assumed,
        basis=basis,
        prediction=predicted,
        training_tokens=tokens,
        training_days=tokens / rate / SECONDS_PER_DAY if tokens is not None else None,
    )
