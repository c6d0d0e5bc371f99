"""What ``fit`` searches beyond the layout: the fine-tuning method and the memory savers.

Methods (``--method full,lora,qlora``; ``config.finetune.Method``, ordered by the model-state memory they
save): full training, LoRA on a frozen 16-bit base, QLoRA on a 4-bit base. Without ``--method`` the search
starts at the method the user names (``--finetune``, full by default) and goes on to the next ones only
when it does not fit without a saver (offload, a fused loss): the cheapest way that fits.

Savers, in the order they cost time (each level adds to the one before; ``SAVERS``):
  0. nothing: everything on the device, the standard loss;
  1. the fused linear cross-entropy (Liger): no fp32 log-probs [T, v] kept; no extra time (its backward
     matmuls run in the forward);
  2. + ZeRO-Offload (optimizer states, master weights and gradients on the host; the step on the CPU);
  3. + parameter offload (ZeRO-Infinity / FSDP2 CPU offload: ZeRO-3 only);
  4. + activation offload (``save_on_cpu``: without checkpointing only).
Offload (levels 2–4) is searched only when the node's host memory is known (the GPU preset's
``host_memory_gib`` or ``--host-memory``): the host must hold what the devices offload; and when the GPU
preset states what times it (``time.offload.untimed``: the host link, the host memory's bandwidth).
A family is searched at the lowest level at which its method fits anything: level k + 1 is tried only
when level k fits nothing. Fine-tuning (LoRA, QLoRA) runs at levels 0 and 1 (the fused loss) on
data-parallel layouts only: memplan models it without tensor, pipeline or context parallelism or offload
(``config.finetune_rules.check_finetune``).

Configurations are ranked by method, then saver level, then predicted throughput (``Config.sort_key``): a
saver is used only when it is needed, though the step time counts what it costs (offload's host-link
copies and the CPU optimizer step, ``time.offload``). A method that fits nothing says which levels were
searched (``Outcome.levels``: fine-tuning's level 0 alone; offload's only with the node's host memory).
A method memplan models on no layout of the model with the user's options (``refusal``: QLoRA with a
mixture of experts, or under ``--impl hf`` a family whose adapters it does not list) is not
searched: the summary names it with the reason (``Outcome.refused``), and when every method asked is
refused the command is a one-line error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memplan.blocks.profiles import profile_of
from memplan.config import (
    FINETUNE_OPTIONS,
    Checkpointing,
    FineTune,
    FsdpWrap,
    ImplConfig,
    LossKind,
    Method,
    MethodChoice,
    Offload,
    Setup,
    finetune_from,
    loss_label,
    offload_label,
)
from memplan.config.setup import check_setup


@dataclass(frozen=True)
class Saver:
    """One level of memory savers: what is offloaded to the host and which loss runs."""

    offload: Offload
    loss: LossKind

    def label(self) -> str:
        parts = [] if self.offload is Offload.NONE else [f"offload {offload_label(self.offload)}"]
        if self.loss is not LossKind.STANDARD:
            parts.append(f"{loss_label(self.loss, 1)} loss")
        return ", ".join(parts) or "none"


_OPT, _PAR, _ACT = Offload.OPTIMIZER, Offload.PARAMS, Offload.ACTIVATIONS
SAVERS: tuple[Saver, ...] = (
    Saver(Offload.NONE, LossKind.STANDARD),
    Saver(Offload.NONE, LossKind.FUSED),
    Saver(_OPT, LossKind.FUSED),
    Saver(_OPT | _PAR, LossKind.FUSED),
    Saver(_OPT | _PAR | _ACT, LossKind.FUSED),
)
"""The saver levels, cheapest in time first (module docstring)."""


def parse_methods(text: str | None) -> tuple[Method, ...] | None:
    """``--method full,lora,qlora`` → the methods in their order; None when not given."""
    if text is None:
        return None
    names = [part.strip().lower() for part in text.split(",") if part.strip()]
    choices = ", ".join(m.value for m in MethodChoice)
    if not names:
        raise ValueError(f"method: give one or more of {choices}, e.g. --method full,lora,qlora")
    out = set()
    for name in names:
        try:
            out.add(MethodChoice(name).method)
        except ValueError:
            raise ValueError(f"method: unknown method {name!r}; use some of {choices}") from None
    return tuple(sorted(out))


def finetunes(
    named: Method,
    methods: tuple[Method, ...] | None,
    given: dict[str, Any],
    double_quant: bool,
    setup: Setup,
) -> tuple[tuple[FineTune, ...], bool]:
    """The ``FineTune`` of each method to search, in order, and whether the search escalates (goes on to the
    next method only while the earlier ones need savers or do not fit: no ``--method``). ``given``: the
    user's fine-tuning options by name (``FINETUNE_OPTIONS``); each method takes the ones it understands."""
    order = methods if methods is not None else tuple(m for m in Method if m >= named)
    compute = setup.training.precision.activation_dtype
    out = []
    for method in order:
        own = {
            name: value
            for name, value in given.items()
            if name in FINETUNE_OPTIONS and _understands(method, name) and value is not None
        }
        out.append(finetune_from(method, own, double_quant and method is Method.QLORA, compute))
    return tuple(out), methods is None


def _understands(method: Method, option: str) -> bool:
    """Whether ``--finetune <method>`` takes ``option`` (``config.finetune.finetune_from``'s rules)."""
    if option in ("quant", "double_quant"):
        return method is Method.QLORA
    if option == "freeze":
        return True
    return method >= Method.LORA


def with_method(setup: Setup, ft: FineTune, saver: Saver) -> Setup:
    """``setup`` training with ``ft`` and ``saver`` (not validated: ``valid`` says whether it may run)."""
    return setup.model_copy(update={"finetune": ft, "offload": saver.offload, "loss": saver.loss})


def layout_free_impl(impl: ImplConfig) -> ImplConfig:
    """``impl`` without the switches that need a layout (``--fp8-all-gather``, ``--fsdp-wrap root``: ZeRO-3
    over data-parallel ranks; ``--fp8-tp``, ``--tp-comm-overlap``, ``--async-tp``: tp with sp;
    ``--fp8-param-gather``: the distributed optimizer; ``config.impl_rules``): what a search's base (one
    device) is built and judged with; each family is judged with them (``valid``), so the search keeps the
    layouts that run them."""
    return impl.replaced(
        fp8_all_gather=False,
        fsdp_wrap=FsdpWrap.UNITS,
        fp8_tp=False,
        tp_comm_overlap=False,
        async_tp=False,
        fp8_param_gather=False,
    )


def layout_free(setup: Setup) -> Setup:
    """``setup`` with ``layout_free_impl``."""
    return setup.replaced(impl=layout_free_impl(setup.impl))


def valid(setup: Setup) -> bool:
    """Whether memplan models this combination: the ``Setup`` validator's rules (without a copy) and the
    implementation's own refusals, which its code's profile raises (``blocks.profiles.profile_of``: e.g.
    transformers' DeepSeek code without tp, pp, cp or ep, whose estimate would raise them)."""
    try:
        check_setup(setup)
        profile_of(setup)
    except ValueError:
        return False
    return True


def refusal(setup: Setup, ft: FineTune) -> str | None:
    """Why method ``ft`` runs on no layout of ``setup`` (the search's base: one device, no saver, its
    layout-bound switches off, ``layout_free``): ``check_setup``'s one line where full training passes
    and ``ft`` does not (e.g. QLoRA with a mixture of experts, or under ``--impl hf`` a family whose adapters
    memplan does not list); None where the method may run, or where the base itself needs a layout to be
    judged (the families judge it). Layout-bound refusals of fine-tuning (tp, pp, cp, selective
    checkpointing) are not asked: the search leaves those layouts out for it (``searches_layout``,
    ``searches_checkpointing``)."""
    plain = layout_free(setup)
    plain = plain.replaced(strategy=plain.strategy.replaced(checkpointing=Checkpointing.NONE))

    def why(method: FineTune) -> str | None:
        try:
            check_setup(with_method(plain, method, SAVERS[0]))
        except ValueError as e:
            return str(e).splitlines()[0]
        return None

    full = FineTune()
    return None if why(full) is not None else why(ft)


def searches_layout(ft: FineTune, tp: int, pp: int, cp: int) -> bool:
    """Fine-tuning runs on data-parallel layouts only (``check_finetune``)."""
    return ft.trains_everything or (tp == 1 and pp == 1 and cp == 1)


def searches_checkpointing(ft: FineTune, mode: Checkpointing) -> bool:
    """Fine-tuning takes no selective checkpointing (``check_finetune``)."""
    return ft.trains_everything or mode is not Checkpointing.SELECTIVE
