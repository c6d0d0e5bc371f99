"""Layers of two kinds (``activations.layer_kind_setups``: DeepSeek's dense first layers, Llama 4's dense
and MoE, RoPE and NoPE layers, Gemma's full layers among sliding ones): each layer's backward charged as its
own kind's (``layer_kind_terms``), and each kind's first and last layer a moment (``kind_ends``)."""

from __future__ import annotations

from collections.abc import Iterable

from memplan.analytic import activations as act
from memplan.analytic.moments.layer_backward import layer_terms
from memplan.analytic.params import ParamCount, count_params
from memplan.blocks.inventory import Kept
from memplan.config import Setup


def layer_kind_terms(
    setup: Setup, kept: Iterable[Kept] = (), kinds: tuple[Setup, ...] | None = None
) -> tuple[tuple[int, int] | None, ...]:
    """Each layer's ``layer_terms`` where the layers differ by kind (``activations.layer_kind_setups``):
    its kind's own, from its kind's setup and one layer of it (``count_params``); None for a layer whose
    kind is ``setup`` itself (``layer_terms(setup, ...)``); () when every layer is alike. Before, every
    layer's backward was charged ``setup``'s: a dense layer below MoE ones the MoE's weight gradients and
    [S, ·] buffers — at Llama 4 Maverick's widths (layer 0 dense, layer 1 MoE, s 512) the layer moment
    22.8 GB over transformers' measured step, at DeepSeek-V2-Lite's 0.97 GB (tests/hf/test_layer_kinds.py)."""
    made: dict[object, tuple[int, int]] = {}
    terms: list[tuple[int, int] | None] = []
    for kind in act.layer_kind_setups(setup) if kinds is None else kinds:
        if kind is setup:
            terms.append(None)
            continue
        if kind.model not in made:
            made[kind.model] = layer_terms(kind, count_params(kind.model), kept)
        terms.append(made[kind.model])
    return tuple(terms)


def kind_ends(setup: Setup, kinds: tuple[Setup, ...] | None = None) -> set[int]:
    """The first and last layer of each kind (``activations.layer_kind_setups``): over one kind's layers,
    evenly interleaved with the others' or contiguous, the layer moment's live set is linear in the layer
    (``every_k.moment_layers``), so its largest is at one of them; {} when every layer is alike."""
    first: dict[object, int] = {}
    last: dict[object, int] = {}
    for i, kind in enumerate(act.layer_kind_setups(setup) if kinds is None else kinds):
        first.setdefault(kind.model, i)
        last[kind.model] = i
    return set(first.values()) | set(last.values())


def bottom_terms(
    setup: Setup, params: ParamCount, kept: Iterable[Kept] = (), kinds: tuple[Setup, ...] | None = None
) -> tuple[int, int]:
    """Layer 0's ``layer_terms``, of its own kind: its moments after its rotary backward without the
    rotary tables that backward frees (``attention.constants.tables_freed_by_layer0``). Before, layer 0's
    attention norm's moment counted them: at Llama 3 8B's widths (s 512) 262,144 B over transformers'
    measured step, at OLMo-2 7B's 524,288 B (tests/hf/test_rotary_release_peak.py)."""
    kinds = act.layer_kind_setups(setup) if kinds is None else kinds
    kind = kinds[0] if kinds else setup
    return layer_terms(kind, params if kind is setup else count_params(kind.model), kept, bottom=True)


def kind_terms(
    setup: Setup, params: ParamCount, kept: Iterable[Kept] = ()
) -> tuple[tuple[tuple[int, int] | None, ...], tuple[int, int], set[int]]:
    """(``layer_kind_terms``, ``bottom_terms``, ``kind_ends``) from one reading of the layers' kinds: each
    layer's terms where its kind is its own; layer 0's; each kind's first and last layer."""
    kinds = act.layer_kind_setups(setup)
    ends = kind_ends(setup, kinds)
    return layer_kind_terms(setup, kept, kinds), bottom_terms(setup, params, kept, kinds), ends
