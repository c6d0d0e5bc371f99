"""LoRA's and frozen training's gradient flow by hand (strategies/lora_flow.py ``flows``; strategies/lora.py
``layer_rules``, ``model_rules``, ``layer_bytes``, ``recompute``; strategies/lora_flops.py ``layer_flops``,
``flops``): whole inventories of small setups, derived from which tensors require grad and which op's
backward reads each save; torch-free, in the mutation selection (docs/mutation.md).
tests/measure/test_finetune.py measures the same rules per tensor.

The rule used throughout (autograd saves a tensor only for a gradient it will compute):
- a linear y = x·Wᵀ keeps x only for dW = dYᵀ·x (W trains); dX = dY·W needs W alone. A frozen base with a
  LoRA adapter and no LoRA dropout keeps x for the adapter's dA = dYᵀ·x (A reads x itself); with dropout A
  reads the dropped copy (kept, with the bool mask when dX is needed) and x is not kept.
- the adapter keeps A·x [T, r] for dB = dYᵀ·(A·x), whatever x needs.
- RMSNorm's pow and x·rstd keep x (fp32) and rstd for dX; w·n keeps n for dW. native_layer_norm is one
  node: input, mean, rstd all kept when either gradient runs.
- a @ b keeps a only for dB and b only for dA: eager q·kᵀ keeps q when k needs a gradient and k when q
  does; P·V keeps (the dropped) P when V needs one and V when P does (q or k); softmax keeps P for dS.
- SwiGLU silu(g)·u: silu keeps g, the product keeps silu(g) for du and u for d(silu(g)).
- flash attention keeps q, k, v, its output, the logsumexp and the rng state whenever any of q, k, v needs
  a gradient (one backward kernel).

Sizes: h = 64, 4 heads of d = 16, f = 160, v = 1000, b = 2, s = 32 (T = 64 tokens), r = 8, 4 layers, bf16
activations (fp32 for RMSNorm's upcast input and statistics).
"""

from __future__ import annotations

from typing import Any

import pytest
from tiny_setup import A, B, F, H, L, S, T, V, nbytes, tiny_setup

from memplan.blocks.inventory import Dims, Role
from memplan.config import (
    Attention,
    FineTune,
    Method,
    Setup,
)
from memplan.config.finetune import Target
from memplan.config.strategy import Checkpointing
from memplan.strategies import lora, lora_flops, lora_flow

D, R = H // A, 8  # head dim, LoRA rank

Entry = tuple[str, tuple[int, ...], str]


def setup(attn: Attention = Attention.FLASH, model: dict[str, Any] | None = None, **ft: Any) -> Setup:
    strategy = {"attention": attn, **ft.pop("strategy", {})}
    return tiny_setup(model, strategy, finetune=FineTune.model_validate(ft))


def inv(rules: list[Any]) -> list[Entry]:
    return [(r.name, r.shape, r.dtype.value) for r in rules]


def layers(s: Setup) -> list[list[Entry]]:
    dims = Dims.of(s)
    return [inv(lora.layer_rules(s, dims, f)) for f in lora_flow.flows(s)]


# the saves, named as the blocks name them; shapes [b, s, ·] of the layer's tensors
X32 = [("attn_norm.input", (B, S, H), "fp32"), ("attn_norm.rstd", (B, S, 1), "fp32")]  # RMSNorm dX
N_ATTN = ("attn_norm.normed", (B, S, H), "bf16")  # RMSNorm dW
X32_MLP = [("mlp_norm.input", (B, S, H), "fp32"), ("mlp_norm.rstd", (B, S, 1), "fp32")]
N_MLP = ("mlp_norm.normed", (B, S, H), "bf16")
ATTN_IN = ("attn.input", (B, S, H), "bf16")  # W_Q, W_K, W_V's shared input
Q, K = ("attn.q", (B, A, S, D), "bf16"), ("attn.k", (B, A, S, D), "bf16")
V_FLASH = ("attn.v", (B, S, H), "bf16")  # the flash kernel's v as blocks/attention/core.py lays it out
V_EAGER = ("attn.v", (B, A, S, D), "bf16")
FLASH_CORE = [("attn.lse", (B, A, S), "fp32"), ("attn.philox_seed", (2,), "uint64")]
FLASH_CORE += [("attn.philox_offset", (), "uint64")]
PROBS = ("attn.probs", (B, A, S, S), "bf16")
ATTN_MASK = ("attn.dropout_mask", (B, A, S, S), "bool")
PROBS_DROPPED = ("attn.probs_dropped", (B, A, S, S), "bf16")
OUT = ("attn.out", (B, S, H), "bf16")  # W_O's input
MLP_IN = ("mlp.input", (B, S, H), "bf16")  # W_gate, W_up's shared input
GATE, ACT, UP = (("mlp." + n, (B, S, F), "bf16") for n in ("gate", "act", "up"))
DOWN_IN = ("mlp.down_input", (B, S, F), "bf16")
RESID = [("attn.resid_dropout_mask", (B, S, H), "bool"), ("mlp.resid_dropout_mask", (B, S, H), "bool")]
ROPE = [("rope.cos", (S, D), "bf16"), ("rope.sin", (S, D), "bf16")]
CAUSAL = ("attn.causal_mask", (S, S), "bool")
LOSS = [
    ("loss.log_probs", (T, V), "fp32"),
    ("loss.labels", (B, S), "int64"),
    ("loss.total_weight", (), "fp32"),
]
HEAD_IN = ("lm_head.input", (B, S, H), "bf16")
FINAL_X = [("final_norm.input", (B, S, H), "fp32"), ("final_norm.rstd", (B, S, 1), "fp32")]
FINAL_N = ("final_norm.normed", (B, S, H), "bf16")
FAN_IN = {"q": H, "k": H, "v": H, "o": H, "gate": H, "up": H, "down": F}


def mid(t: str) -> Entry:
    """A·x [b, s, r], B's input: dB = dYᵀ·(A·x)."""
    block = "mlp" if t in ("gate", "up", "down") else "attn"
    return (f"{block}.{t}_lora_mid", (B, S, R), "bf16")


def dropped(t: str, mask: bool) -> list[Entry]:
    """LoRA dropout: the bool mask (dX = dY·mask/(1−p), only when x needs a gradient) and the dropped x
    [b, s, in], A's input (dA = dYᵀ·drop(x))."""
    block = "mlp" if t in ("gate", "up", "down") else "attn"
    m = [(f"{block}.{t}_lora_mask", (B, S, FAN_IN[t]), "bool")] if mask else []
    return [*m, (f"{block}.{t}_lora_input", (B, S, FAN_IN[t]), "bf16")]


@pytest.mark.parametrize("method", [Method.LORA, Method.QLORA], ids=["lora", "qlora"])
def test_adapters_on_q_and_v(method: Method) -> None:
    """LoRA / QLoRA on W_Q, W_V (flash, RMSNorm, SwiGLU): the base — 4-bit or not — is frozen, so the saves
    are the same. Layer 0's input needs no gradient (frozen embedding): its attention norm keeps nothing
    and W_Q, W_V's input x is kept for dA only. q, v need gradients (adapters), so flash keeps everything
    of its own; the residual after attention needs one (W_O's input does: dX through the frozen W_O), so
    the MLP norm keeps x and rstd (not n: its weight is frozen), SwiGLU keeps g, silu(g), u (g and u need
    gradients through the frozen W_gate, W_up), W_down's input is not kept (frozen, no adapter). Layers
    1-3: their input needs a gradient, so the attention norm keeps x and rstd too."""
    s = setup(method=method, targets=(Target.Q, Target.V))
    body = [ATTN_IN, Q, K, V_FLASH, *FLASH_CORE, OUT, *X32_MLP, GATE, ACT, UP, mid("q"), mid("v")]
    assert layers(s) == [body] + [[*X32, *body]] * (L - 1)
    dims = Dims.of(s)
    before, after = lora.model_rules(s, dims, lora_flow.flows(s))
    # frozen embedding: no ids; q needs a gradient so rotary's q·cos, q·sin keep the tables; the final
    # norm's x needs a gradient, its weight is frozen; the frozen head keeps no input, the loss its own.
    assert inv(before) == ROPE
    assert inv(after) == [*FINAL_X, *LOSS]
    assert lora.layer_bytes(s) == [nbytes(body)] + [nbytes([*X32, *body])] * (L - 1)


def test_all_linears_with_lora_dropout() -> None:
    """Adapters on every linear with LoRA dropout: no linear keeps its input (frozen W, and A reads the
    dropped copy), each adapter keeps drop(x) and A·x, plus the mask where x needs a gradient: in layer 0
    not for q, k, v (the normed input of a frozen norm over a frozen embedding), for o, gate, up, down
    yes (their inputs come after an adapter)."""
    s = setup(method=Method.LORA, targets=tuple(Target), dropout=0.1)
    all_ = ("q", "k", "v", "o", "gate", "up", "down")

    def layer(first: bool) -> list[Entry]:
        adapters = [e for t in all_ for e in [*dropped(t, not first or t not in "qkv"), mid(t)]]
        return [*([] if first else X32), Q, K, V_FLASH, *FLASH_CORE, OUT, *X32_MLP, GATE, ACT, UP, *adapters]

    assert layers(s) == [layer(True)] + [layer(False)] * (L - 1)


def test_full_training_above_frozen_layers() -> None:
    """Full fine-tuning, embedding and layers 0-1 frozen: nothing below layer 2 needs a gradient, so
    layers 0-1 keep nothing. Layer 2's input needs none either: its attention norm keeps n only (dW of its
    weight); everything else of layers 2-3 trains and keeps every save (each linear's input for dW). The
    final norm keeps x, rstd and n, the trained head its input."""
    s = setup(method=Method.FULL, freeze_embeddings=True, freeze_layers=(0, 1))
    body = [ATTN_IN, Q, K, V_FLASH, *FLASH_CORE, OUT, *X32_MLP, N_MLP, MLP_IN, GATE, ACT, UP, DOWN_IN]
    assert layers(s) == [[], [], [N_ATTN, *body], [*X32, N_ATTN, *body]]
    before, after = lora.model_rules(s, Dims.of(s), lora_flow.flows(s))
    assert inv(before) == ROPE
    assert inv(after) == [*FINAL_X, FINAL_N, HEAD_IN, *LOSS]
    assert lora.layer_bytes(s) == [0, 0, nbytes([N_ATTN, *body]), nbytes([*X32, N_ATTN, *body])]


def test_full_training_of_the_lower_layers_with_a_trained_embedding() -> None:
    """Full fine-tuning with layers 2-3 frozen, LayerNorm and GELU, learned positions: the embedding
    trains, so every layer's input needs a gradient; the frozen layers keep what dX needs — LayerNorm's one
    node all three, q, k, v and flash's own (eager is not used here), GELU's input (fc1's output) for its
    derivative — but no linear input (frozen W). The embedding keeps its ids (dW of the table gathers by
    them); the final norm (trained) keeps all three; the head trains."""
    gpt = {"norm": "layernorm", "mlp": "gelu", "position": "learned"}
    s = setup(model=gpt, method=Method.FULL, freeze_layers=(2, 3))
    norm = [("attn_norm.input", (B, S, H), "bf16"), ("attn_norm.mean", (B, S, 1), "fp32")]
    norm += [("attn_norm.rstd", (B, S, 1), "fp32")]
    mlp_norm = [(n.replace("attn_norm", "mlp_norm"), sh, dt) for n, sh, dt in norm]
    fin = [(n.replace("attn_norm", "final_norm"), sh, dt) for n, sh, dt in norm]
    trained = [*norm, ATTN_IN, Q, K, V_FLASH, *FLASH_CORE, OUT, *mlp_norm, MLP_IN, UP, DOWN_IN]
    frozen = [*norm, Q, K, V_FLASH, *FLASH_CORE, OUT, *mlp_norm, UP]
    got = layers(s)
    assert got == [trained, trained, frozen, frozen]
    before, after = lora.model_rules(s, Dims.of(s), lora_flow.flows(s))
    assert inv(before) == [("embed.ids", (B, S), "int64"), ("embed.positions", (S,), "int64")]
    assert inv(after) == [*fin, HEAD_IN, *LOSS]


def test_eager_with_dropouts_and_adapters_on_k_and_o() -> None:
    """Eager attention, attention and residual dropout 0.1, adapters on W_K and W_O. Layer 0 (input needs
    no gradient): only k needs one (its adapter), so q·kᵀ keeps q (for dK) but not k; P needs a gradient
    (through k), so P·V keeps V, softmax keeps P and the attention dropout its mask, but the dropped P is not
    kept (V needs no gradient). W_K's and W_O's inputs are kept for dA (no LoRA dropout). Both residual
    dropouts' masks are kept (the branches need gradients). Layers 1-3: q, k, v all need gradients: both
    of q, k, V, the dropped P too."""
    model = {"attn_dropout": 0.1, "resid_dropout": 0.1}
    s = setup(Attention.EAGER, model, method=Method.LORA, targets=(Target.K, Target.O))
    mlp = [*X32_MLP, GATE, ACT, UP, RESID[1], mid("k"), mid("o")]
    first = [ATTN_IN, Q, V_EAGER, PROBS, ATTN_MASK, OUT, RESID[0], *mlp]
    rest = [*X32, ATTN_IN, Q, K, V_EAGER, PROBS, ATTN_MASK, PROBS_DROPPED, OUT, RESID[0], *mlp]
    assert layers(s) == [first] + [rest] * (L - 1)
    before, _ = lora.model_rules(s, Dims.of(s), lora_flow.flows(s))
    assert inv(before) == [*ROPE, CAUSAL]


def test_eager_adapter_on_gate_only() -> None:
    """Eager, one adapter on W_gate: in layer 0 nothing of attention needs a gradient (frozen, over a frozen
    embedding): no save at all until the MLP, whose input is kept for A_gate, silu keeps g and the product
    keeps u (g's gradient); silu(g) is not kept (u needs no gradient). Layer 1's input then needs one (via
    W_down's dX): attention keeps q, k, V and P, but not W_O's input (frozen, no adapter: eager keeps no
    output of its own); both norms keep x and rstd."""
    s = setup(Attention.EAGER, method=Method.LORA, targets=(Target.GATE,))
    first = [MLP_IN, GATE, UP, mid("gate")]
    rest = [*X32, Q, K, V_EAGER, PROBS, *X32_MLP, MLP_IN, GATE, ACT, UP, mid("gate")]
    assert layers(s) == [first] + [rest] * (L - 1)
    before, after = lora.model_rules(s, Dims.of(s), lora_flow.flows(s))
    assert inv(before) == [*ROPE, CAUSAL]  # layer 1's q and k need gradients
    assert inv(after) == [*FINAL_X, *LOSS]


def test_nothing_trains_below_the_head() -> None:
    """Full fine-tuning with the embedding and every layer frozen: no layer keeps anything, no rotary table
    is kept (no q needs a gradient), the final norm keeps n only (its weight trains, its input needs no
    gradient) and the head its input."""
    s = setup(method=Method.FULL, freeze_embeddings=True, freeze_layers=(0, L - 1))
    assert layers(s) == [[]] * L
    before, after = lora.model_rules(s, Dims.of(s), lora_flow.flows(s))
    assert inv(before) == []
    assert inv(after) == [FINAL_N, HEAD_IN, *LOSS]
    assert lora.layer_bytes(s) == [0] * L
    # the final norm's weight trains, so the head's dX runs (1×) beside its dW (1×); the layers run none
    head = 2 * T * H * V
    assert lora_flops.flops(s).backward == 2 * head


def mm(m: int, k: int, n: int) -> int:
    return 2 * m * k * n


LINEARS = {"q": (H, H), "k": (H, H), "v": (H, H), "o": (H, H), "gate": (H, F), "up": (H, F), "down": (F, H)}
PER_BMM = B * A * mm(S, D, S)  # one s×s product over every (batch, head)


def test_flops_with_adapters_on_q_and_v() -> None:
    """Forward: every linear 2·T·in·out, each adapter A (2·T·in·r) and B (2·T·r·out). Backward of layer 0:
    no dX for W_Q, W_K, W_V (their input needs none), dA for A (1×), dB and d(A·x) for B (2×); dX for W_O,
    W_gate, W_up, W_down (1× each: frozen); flash's five s×s products. Layers 1-3 add dX of W_Q, W_K, W_V
    and of both A. The head: dX only (frozen head, the last layer's output needs a gradient)."""
    s = setup(method=Method.LORA, targets=(Target.Q, Target.V))
    adapter_fwd = mm(T, H, R) + mm(T, R, H)
    forward = sum(mm(T, i, o) for i, o in LINEARS.values()) + 2 * adapter_fwd
    tail = sum(mm(T, *LINEARS[t]) for t in ("o", "gate", "up", "down"))
    back0 = tail + 2 * (mm(T, H, R) + 2 * mm(T, R, H))
    back1 = back0 + 3 * mm(T, H, H) + 2 * mm(T, H, R)
    dims = Dims.of(s)
    got = [lora_flops.layer_flops(s, dims, f) for f in lora_flow.flows(s)]
    assert got == [(forward, back0, 5 * PER_BMM)] + [(forward, back1, 5 * PER_BMM)] * (L - 1)
    fl = lora_flops.flops(s)
    attention = L * 2 * PER_BMM  # QKᵀ and P·V
    head = mm(T, H, V)
    assert (fl.forward, fl.layer_linear, fl.layer_attention, fl.lm_head) == (
        L * forward + attention + head,
        L * forward,
        attention,
        head,
    )
    assert fl.backward == back0 + (L - 1) * back1 + L * 5 * PER_BMM + head
    assert (fl.recompute, fl.kernel_recompute) == (0, L * PER_BMM)  # flash's backward recomputes S


def test_eager_attention_backward_runs_the_needed_operand_gradients() -> None:
    """Eager: q·kᵀ's backward computes dQ when q needs a gradient and dK when k does; P·V's computes dP when
    P does (q or k) and dV when V does. Adapter on k (layer 0): dK and dP, 2 products; layers 1-3: all 4.
    An adapter on gate only: layer 0's attention runs no backward; the full-training head: dX and dW."""
    s = setup(Attention.EAGER, method=Method.LORA, targets=(Target.K, Target.O))
    dims = Dims.of(s)
    cores = [lora_flops.layer_flops(s, dims, f)[2] for f in lora_flow.flows(s)]
    assert cores == [2 * PER_BMM] + [4 * PER_BMM] * 3
    g = setup(Attention.EAGER, method=Method.LORA, targets=(Target.GATE,))
    dims, fl = Dims.of(g), lora_flow.flows(g)
    assert [lora_flops.layer_flops(g, dims, f)[2] for f in fl] == [0] + [4 * PER_BMM] * 3
    # layer 0's backward: W_gate's A (dA only: x needs no gradient) and B (dB, d(A·x)); W_down's dX (its
    # input silu(g)·u needs one, through g); W_gate's and W_up's own dX are not needed (frozen, input too).
    assert lora_flops.layer_flops(g, dims, fl[0])[1] == mm(T, H, R) + 2 * mm(T, R, F) + mm(T, F, H)
    assert lora_flops.flops(g).kernel_recompute == 0  # eager recomputes no kernel


@pytest.mark.parametrize(
    ("targets", "checkpointing", "every", "segments", "skip"),
    [
        (tuple(Target), Checkpointing.FULL, 1, L, mm(T, R, H)),  # B's input saved before B on W_down
        (tuple(Target), Checkpointing.EVERY_K, 2, 2, mm(T, R, H)),
        (tuple(Target), Checkpointing.EVERY_K, 3, 2, mm(T, R, H)),  # ⌈4/3⌉ segments
        ((Target.Q, Target.V), Checkpointing.FULL, 1, L, mm(T, F, H)),  # the frozen W_down [T, f]·[f, h]
    ],
)
def test_segment_checkpointing_reruns_each_layers_forward_less_the_early_stop(
    targets: tuple[Target, ...], checkpointing: Checkpointing, every: int, segments: int, skip: int
) -> None:
    """Each segment re-runs its layers' forward (linears, adapters, attention core) but stops after its
    last save: the last matmul of the segment (W_down's adapter B, else W_down itself) is skipped."""
    strategy = {"checkpointing": checkpointing, "checkpoint_every": every}
    s = setup(method=Method.LORA, targets=targets, strategy=strategy)
    r = sum(mm(T, LINEARS[t][0], R) + mm(T, R, LINEARS[t][1]) for t in map(str, targets))
    forward = L * (sum(mm(T, i, o) for i, o in LINEARS.values()) + r + 2 * PER_BMM)
    assert lora.recompute(s, Dims.of(s)) == forward - segments * skip
    assert lora_flops.flops(s).recompute == forward - segments * skip
    dropout = setup(model={"resid_dropout": 0.1}, method=Method.LORA, targets=targets, strategy=strategy)
    assert lora.recompute(dropout, Dims.of(dropout)) == forward  # the mask is saved last: no early stop
    assert lora.recompute(setup(method=Method.LORA, targets=targets), Dims.of(s)) == 0


@pytest.mark.parametrize(
    ("target", "kept"),
    [
        (Target.Q, ATTN_IN),  # A_Q reads W_Q's input x: dA = dYᵀ·x
        (Target.K, ATTN_IN),
        (Target.V, ATTN_IN),
        (Target.GATE, MLP_IN),  # A_gate, A_up read the MLP's normed input
        (Target.UP, MLP_IN),
        (Target.DOWN, DOWN_IN),  # A_down reads silu(g)·u
    ],
)
def test_one_adapter_keeps_its_linears_input(target: Target, kept: Entry) -> None:
    """One adapter without LoRA dropout, on a frozen base: the input it shares with its linear is kept in
    every layer (for dA), whichever of the fused group's linears carries it."""
    s = setup(method=Method.LORA, targets=(target,))
    assert all(kept in layer for layer in layers(s))


@pytest.mark.parametrize(
    ("target", "first"),
    [
        # adapter on W_Q: q needs a gradient in layer 0, so W_O's input does, so the branch's output (dX
        # through the frozen W_O) and the dropout after it: both masks
        (Target.Q, [True, True]),
        # adapter on W_O alone: layer 0's q, k, v need no gradient, W_O's output does (its adapter)
        (Target.O, [True, True]),
        # adapter on W_down: nothing of layer 0's attention branch needs a gradient, its MLP branch does
        (Target.DOWN, [False, True]),
    ],
)
def test_residual_dropout_masks_where_the_branch_needs_a_gradient(target: Target, first: list[bool]) -> None:
    """Residual dropout after W_O and W_down keeps its mask when the branch's output needs a gradient
    (dX = dY·mask/(1−p)); layers 1-3 (input needing one) keep both."""
    s = setup(model={"resid_dropout": 0.1}, method=Method.LORA, targets=(target,))
    got = [[m in layer for m in RESID] for layer in layers(s)]
    assert got == [first] + [[True, True]] * (L - 1)


def test_frozen_layers_over_a_trained_embedding_keep_what_dx_needs() -> None:
    """Full fine-tuning, every layer frozen, the embedding trained: each layer's input needs a gradient, so
    each keeps what dX needs — both RMSNorms' x and rstd (not n: frozen weights), q, k, v and flash's own,
    W_O's input (flash's output), SwiGLU's g, silu(g), u — and no linear's input (frozen W). The final norm
    keeps x, rstd and n (it trains), the head its input, the embedding its ids."""
    s = setup(method=Method.FULL, freeze_layers=(0, L - 1))
    layer = [*X32, Q, K, V_FLASH, *FLASH_CORE, OUT, *X32_MLP, GATE, ACT, UP]
    assert layers(s) == [layer] * L
    before, after = lora.model_rules(s, Dims.of(s), lora_flow.flows(s))
    assert inv(before) == [("embed.ids", (B, S), "int64"), *ROPE]
    assert inv(after) == [*FINAL_X, FINAL_N, HEAD_IN, *LOSS]
    roles = {r.name: r.role for r in lora.layer_rules(s, Dims.of(s), lora_flow.flows(s)[0])}
    assert roles["attn.out"] is Role.ATTN_OUT  # W_O's input, the attention output (flash's own save)


def test_only_the_top_layer_adapted() -> None:
    """LoRA on W_Q, W_V with layers 0-2 frozen: nothing below layer 3 needs a gradient. Layer 3 keeps what
    layer 0 of the unfrozen case keeps; the final norm's input needs a gradient (through layer 3's adapters),
    so it keeps x and rstd, and the frozen head runs dX (1×) in backward."""
    s = setup(method=Method.LORA, targets=(Target.Q, Target.V), freeze_layers=(0, 2))
    body = [ATTN_IN, Q, K, V_FLASH, *FLASH_CORE, OUT, *X32_MLP, GATE, ACT, UP, mid("q"), mid("v")]
    assert layers(s) == [[], [], [], body]
    _, after = lora.model_rules(s, Dims.of(s), lora_flow.flows(s))
    assert inv(after) == [*FINAL_X, *LOSS]
    dims = Dims.of(s)
    layer3 = lora_flops.layer_flops(s, dims, lora_flow.flows(s)[3])
    assert lora_flops.flops(s).backward == layer3[1] + layer3[2] + mm(T, H, V)


def test_gelu_flops_with_an_adapter_on_fc1() -> None:
    """GELU MLP (fc1 = up, fc2 = down; no gate), LayerNorm, adapter on up: forward runs q, k, v, o, up, down
    and A, B; layer 0's backward: A's dA, B's dB and d(A·x), fc2's dX (the GELU output needs a gradient);
    nothing of attention (flash runs no backward: q, k, v need none)."""
    s = setup(model={"norm": "layernorm", "mlp": "gelu"}, method=Method.LORA, targets=(Target.UP,))
    gelu = {t: LINEARS[t] for t in ("q", "k", "v", "o", "up", "down")}
    forward = sum(mm(T, i, o) for i, o in gelu.values()) + mm(T, H, R) + mm(T, R, F)
    back0 = mm(T, H, R) + 2 * mm(T, R, F) + mm(T, F, H)
    dims = Dims.of(s)
    assert lora_flops.layer_flops(s, dims, lora_flow.flows(s)[0]) == (forward, back0, 0)
