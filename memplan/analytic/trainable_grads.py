"""Which part of the step's gradients exists at a layer's backward under fine-tuning: those of the
trainable parameters above it, not a share of every parameter.

``analytic.peak`` counts the gradients made before layer i's backward as the step's gradient bytes (the
rank's: sharded under ZeRO-2/3) times a share of the parameters. Under full training every parameter
trains and that share is the layers above i over all parameters. Under LoRA or ``--freeze`` only some
do: the share is the trainable parameters above i over all trainable ones (``trainable``; peft's
``get_nb_trainable_parameters`` under LoRA, ``strategies.lora_states.trainable_params``, which
tests/test_trainable_grads.py holds it to). Before, LoRA's adapters were charged by the frozen base's
share: Mistral 7B's layer moments 15,421 B under per layer above (q, v at r 8, s 256; tests/hf/test_hf_peak
.py), and with layer 0 frozen the reference's layer 1 backward, the step's peak, 22,101 B under; exact now
(tests/measure/test_peak.py).

Known limitations:
- NB: on a pipeline stage (``params`` a chunk's) the chunk's layer indices are not the model's: the share
  of every parameter is kept there (a frozen or adapted layer's place in the model is not known).
- NB: a frozen layer's own backward is still charged the top layer's (``analytic.layer_backward`` speaks
  of the top layer): with a trainable top, its weight gradients. At the reference's 3 layers, layer 0
  frozen, full checkpointing, s 128: layer 0's moment 20,736 B above layer 1's measured peak (+0.61 %).
  Charging it a frozen top's terms instead (``--freeze`` moved up to the top) was tried: the frozen
  layer's MLP moment keeps a down-projection input no frozen linear saves, +164 KB there; not adopted.
"""

from __future__ import annotations

from memplan.analytic.params import ParamCount
from memplan.config import Setup
from memplan.config.trainable import (
    adapted,
    adapters,
    base_trains,
    embedding_trains,
    final_norm_trains,
    head_trains,
)


def layer_trainable(setup: Setup, params: ParamCount, layer: int) -> int:
    """Trainable parameters of layer ``layer``: all of its own where its base trains, else its adapters'
    A [r, in] and B [out, r] (none in a frozen layer)."""
    if base_trains(setup, layer):
        return params.layers_from(layer, layer + 1)
    targets = adapted(setup, layer)
    r = setup.finetune.rank
    return sum(r * (a.fan_in + a.fan_out) for a in adapters(setup, targets)) if targets else 0


def trainable(setup: Setup, params: ParamCount) -> int:
    """Every trainable parameter: the layers', the embedding (and learned positions), an untied lm head and
    the final norm where they train."""
    n = sum(layer_trainable(setup, params, i) for i in range(params.num_layers))
    n += params.embedding + params.positions if embedding_trains(setup) else 0
    n += params.lm_head if head_trains(setup) and not setup.model.tied_embeddings else 0
    return n + (params.final_norm if final_norm_trains(setup) else 0)


def shares(setup: Setup, params: ParamCount, whole_model: bool = True) -> tuple[list[int], int]:
    """(parameters counted above each layer i, what they are a share of): the trainable ones under
    fine-tuning of the ``whole_model``, else every parameter (full training, or a pipeline stage's chunk)."""
    layers = params.num_layers
    if setup.finetune.trains_everything or not whole_model:
        return [params.layers_above(i, layers) for i in range(layers)], params.total
    own = [layer_trainable(setup, params, i) for i in range(layers)]
    above = [sum(own[i + 1 :]) for i in range(layers)]
    return above, trainable(setup, params)
