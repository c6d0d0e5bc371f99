"""Fine-tuning's layer-backward moment where the MLP is frozen and carries no adapter (LoRA on attention
targets, peft's default q, v; QLoRA alike): what ``analytic.layer_backward``'s full-training transients
get wrong there, and the correction ``pieces`` adds to the layer moment (``Pieces.layer_correction``).

Full training's MLP moment (``blocks.mlp.mlp_backward_transient``) counts the down projection's weight
gradient as made and its saved input as released once its backward has run. A frozen down projection
makes no weight gradient and keeps no input (``strategies.lora``: dX = dY·W needs the weight only), so
nothing is released: at the product's gradient the live set is the saves, the incoming dY [T, h] and the
MLP's gradient buffers — d(down input) and the two operand gradients [T, f] (SwiGLU; GELU: d(down input)
and gelu's input gradient) — less the residual dropout's mask after W_down, which its backward has
consumed first. Measured op by op on CPU against every live storage (tests/measure/test_peak.py
``test_lora_peak_is_exact``): Llama- and GPT-shaped layers, q, v and q, k, v, o adapters, flash and eager
attention, LoRA dropout, none and full checkpointing, one and two micro-batches, exact.

NB: only this moment is fine-tuning-aware; the layer's other backward moments (the MLP norm's, the
attention's, the attention norm's) keep full training's terms (gradients of frozen weights counted as made,
full training's saves as released), below the MLP's in every measured setup. An adapted MLP (gate, up or
down targets) is not corrected: its adapters' backward adds [T, in] input-gradient pieces not modelled
(all-linear LoRA on the Llama-shaped layer under full checkpointing: −1.7 … +0.3 %). QLoRA against the
reference model: its Python dequantisation (``measure/reference/lora.py``: int64 codes, fp32 scales) holds
more than bitsandbytes' kernel, whose one dequantised weight ``lora_states.dequant_transient`` counts; the
reference's peak is +1.8 … +3.2 % (Llama-shaped) and +15 … +25 % (GPT-shaped, tiny) above the estimate.
"""

from __future__ import annotations

from memplan.analytic import layer_backward as lb
from memplan.analytic.params import ParamCount
from memplan.blocks.inventory import Dims
from memplan.blocks.profiles import hidden_dropouts
from memplan.config import DType, MlpType, Setup
from memplan.config.finetune import Target
from memplan.config.trainable import adapted, base_trains

MLP_TARGETS = frozenset({Target.GATE, Target.UP, Target.DOWN})


def frozen_mlp(setup: Setup) -> bool:
    """Fine-tuning where the top layer's MLP neither trains nor carries an adapter (the layer whose
    backward is the moment: the last, which keeps the most)."""
    top = setup.model.num_layers - 1
    if setup.finetune.trains_everything or base_trains(setup, top):
        return False
    return not adapted(setup, top) & MLP_TARGETS


def frozen_mlp_moment(setup: Setup, dims: Dims) -> int:
    """The MLP backward's rise above the layer's saves at the product's gradient, MLP frozen: dY [T, h]
    and the gradient buffers [T, f] (3 SwiGLU, 2 GELU), less the residual dropout's bool mask [T, h]."""
    t, e = dims.tokens, dims.act.bytes
    buffers = (3 if setup.model.mlp is MlpType.SWIGLU else 2) * t * dims.f * e
    mask = t * dims.h * DType.BOOL.bytes if hidden_dropouts(setup)[0] > 0 else 0
    return t * dims.h * e + buffers - mask


def layer_correction(setup: Setup, dims: Dims, params: ParamCount) -> int:
    """What the layer moment's transient rises by where the MLP is frozen (``frozen_mlp``): the frozen MLP's
    moment above full training's largest (``layer_backward_transient``), else 0."""
    if not frozen_mlp(setup):
        return 0
    return max(0, frozen_mlp_moment(setup, dims) - lb.layer_backward_transient(setup, dims, params))
