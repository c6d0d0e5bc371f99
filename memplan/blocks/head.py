"""The lm head [h, v] (absent when tied to the embedding) and the loss, in one of five variants
(``config.offload.LossKind``):

- standard: logits upcast to fp32 as Megatron and HF do, an explicit ``log_softmax`` + ``nll_loss``: keeps
  the fp32 log-probs [T, v] (3.91 GiB at 8,192 tokens of a 128,256 vocabulary).
- chunked:N — torchtune's ``CEWithChunkedOutputLoss`` with the model's chunked output
  (``TransformerDecoder.chunked_output``): the final norm's output is cut into N chunks along the sequence
  (``torch.chunk``: ⌈s/N⌉ positions each, fewer chunks when that leaves none), each goes through the lm
  head, is upcast to fp32 and ``cross_entropy``'d with reduction "sum"; the sum is divided by the number of
  labels (an int64 scalar, kept by the division). Autograd keeps every chunk's log-probs: the same 4·T·v
  bytes as standard. What shrinks is the backward's transient: its two fp32 buffers are one chunk's. The
  forward's does not: the model makes every chunk's logits before the loss takes any (T·v in the
  activations' dtype, alive until the loss returns), so the loss's forward is its peak
  (``chunked_loss_forward_transient``); and the lm head's backward sums its weight gradient's pieces,
  three [v, h] at once (``chunked_head_backward_transient``). With b > 1 a chunk along the sequence is
  not contiguous, so the lm head's ``matmul`` and the labels' ``reshape(-1)`` copy it: each chunk keeps
  its own [b·c, h] input and [b·c] labels (the same bytes in N storages).
- te — Transformer Engine's ``parallel_cross_entropy`` as Megatron runs it (``--cross-entropy-loss-fusion
  --cross-entropy-fusion-impl te``): keeps the 16-bit logits [T, v/t] and 3·t fp32 numbers a token; its
  backward writes the gradient over the logits in place (``te_rules``).
- fused — Liger's ``LigerFusedLinearCrossEntropyFunction``: in forward, per chunk of rows the logits,
  their softmax gradient (written over them), grad_input[chunk] = dlogits·W and grad_weight += dlogitsᵀ·X;
  autograd keeps grad_input [T, h] (the hidden states' dtype) and grad_weight [v, h] (the weight's) and no
  [T, v] tensor. Liger's chunk: next_pow2(⌈T / ⌈v/h⌉⌉) rows. Its backward only scales them by the incoming
  gradient (in place, 0 FLOPs): the head's 4·T·h·v backward FLOPs run in the forward phase.

The final norm before the head is a ``norm`` block.

For the allocator's replay (``reserved``), torchtitan's eager standard loss (one vocabulary shard, one
stage) is also known tensor by tensor: its forward's logits, their fp32 copy and the log-probs
(``forward_loss_blocks``), and its backward's two fp32 gradients (``loss_backward_blocks``).

Known limitations (NB): elsewhere the forward's loss moment is not a point of the replay and the loss
backward's transient is one block (as the estimate's peak counts them); under ``--compile`` torchtitan
compiles the loss too (``compile.components`` defaults to model and loss) and inductor's buffers are not
modelled. Under the fused loss the final norm's backward moment is measured 4 bytes above the
estimate (one fp32 scalar alive that is not identified; tests/measure/test_loss.py); the forward's own
transient (one chunk's logits, and the reference's fp32 copy of them) is not a modelled moment and can
exceed the backward's for small vocabularies.
"""

from __future__ import annotations

from memplan.blocks import mm
from memplan.blocks.inventory import Block, Dims, Role, Rule, save
from memplan.blocks.profiles import profile_of
from memplan.config import DType, Impl, LossKind, ModelConfig, Setup
from memplan.config.trainable import head_trains

FP32, INT64, BOOL = DType.FP32, DType.INT64, DType.BOOL
B, R = Block, Role


def lm_head_params(m: ModelConfig) -> int:
    """The head's h×v weight (none when tied) and its bias v (``head_bias``: PhiMoE's ``lm_head_bias``,
    a bias of its own even with tied weights)."""
    weight = 0 if m.tied_embeddings else m.hidden_size * m.vocab_size
    return weight + (m.vocab_size if m.head_bias else 0)


def chunk_sizes(n: int, chunks: int) -> list[int]:
    """Lengths of ``torch.chunk`` of n elements into ``chunks``: ⌈n/chunks⌉ each, the last one shorter, and
    fewer chunks when ⌈n/chunks⌉ already covers n."""
    size = -(-n // chunks)
    return [min(size, n - start) for start in range(0, n, size)]


def liger_chunk_rows(tokens: int, h: int, v: int) -> int:
    """Rows of one chunk of Liger's fused linear cross-entropy (``fused_linear_cross_entropy_forward``):
    inc_factor = ⌈v/h⌉, chunk_size = next_power_of_2(⌈T / inc_factor⌉)."""
    rows = -(-tokens // -(-v // h))
    return 1 << (rows - 1).bit_length()


def lm_head_rules(setup: Setup, dims: Dims) -> list[Rule]:
    """The lm head's input and the loss's saves."""
    if setup.loss is LossKind.FUSED:
        return fused_rules(setup, dims)
    if setup.loss is LossKind.CHUNKED:
        return chunked_rules(setup, dims)
    if setup.loss is LossKind.XENTROPY:
        return xentropy_rules(setup, dims)
    if setup.loss is LossKind.TE:
        return te_rules(setup, dims)
    b, s, h, v = dims.b, dims.s, dims.h, dims.v
    head = save(B.LM_HEAD, "input", (b, s, h), dims.act, R.LINEAR_INPUT, "input of the lm head: dW = Xᵀ·dY")
    prof = profile_of(setup)
    if prof.vocab_parallel_loss:
        return [head, *vocab_parallel_loss_rules(dims)]
    log_probs = save(
        B.LOSS,
        "log_probs",
        (b * s, v),
        FP32,
        R.LOG_PROBS,
        "log_softmax output of the fp32 logits: d = p − onehot",
    )
    if prof.loss_parallel_function and setup.parallel.tp > 1:  # torchtitan's _LossParallelCrossEntropy
        return [head, log_probs, labels_rule(setup, dims), *count_rules(setup)]
    return [
        head,
        log_probs,
        *softcap_rules(setup, dims),
        labels_rule(setup, dims),
        save(B.LOSS, "total_weight", (), FP32, R.LOSS_SCALAR, "nll_loss's normaliser (a fp32 scalar)"),
        *count_rules(setup),
    ]


def vocab_parallel_loss_rules(dims: Dims) -> list[Rule]:
    """Megatron's vocabulary-parallel cross entropy and pretrain_gpt's masked sum (``Profile``'s
    ``vocab_parallel_loss``): [T, v] is the rank's [T, v/t] (``tp_model``'s vocabulary)."""
    t = dims.b * dims.s
    return [
        save(B.LOSS, "softmax", (t, dims.v), FP32, R.LOG_PROBS, "fp32 softmax: d = softmax − onehot"),
        save(B.LOSS, "target_mask", (t,), BOOL, R.LABELS, "targets outside the rank's vocabulary"),
        save(B.LOSS, "masked_target", (t,), INT64, R.LABELS, "targets shifted into the rank's vocabulary"),
        save(B.LOSS, "loss_mask", (t,), FP32, R.LABELS, "losses · loss_mask: d(losses) needs the mask"),
    ]


def count_rules(setup: Setup) -> list[Rule]:
    """The label count a summed loss is divided by, kept by the division (``Profile.loss_over_token_count``,
    and torchtune's chunked loss)."""
    why = "the labels counted, the sum's divisor"
    if setup.loss is LossKind.CHUNKED:  # the loss's own local: freed with the division's node
        return [save(B.LOSS, "count", (), INT64, R.CHUNK_SCALAR, why)]
    if profile_of(setup).loss_over_token_count:  # the trainer's: held to the step's end
        return [save(B.LOSS, "count", (), INT64, R.LOSS_SCALAR, why)]
    return []


def softcap_rules(setup: Setup, dims: Dims) -> list[Rule]:
    """Gemma-2's ``Gemma2ForCausalLM.forward``: logits → tanh(logits / c) · c before the loss; tanh keeps
    its output [b, s, v] in A (the divisions by a Python scalar keep nothing)."""
    if setup.model.final_softcap is None:
        return []
    why = "tanh of the softcapped logits: d tanh = 1 − tanh²"
    return [save(B.LOSS, "softcap_tanh", (dims.b, dims.s, dims.v), dims.act, R.LOG_PROBS, why)]


def labels_rule(setup: Setup, dims: Dims) -> Rule:
    """nll_loss's targets: the [b, s] labels, or transformers' padded-and-shifted [b, s+1] storage
    (``labels[..., 1:].contiguous()`` is that storage's view when b = 1; when b > 1 it is a [b, s] copy)."""
    if profile_of(setup).labels_padded and dims.b == 1:
        why = "targets of nll_loss: a shifted view of the labels padded by one ignore_index"
        return save(B.LOSS, "labels", (dims.b, dims.s + 1), INT64, R.LABELS, why)
    return save(B.LOSS, "labels", (dims.b, dims.s), INT64, R.LABELS, "targets of nll_loss")


def chunked_rules(setup: Setup, dims: Dims) -> list[Rule]:
    """torchtune's chunked loss: per chunk its log-probs and nll_loss's total weight; the lm head's input
    and the labels are views of one storage unless b > 1 makes each chunk a copy (module docstring)."""
    b, s, h, v = dims.b, dims.s, dims.h, dims.v
    sizes = chunk_sizes(s, setup.loss_chunks)
    copies = b > 1 and len(sizes) > 1
    inputs = (
        [
            save(B.LM_HEAD, "input", (b * c, h), dims.act, R.LINEAR_INPUT, "a chunk's copy: dW = Xᵀ·dY")
            for c in sizes
        ]
        if copies
        else [save(B.LM_HEAD, "input", (b, s, h), dims.act, R.LINEAR_INPUT, "input of the lm head (chunks)")]
    )
    labels = (
        [save(B.LOSS, "labels", (b * c,), INT64, R.CHUNK_LABELS, "a chunk's labels, reshaped") for c in sizes]
        if copies
        else [save(B.LOSS, "labels", (b, s), INT64, R.LABELS, "targets of nll_loss (chunks)")]
    )
    per_chunk = [
        rule
        for c in sizes
        for rule in (
            save(B.LOSS, "log_probs", (b * c, v), FP32, R.LOG_PROBS, "a chunk's fp32 log_softmax output"),
            save(B.LOSS, "total_weight", (), FP32, R.CHUNK_SCALAR, "a chunk's nll_loss normaliser"),
        )
    ]
    return inputs + per_chunk + labels + count_rules(setup)


def xentropy_rules(setup: Setup, dims: Dims) -> list[Rule]:
    """flash_attn's fused cross-entropy (``ops/triton/cross_entropy.py``, ``CrossEntropyLoss.forward``:
    ``ctx.save_for_backward(logits, lse, labels)``) and its module's mean, ``loss.sum() / (target !=
    ignore_index).sum()``: the division keeps the int64 count."""
    t, v = dims.tokens, dims.v
    head = save(B.LM_HEAD, "input", (dims.b, dims.s, dims.h), dims.act, R.LINEAR_INPUT, "dW = Xᵀ·dY")
    why = "the lm head's output, kept by the kernel: d = softmax(logits) − onehot"
    return [
        head,
        save(B.LOSS, "logits", (t, v), dims.act, R.LOG_PROBS, why),
        save(B.LOSS, "lse", (t,), FP32, R.LOSS_SCALAR, "the kernel's fp32 logsumexp per token"),
        labels_rule(setup, dims),
        save(B.LOSS, "count", (), INT64, R.LOSS_SCALAR, "the labels counted, the mean's divisor"),
    ]


def te_rules(setup: Setup, dims: Dims) -> list[Rule]:
    """Transformer Engine's ``parallel_cross_entropy`` under Megatron (``LossKind.TE``; transformer_engine/
    pytorch/cross_entropy.py, ``CrossEntropyFunction.forward``: ``ctx.save_for_backward(_input, target,
    m_d_X_y)``): the rank's 16-bit logits [T, v/t] as the output layer made them (no fp32 copy; the online
    softmax reads them once), the targets [T] int64 (Megatron's transposed copy of the labels) and the
    per-token max, sum and target logit in fp32 of every rank of the tensor-parallel group (``m_d_X_y``
    all-gathered: 3·t numbers a token); pretrain_gpt's masked sum keeps the loss mask. The backward's
    kernel writes the gradient over the logits (``cross_entropy_backward_kernel``: "in-place")."""
    t, tp = dims.tokens, setup.parallel.tp
    head = save(B.LM_HEAD, "input", (dims.b, dims.s, dims.h), dims.act, R.LINEAR_INPUT, "dW = Xᵀ·dY")
    why = "the output layer's logits, kept by the kernel and overwritten by their gradient in backward"
    return [
        head,
        save(B.LOSS, "logits", (t, dims.v), dims.act, R.LOG_PROBS, why),
        save(B.LOSS, "m_d_X_y", (3 * tp * t,), FP32, R.LOSS_SCALAR, "each rank's max, sum, target logit"),
        save(B.LOSS, "target", (t,), INT64, R.LABELS, "the targets, Megatron's [s, b] copy of the labels"),
        save(B.LOSS, "loss_mask", (t,), FP32, R.LABELS, "losses · loss_mask: d(losses) needs the mask"),
    ]


def fused_rules(setup: Setup, dims: Dims) -> list[Rule]:
    """Liger's fused linear cross-entropy keeps the gradients it made in forward: dL/dX, and dL/dW where the
    head's weight trains (``fused_linear_cross_entropy_forward``: ``grad_weight = torch.zeros_like(weight)
    if weight_needs_grad else None``; a frozen head under LoRA makes none)."""
    w = setup.training.precision.activation_dtype  # the reference model's weights are in this dtype
    t = dims.tokens
    out = [save(B.LOSS, "grad_input", (t, dims.h), dims.act, R.HEAD_INPUT_GRAD, "dL/dX, made in forward")]
    if head_trains(setup):
        why = "dL/dW made in forward"
        out.append(save(B.LOSS, "grad_weight", (dims.v, dims.h), w, R.HEAD_WEIGHT_GRAD, why))
    return out


def lm_head_flops(dims: Dims) -> int:
    """The lm head's forward product (the logits), whatever the loss variant."""
    return mm(dims.tokens, dims.h, dims.v)


def head_flops(setup: Setup, dims: Dims) -> tuple[int, int]:
    """(forward, backward) FLOPs of the lm head: the logits, and dX = dY·W plus dW = dYᵀ·X (2× forward) —
    in the forward phase for the fused loss, which makes both gradients there (FlopCounterMode counts
    them where they run)."""
    head = lm_head_flops(dims)
    if setup.loss is LossKind.FUSED:
        return (3 if head_trains(setup) else 2) * head, 0
    return head, 2 * head


def loop_labels_bytes(setup: Setup, dims: Dims) -> int:
    """The training loop's int64 labels [b, s] when no save of the loss is that storage (the fused loss
    keeps none; the chunked loss keeps copies when b > 1): alive beside the saves all the same."""
    if setup.loss is LossKind.FUSED:
        return 8 * dims.tokens
    copies = setup.loss is LossKind.CHUNKED and dims.b > 1 and len(chunk_sizes(dims.s, setup.loss_chunks)) > 1
    return 8 * dims.tokens if copies else 0


def loss_parallel_backward_transient(dims: Dims) -> int:
    """torchtitan's ``_LossParallelCrossEntropy.backward`` (components/loss.py) on a tensor-parallel rank,
    at ``(grad_input + torch.exp(log_probs))``, its highest point ([T, v] is the rank's [T, v/t]):
    ``grad_input = zeros_like(log_probs)``, ``exp(log_probs)`` and their sum, three fp32 [T, v]
    (12·T·v), beside its locals over the T tokens: ``safe_labels`` and ``local_labels`` (int64),
    ``out_of_range`` (bool), ``row_idx = arange(T)`` (int64), ``grad_update`` (fp32, after its fp32
    ``out_of_range.to`` copy is freed) and the masked ``grad_output`` [T, 1] (fp32): (8 + 8 + 1 + 8 + 4 +
    4)·T = 33·T; + 8: the division's fp32 output gradient (``loss / global_valid_tokens``' backward) and the
    summed loss it came from, beside the seed gradient the peak adds (measured on a tp 2 rank:
    tests/hf/test_torchtitan_peak.py)."""
    t = dims.tokens
    return 3 * 4 * t * dims.v + 33 * t + 8


def loss_tensors_known(setup: Setup) -> bool:
    """Whether the loss's tensors are counted one by one (``forward_loss_blocks``,
    ``loss_backward_blocks``): torchtitan's eager standard loss on one stage — its ``cross_entropy``, or
    on a tensor-parallel rank its loss-parallel function (``loss_parallel_function``) — eager without
    ``--compile`` or, under it, with the loss left eager (``--no-compile-loss``: ``ImplConfig.
    compile_loss``; torchtitan 0.3.0 compiles it by default, whose Inductor buffers are not modelled); and
    the reference's (``measure/reference/loss.py``' ``standard_loss``: the same P, X = P.float() and
    log-probs, X freed as ``log_softmax`` returns, then P; measured in the CUDA allocator's snapshot of
    GPT-2 on an H200, docs/gpu-profile.md)."""
    return (
        setup.impl.impl in (Impl.TORCHTITAN, Impl.REFERENCE)
        and setup.loss is LossKind.STANDARD
        and (setup.parallel.tp == 1 or profile_of(setup).loss_parallel_function)
        and setup.parallel.pp == 1
        and not (setup.impl.compile and setup.impl.compile_loss)
        and not setup.offload
    )


def forward_loss_blocks(setup: Setup, dims: Dims) -> tuple[int, ...]:
    """The forward's loss moment, tensor by tensor (the allocator's blocks; empty where not modelled): the
    lm head's output P [T, v] in the activations' dtype, its fp32 copy X and the fp32 log-probs L that
    ``log_softmax`` makes from X, alive together. torchtitan's trainer holds ``pred`` (P) through
    ``loss = self.loss_fn(pred, labels)`` and ``del pred`` only after it ("need to free to before bwd to
    avoid peaking memory"); its ``cross_entropy_loss`` is ``F.cross_entropy(pred.flatten(0, 1).float(),
    …)``: X = P.float() (torchtitan/components/loss.py; the December-2024 code of the 2025 tables upcast
    in the model, ``self.output(h).float()``, and freed P earlier: the same three blocks are made). X is
    freed when the loss returns (log_softmax keeps its output only), then P. 4 bytes more: the loss.

    On a tensor-parallel rank ([T, v] the rank's [T, v/t]) torchtitan 0.3.0's
    ``_LossParallelCrossEntropy.forward`` (components/loss.py) holds, beside P, ``logits_2d =
    logits.flatten(0, -2).float()`` (X), ``shifted = logits_2d - local_max`` and ``torch.exp(shifted)``
    at its ``torch.sum``: four blocks, X, ``shifted`` and the exponent fp32; the exponent freed,
    ``log_probs = shifted - torch.log(…)`` takes its block (saved), X and ``shifted`` are freed when it
    returns. The December-2024 code's ``loss_parallel()`` (torch/distributed/tensor/parallel/loss.py
    ``_log_softmax``: ``shifted = x - x_max``, ``torch.exp(shifted)``, ``result = shifted - …``) makes the
    same blocks on the model's fp32 output (P freed before them: one segment more, not one byte more at
    the peak)."""
    if not loss_tensors_known(setup):
        return ()
    t, v = dims.tokens, dims.v
    if setup.parallel.tp > 1:
        return (dims.act.bytes * t * v, 4 * t * v, 4 * t * v, 4 * t * v)
    return (dims.act.bytes * t * v, 4 * t * v, 4 * t * v)


def loss_backward_blocks(setup: Setup, dims: Dims) -> tuple[int, ...]:
    """``loss_backward_transient``'s fp32 [T, v] buffers as the tensors they are (empty where they are
    counted as one block): nll_loss's gradient (``zeros_like`` of the log-probs) and log_softmax's input
    gradient, two allocations; on a tensor-parallel rank the loss-parallel backward's three
    (``loss_parallel_backward_transient``: ``zeros_like``, ``exp`` and their sum)."""
    if not loss_tensors_known(setup):
        return ()
    count = 3 if setup.parallel.tp > 1 else 2
    return (4 * dims.tokens * dims.v,) * count


def loss_backward_transient(setup: Setup, dims: Dims) -> int:
    """The loss backward's buffers beside every save: nll_loss's gradient and log_softmax's input gradient,
    both fp32 [T, v] (standard); flash_attn's kernel writes one gradient of the logits, in their dtype
    (xentropy). The fused loss only scales its kept gradients in place: none. Transformer Engine's (te)
    writes its gradient over the kept logits, in place; the output layer's backward then makes its input
    gradient [T, h] beside it (its weight gradient summed into Megatron's fp32 ``main_grad`` by
    ``gradient_accumulation_fusion``, no new [v, h]): T·h in the activations' dtype.

    Chunked: autograd runs the chunks' backward last chunk first (the latest made), so the moment is the
    last chunk's log_softmax backward, 8·b·c_last·v, all the others' log-probs still alive; by then its
    nll_loss backward has released its fp32 total weight and, when they are copies (b > 1), its labels.
    NB: when the last chunk is much shorter (c_last < 2c/3) the next chunk's backward is larger; it is
    counted as 8·b·c·v less the last chunk's freed log-probs, without that chunk's dX and dW pieces."""
    if setup.loss is LossKind.FUSED:
        return 0
    if setup.loss is LossKind.STANDARD and profile_of(setup).loss_parallel_function and setup.parallel.tp > 1:
        return loss_parallel_backward_transient(dims)
    if setup.loss is LossKind.STANDARD:
        return 2 * 4 * dims.tokens * dims.v
    if setup.loss is LossKind.XENTROPY:  # dlogits = torch.empty_like(logits): one [T, v] in the logits' dtype
        return dims.act.bytes * dims.tokens * dims.v
    if setup.loss is LossKind.TE:  # the gradient written over the kept logits; then the output layer's dX
        return dims.act.bytes * dims.tokens * dims.h
    sizes = chunk_sizes(dims.s, setup.loss_chunks)
    first, longest = dims.b * sizes[-1], dims.b * sizes[0]
    freed = 4 + (8 * first if loop_labels_bytes(setup, dims) else 0)
    return max(8 * first * dims.v, 8 * longest * dims.v - 4 * first * dims.v) - freed


def head_backward_modelled(setup: Setup) -> bool:
    """Where the lm head's own backward is a moment of ``analytic.peak`` (``lm_head_backward_transient``):
    the standard loss or flash_attn's cross-entropy (its gradient of the logits one [T, v] in A as well)
    on one tensor-parallel rank, every parameter trained."""
    one_pass = setup.loss in (LossKind.STANDARD, LossKind.XENTROPY)
    standard = one_pass and not profile_of(setup).vocab_parallel_loss
    plain = standard and setup.model.final_softcap is None  # Gemma 2's tanh: another [T, v] chain
    return plain and setup.parallel.tp == 1 and setup.finetune.trains_everything


def lm_head_backward_transient(setup: Setup, dims: Dims) -> tuple[int, int]:
    """(saves freed, bytes made) at the lm head's backward at its dX in a later micro-batch whose
    gradients are summed into the earlier ones' (``profiles.accumulates_in_place``): the loss's [T, v]
    save is freed (the fp32 log-probs; flash_attn's logits in A and its fp32 lse [T]), log_softmax's input
    gradient [T, v] is alive in the logits' dtype A (mixed recipes cast it back), and the head's new weight
    gradient [v, h] (not yet summed: one node makes it and dX) beside its new dX [T, h], with the fp32
    loss scalar (+ 4, as at the loss's moment). With one micro-batch that gradient is the one the later
    moments count among the gradients; here it is new beside the sums, and the moment exceeds the loss's
    when v·h·g + T·h·A > T·v·(12 − A): few tokens on a wide model (measured on CPU: tests/measure/test_peak.py
    ``ACCUMULATED``; flash_attn's, tests/measure/test_loss.py: the reference's re-implementation 4 B
    below)."""
    a, t, v = dims.act.bytes, dims.tokens, dims.v
    freed = a * t * v + 4 * t if setup.loss is LossKind.XENTROPY else 4 * t * v
    made = t * v * a + v * dims.h * setup.training.precision.grad_bytes + t * dims.h * a
    return freed, made + 4


def _loss_chunks(setup: Setup, dims: Dims) -> list[int]:
    """The chunked loss's chunk lengths where there are two or more (``chunk_sizes``), else none."""
    sizes = chunk_sizes(dims.s, setup.loss_chunks) if setup.loss is LossKind.CHUNKED else []
    return sizes if len(sizes) > 1 else []


def chunked_head_backward_transient(setup: Setup, dims: Dims) -> tuple[int, int]:
    """(saves freed, bytes made) at torchtune's chunked loss's lm-head backward. The model makes every chunk's
    logits before the loss takes any, so autograd runs every chunk's loss backward first (each chunk's
    log-probs, nll_loss's normaliser and, b > 1, its labels copy freed; its gradient of the logits [b·c, v]
    left in the logits' dtype A), then the head's matmuls, last chunk first. The weight is used by each
    chunk's matmul: autograd sums the pieces of its gradient in the input buffer of the node that consumes
    them before passing the sum on, out of place (each piece is the transpose view the matmul's backward
    returns). At the second chunk's sum three [v, h] in A are alive: the two pieces and their sum; the two
    chunks' logits gradients and (b > 1) input copies are freed, their input gradients [b·c, h] alive
    until every chunk is back. Later sums hold three [v, h] too, with fewer logits gradients left. 0 with
    one chunk. Measured on CPU: tests/measure/test_loss.py.
    NB: with b = 1 and two chunks the measured moment holds neither chunk's input gradient (the estimate
    is above it by their [T, h]; not found why). A frozen head (LoRA) makes no weight gradient: no pieces
    to sum, its chunks' dX = dY·W alone, below the loss's backward (its fp32 [b·c, v] pair beside every
    log-probs): not a moment."""
    sizes = _loss_chunks(setup, dims)
    if not sizes or not head_trains(setup):
        return 0, 0
    a, b, h, v = dims.act.bytes, dims.b, dims.h, dims.v
    copies = b > 1
    freed = sum(4 * b * c * v + 4 + (8 * b * c if copies else 0) for c in sizes)  # every loss backward
    freed += sum(b * c * h * a for c in sizes[-2:]) if copies else 0  # the two chunks' input copies
    pending = sum(b * c * v * a for c in sizes[:-2])  # the logits gradients not yet through the head
    input_grads = sum(b * c * h * a for c in sizes[-2:])
    return freed, 3 * v * h * a + pending + input_grads


def chunked_loss_forward_transient(setup: Setup, dims: Dims, norm_upcasts: bool) -> int:
    """torchtune's chunked loss in forward, at the last chunk's log_softmax, beyond every save: the model
    makes every chunk's logits [b·c, v] (A) before the loss takes any — T·v in all, alive until the loss
    returns — and the loss upcasts one chunk at a time (its fp32 copy [b·c, v], freed by nll_loss; none
    when A is fp32) and adds each chunk's loss into a running fp32 sum: at the last chunk's log_softmax its
    fp32 copy is the moment (its nll_loss normaliser not made yet), or, with no copy, the last addition
    (the chunk's loss, the sum before and the sum after, 12 bytes). The forward that made the chunks
    still holds what it cut them from: the final norm's output [b, s, h] (a save itself when b = 1 and the
    head trains, the chunks its views; b > 1 copies each; a frozen head's keep none) and, where the final
    norm saved an upcast copy of its input (``norm_upcasts``), the last layer's output [b, s, h] —
    memplan's reference model, whose forward runs the loss; torchtune's decoder returns the logits first
    and frees them ([T, h] less; not modelled apart). Above the loss backward's two fp32 chunk gradients
    whenever there are two chunks or more: the chunked loss's peak is its forward's. 0 for the other
    losses (their forward's transient is below their backward's). Measured on CPU:
    tests/measure/test_loss.py (torchtune's ``chunked_output`` and ``CEWithChunkedOutputLoss`` do the
    same: the list of logits, each chunk's ``.float()`` inside the loss, ``del logits`` after it)."""
    sizes = _loss_chunks(setup, dims)
    if not sizes:
        return 0
    a, b, th = dims.act.bytes, dims.b, dims.tokens * dims.h
    copy = 4 * b * sizes[-1] * dims.v if a < 4 else 0
    # the final norm's output: not a save where b > 1 (each chunk copied) or the head is frozen (LoRA: its
    # matmuls keep no input), held by the forward all the same
    output_saved = b == 1 and head_trains(setup)
    held = (0 if output_saved else th * a) + (th * a if norm_upcasts else 0)
    return dims.tokens * dims.v * a + held + max(copy, 12)
