"""Which part of the step's gradients exists at a layer's backward under fine-tuning: those of the
trainable parameters above it, not a share of every parameter.

``analytic.peak`` counts the gradients made before layer i's backward as the step's gradient bytes (the
rank's: sharded under ZeRO-2/3) times a share of the parameters. Under full training every parameter
trains and that share is the layers above i over all parameters. Under LoRA or ``--freeze`` only some
do: the share is the trainable parameters above i over all trainable ones (``trainable``; peft's
``get_nb_trainable_parameters`` under LoRA, ``strategies.lora_states.trainable_params``, which
tests/test_trainable_grads.py holds it to). Before, LoRA's adapters were charged by the frozen base's
share: Mistral 7B's layer moments 15,421 B under per layer above (q, v at r 8, s 256; tests/hf/test_hf_peak
.py). A layer that trains otherwise than the top has its own backward's terms (``as_top``): with layer 0
of 3 frozen (h 1,024, 16 tokens) the layer backward was 8,342,858 B over (the frozen layer charged the
top's weight gradients, partly offset by the too small share); exact now (tests/measure/test_peak.py).

Known limitations:
- NB: on a pipeline stage (``params`` a chunk's) the chunk's layer indices are not the model's: the share
  of every parameter is kept there (a frozen or adapted layer's place in the model is not known).
- NB: the lowest layer that trains with nothing trainable below it (its input needs no gradient) is
  charged the backward of a layer that trains alone at the top (``as_top``); with the embedding and
  layers 0-1 frozen (h 1,024, 16 tokens, 5 layers) its moment measures 206,784 B (0.03 %) below that,
  the step's peak (the optimizer's) exact: not found further.
- ``--freeze`` with checkpointing is refused (``config``); the rules are written for it all the same.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from memplan.analytic.moments.layer_backward import layer_terms
from memplan.analytic.params import ParamCount
from memplan.blocks.inventory import Kept
from memplan.config import Setup
from memplan.config.trainable import (
    adapted,
    adapter_params,
    base_trains,
    embedding_trains,
    final_norm_trains,
    head_trains,
    layer_input_grad,
)


def layer_trainable(setup: Setup, params: ParamCount, layer: int) -> int:
    """Trainable parameters of layer ``layer``: all of its own where its base trains, else its adapters'
    A [r, in] and B [out, r] (none in a frozen layer)."""
    if base_trains(setup, layer):
        return params.layers_from(layer, layer + 1)
    targets = adapted(setup, layer)
    return adapter_params(setup, targets) if targets else 0


def trainable(setup: Setup, params: ParamCount) -> int:
    """Every trainable parameter: the layers', the embedding (and learned positions), an untied lm head and
    the final norm where they train."""
    n = sum(layer_trainable(setup, params, i) for i in range(params.num_layers))
    n += params.embedding + params.positions if embedding_trains(setup) else 0
    n += params.lm_head if head_trains(setup) and not setup.model.tied_embeddings else 0
    return n + (params.final_norm if final_norm_trains(setup) else 0)


def shares(setup: Setup, params: ParamCount, whole_model: bool = True) -> tuple[Callable[[int], int], int]:
    """(the parameters counted above layer i, as a function of i; what they are a share of): the trainable
    ones under fine-tuning of the ``whole_model``, else every parameter (full training, or a pipeline
    stage's chunk). A function: the peak asks it at a few layers (``fit`` for every configuration)."""
    layers = params.num_layers
    if setup.finetune.trains_everything or not whole_model:
        return lambda i: params.layers_above(i, layers), params.total
    own = [layer_trainable(setup, params, i) for i in range(layers)]
    return lambda i: sum(own[i + 1 :]), trainable(setup, params)


def as_top(setup: Setup, layer: int) -> Setup:
    """``setup`` with ``--freeze layers:A-B`` moved so that the top layer trains as layer ``layer`` does and
    its input needs a gradient as that layer's does: the setup whose top-layer backward terms
    (``analytic.moments.layer_backward`` speaks of the top layer) are layer ``layer``'s; ``setup`` itself
    where
    they already agree. Before, a frozen layer's backward was charged the trainable top's weight gradients
    and the lowest trainable layer its input's gradient: with layer 0 of 3 frozen (h 1,024, 16 tokens) the
    layer moment 26 MB over once the layers above were counted by what trains (tests/measure/test_peak.py)."""
    ft, top = setup.finetune, setup.model.num_layers - 1
    if ft.trains_everything:
        return setup
    f = ft.freeze_layers

    def agrees(i: int) -> tuple[bool, bool]:  # (trains, its input needs a gradient)
        return not ft.layer_frozen(i), layer_input_grad(setup, i)

    trains, g_in = agrees(layer)
    if (trains, g_in) == agrees(top):
        return setup
    if not g_in:  # the lowest layer that trains, nothing below it: it alone trains, at the top
        moved: tuple[int, int] | None = (0, top - 1)
    elif f is None:  # (without frozen layers every layer above the first trains alike: not reached)
        return setup
    elif trains:  # the layers from it up train; those below as they are (one of them trains)
        moved = (f[0], min(f[1], layer - 1)) if f[0] < layer else None
    else:  # frozen from it up
        moved = (f[0], top)
    return setup.model_copy(update={"finetune": ft.model_copy(update={"freeze_layers": moved})})


def own_terms(
    setup: Setup, layer: int, params: ParamCount, kept: Iterable[Kept], top: tuple[int, int]
) -> tuple[int, int]:
    """Layer ``layer``'s (backward transient, re-run working set): ``top``'s, the top layer's, unless it
    trains otherwise (``as_top``); the lowest layer whose backward runs (``first_backward_layer``) as the
    bottom layer's (``layer_terms``' ``bottom``): the layers below it saved nothing, so its rotary backward
    frees the tables (measured under transformers' Llama and Mistral with the embedding, and layer 0,
    frozen: tests/hf/test_hf_peak.py)."""
    own = as_top(setup, layer)
    if own is setup:
        return top
    return layer_terms(own, params, kept, bottom=layer == first_backward_layer(setup))


def first_backward_layer(setup: Setup) -> int:
    """The lowest layer whose backward runs: 0 where the embedding's output needs a gradient (it trains,
    or transformers' checkpointing hooks it), else the lowest layer that trains or is adapted (the layers
    below it keep nothing and run no backward: ``strategies.lora_flow``, and have no layer moment); the
    layer count where none does."""
    if setup.finetune.trains_everything or layer_input_grad(setup, 0):
        return 0
    layers = setup.model.num_layers
    return next((i for i in range(layers) if base_trains(setup, i) or adapted(setup, i)), layers)
