"""The layer backward's transients by hand (analytic/peak.py: the attention's saves, what a reversible
layer holds beyond a plain one, the eager attention backward's softmax gradients); torch-free, in the
mutation selection (docs/mutation.md). tests/measure/test_peak.py measures the moments they feed (torch).

The tiny model on CPU kernels (tests/tiny_setup.py): h = 64, 4 heads of d = 16, f = 160, b = 2, s = 32
(T = 64 tokens), bf16 activations, RMSNorm with an fp32 upcast.
"""

from __future__ import annotations

from typing import Any

from tiny_setup import A, B, H, S, T, tiny_setup

from memplan.analytic.moments import layer_backward as lb
from memplan.analytic.params import count_params
from memplan.blocks.inventory import Dims
from memplan.config import Device, Setup
from memplan.config.strategy import Attention

D = H // A
TH = T * H * 2  # one [T, h] bf16 tensor: 8,192 B


def cpu(model: dict[str, Any] | None = None, **strategy: Any) -> Setup:
    return tiny_setup(model, strategy).model_copy(update={"device": Device.CPU})


# The flash attention's saves of one layer on CPU: its input [T, h], q, k, v [b, a, s, d] (bf16), the
# kernel's logsumexp [b, a, s] fp32, W_O's input [T, a·d] (bf16).
ATTN = TH + 3 * (B * A * S * D * 2) + B * A * S * 4 + TH  # 41,984 B
# The attention norm's: the fp32 upcast input [T, h], rstd [T, 1] fp32, the normalised bf16 [T, h].
ATTN_NORM = T * H * 4 + T * 4 + TH  # 24,832 B


def test_the_attention_saves_and_the_residual_masks_with_them() -> None:
    assert lb.attn_saved_bytes(cpu()) == ATTN
    assert lb.attn_norm_saved(cpu()) == ATTN_NORM
    # Residual dropout's bool masks [b, s, h]: the attention branch's (in the attention block) and the MLP
    # branch's, counted with the attention's (freed when W_O's backward has run).
    assert lb.attn_saved_bytes(cpu({"resid_dropout": 0.1})) == ATTN + 2 * (T * H)


def test_a_reversible_layer_holds_six_t_by_h_more_in_fs_backward() -> None:
    # dy1 and dy2 held by the caller, the new dy1, G's input gradient, x2 = y2 − g and F's output.
    assert lb.reversible_f_extra(cpu(reversible=True), Dims.of(cpu())) == 6 * TH
    assert lb.reversible_f_extra(cpu(), Dims.of(cpu())) == 0


def test_a_reversible_layer_has_not_yet_rebuilt_its_attention_while_g_runs_backward() -> None:
    # The working set counts the attention's and its norm's saves, which F's re-run rebuilds only after
    # G's backward; meanwhile g and dy1 are alive beside dy2: two [T, h] the working set lacks.
    s = cpu(reversible=True)
    assert lb.not_yet_rerun(s, Dims.of(s)) == ATTN + ATTN_NORM - 2 * TH
    assert lb.not_yet_rerun(cpu(), Dims.of(cpu())) == 0


def test_the_eager_attention_backward_holds_two_softmax_gradients_less_one_with_dropout() -> None:
    # Eager: the probabilities' and the scores' gradients [b, a, s, s] (bf16, 16,384 B each); with
    # attention dropout the dropped probabilities' gradient has been consumed into one of them.
    scores = B * A * S * S * 2

    def transient(**model: Any) -> int:
        s = cpu(model, attention=Attention.EAGER)
        return lb.attention_backward_transient(s, Dims.of(s), count_params(s.model))

    assert transient(attn_dropout=0.1) - transient() == -scores


def test_the_reversible_extra_joins_the_attention_backward() -> None:
    def transient(**strategy: Any) -> int:
        s = cpu(**strategy)
        return lb.attention_backward_transient(s, Dims.of(s), count_params(s.model))

    assert transient(reversible=True) - transient() == 6 * TH
