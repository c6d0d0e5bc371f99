"""Run torchtitan's own Llama 3 for a setup (``--impl torchtitan``) and record what it keeps.

``measure_titan(setup)`` builds torchtitan's ``Llama3Model`` (torchtitan 0.3.0,
``torchtitan/models/llama3``) from memplan's ``ModelConfig`` as its flavours do (``llama3/__init__.py``
``_build_llama3_layers``: fused ``wqkv``, ``ComplexRoPE``, ``nn.RMSNorm``, the SwiGLU ``FeedForward`` with
memplan's ffn as its final ``hidden_dim``) under ``FakeTensorMode`` on CPU, its parameters in the activation
dtype (what FSDP2's ``MixedPrecisionPolicy(param_dtype)`` computes in; the complex RoPE cache stays
complex64, as FSDP casts parameters only), runs forward, torchtitan's loss as its trainer calls it
(``components/loss.py`` ``CrossEntropyLoss``: the logits upcast to fp32, ``reduction="sum"``, divided by
the int64 count of valid labels, ``global_valid_tokens``) and backward, and records every
saved storage per decoder layer (``memplan.measure.frameworks.step.run_step``). ``--checkpointing full`` is
torchtitan's ``FullAC`` (``distributed/activation_checkpoint.py``: torch's ``checkpoint_wrapper``,
non-reentrant, on every block); ``--checkpointing selective`` is its ``SelectiveAC`` (the per-op policy,
default config), whose cache of saved op outputs is counted per layer after forward (``keep_sac``).
``--compile`` is torchtitan's ``apply_compile`` (``torch.compile`` of each block): ``measure_titan_compiled``
runs each block through AOTAutograd's min-cut partitioner under fake tensors
(``memplan.measure.runs.compiled``) and sets its saves in place of the eager block's.

Known limitations:
- NB: the attention is torchtitan's ``ScaledDotProductAttention`` (causal SDPA, no document mask): 0.3.0's
  language-model configs pick flex or varlen attention (``get_attention_config``), which need a GPU or
  torch.compile; SDPA is what memplan's ``flash`` attention is (on CPU torch's flash kernel).
- NB: ``every-K`` (0.3.0 checkpoints every block) is refused, and ``selective`` on CUDA above head dim 128
  (``memplan.config.impl_rules.check_impl``).
- NB: ``--device cuda``: the inner SDPA is the cuDNN op torch dispatches on a GPU (``cudnn_attention``), run
  by its meta kernel, and ``nn.RMSNorm`` is CUDA's ``aten._fused_rms_norm`` with its own autograd node
  (``titan_norm.cuda_rms_norm``); every other op keeps its CPU kernel.
- NB: ``--fp8`` converts through torchtitan's ``Float8LinearConverter.convert`` (``float8_config``). 0.3.0's
  converter names the rowwise recipes only; ``--fp8 tensorwise`` hands it torchao's tensorwise
  ``Float8LinearConfig``, the recipe of torchtitan's Dec-2024 converter (torchtitan/float8.py:
  ``Float8LinearConfig()``, torchao's default tensorwise dynamic scaling, every linear but ``output``), which
  the published Grand Teton runs trained with: the same torchao ``Float8Linear`` modules its
  ``convert_to_float8_training`` made. 0.3.0's filter also skips dims not a multiple of 16 (Llama's all
  are).
- NB: torchtitan is an optional extra (``pip install 'memplan[torchtitan]'``); ``require_torchtitan`` says so.
- NB: without ``--cp`` the model runs without ``positions`` (RoPE reads a prefix view of each layer's cache);
  torchtitan's trainer passes the dataset's positions (``hf_datasets/text_datasets.py``), which makes each
  layer gather its own [b, s, d/2] table as under ``--cp`` below.

Context parallelism (``--cp c``, ``cp_rank``): one rank of torchtitan's ``apply_cp_to_forward``
(``distributed/context_parallel/api.py``) in one process. The trainer's ``prepare_context_parallel_input``
shards the inputs, the labels and the positions along the sequence with ``_HeadTailLoadBalancer`` (chunks r
and 2c−1−r), not the RoPE caches: every layer keeps its whole [seq, d/2] complex64 buffer and gathers the
rank's rows from it by position (``rope._reshape_for_broadcast``: ``torch.gather``, or indexing at b = 1).
torchtitan wraps the inner SDPA's q, k, v as sequence-sharded DTensors so that torch's CP dispatcher runs
``_templated_ring_attention`` inside the SDPA op; its handler covers the CUDA kernels only, so here the
inner attention calls the same ring functions with the CPU flash kernel (``reference.context.ring_flash``)
over torch's fake process group, under the setup's ``--cp-rotate`` (``set_rotate_method``): the ring, its
merges and what autograd saves for the one op (q, k, v, the merged output and lse) are torch's. With
``--device cuda`` the inner attention is torch's own CUDA ring entry point instead, with cuDNN's kernel as
torchtitan's SDPA picks it (``_scaled_dot_product_ring_cudnn_attention``, its meta kernel under the fake
mode: ``reference.context.RingCuda``), which also saves the op's philox seed and offset.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import replace
from functools import partial
from types import SimpleNamespace
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_leaves

from memplan.config import Checkpointing, Device, Fp8Recipe, NormKernel, Setup
from memplan.measure.frameworks.step import PathRecorder, activation_dtype, run_step
from memplan.measure.frameworks.titan_attention import cudnn_attention, ring_attention, ring_kernel
from memplan.measure.frameworks.titan_norm import cuda_rms_norm
from memplan.measure.instruments.measured import Measured
from memplan.measure.instruments.record import SavedRecord, layer_scope
from memplan.measure.reference.context import rotate_method
from memplan.measure.runs.compiled import partitioned_forward, saved_records
from memplan.measure.runs.run import make_batch, ring

INSTALL = "pip install 'memplan[torchtitan]'"


def require_torchtitan() -> Any:
    """torchtitan's modules the measurement builds from, or a one-line ``ValueError`` saying how to install
    them (its model code imports spmd_types, tyro, torch_checkpointing and triton)."""
    try:
        from torchtitan.components import loss
        from torchtitan.distributed import activation_checkpoint
        from torchtitan.models import common
        from torchtitan.models.common import attention, config_utils
        from torchtitan.models.llama3 import model
    except ImportError as e:
        raise ValueError(
            f"impl: --impl torchtitan runs torchtitan's Llama 3, not importable ({e}); {INSTALL}"
        ) from None
    return SimpleNamespace(
        loss=loss,
        ac=activation_checkpoint,
        common=common,
        attention=attention,
        utils=config_utils,
        model=model,
    )


def check_titan(setup: Setup) -> None:
    """One-line error before building: torchtitan not importable (what torchtitan's Llama 3 cannot be is
    refused with the setup: ``memplan.config.impl_rules.check_impl``)."""
    require_torchtitan()


def titan_config(setup: Setup) -> Any:
    """``Llama3Model.Config`` for ``setup.model`` as ``_build_llama3_layers`` builds a flavour: the RoPE
    cache sized to the training sequence (``Decoder.Config.update_from_config`` sets ``max_seq_len`` to
    ``training.seq_len``)."""
    tt, m = require_torchtitan(), setup.model
    common, utils = tt.common, tt.utils
    h, v = m.hidden_size, m.vocab_size

    def norm() -> Any:  # one config per norm: the sharding plan sets the final norm's apart from the layers'
        return common.RMSNorm.Config(normalized_shape=h, eps=m.norm_eps)

    rope = common.ComplexRoPE.Config(dim=m.dim, max_seq_len=setup.training.seq_len, theta=m.rope_theta)
    layer = tt.model.Llama3TransformerBlock.Config(
        attention_norm=norm(),
        ffn_norm=norm(),
        attention=utils.make_gqa_config(
            dim=h,
            n_heads=m.num_heads,
            n_kv_heads=m.kv_heads,
            head_dim=m.dim if m.dim * m.num_heads != h else None,
            wqkv_param_init={},
            wo_param_init={},
            inner_attention=tt.attention.ScaledDotProductAttention.Config(),
            fuse_qkv=True,
            rope=rope,
        ),
        feed_forward=utils.make_ffn_config(dim=h, hidden_dim=m.ffn, w1_param_init={}, w2w3_param_init={}),
    )
    return tt.model.Llama3Model.Config(
        dim=h,
        vocab_size=v,
        enable_weight_tying=m.tied_embeddings,
        tok_embeddings=common.Embedding.Config(num_embeddings=v, embedding_dim=h),
        norm=norm(),
        lm_head=common.Linear.Config(in_features=h, out_features=v),
        layers=[layer] * m.num_layers,
    )


def float8_config(setup: Setup, config: Any) -> Any:
    """Under ``--fp8 rowwise|tensorwise``: ``config`` through torchtitan's own
    ``Float8LinearConverter.convert`` (components/quantization/float8.py: every ``Linear.Config`` whose
    dims are multiples of 16 becomes its ``Float8Linear.Config`` with torchao's recipe),
    ``filter_fqns=["lm_head"]`` as its ``llama3_405b`` config. Its ``__init__`` refuses a machine without
    SM89 (or asks for ``emulate``, which swaps in another recipe), so the converter's state is set here as
    that ``__init__`` sets it on an H100."""
    if setup.impl.fp8 is Fp8Recipe.NONE:
        return config
    from torchtitan.components.quantization.float8 import Float8LinearConverter
    from torchtitan.components.quantization.utils import module_filter_fn

    from memplan.measure.reference.fp8 import torchao_config

    state = SimpleNamespace(
        enabled=True,
        torchao_config=torchao_config(setup.impl.fp8),
        filter_fn=partial(module_filter_fn, filter_fqns=["lm_head"]),
    )
    return Float8LinearConverter.convert(state, config)


def build(setup: Setup) -> Any:
    """torchtitan's Llama 3 for ``setup``, its parameters in the activation dtype, in training mode (call
    under a fake mode), its linears torchao's ``Float8Linear`` under ``--fp8``, and its activation
    checkpointing (``apply_ac``)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(activation_dtype(setup))  # the cache is computed in fp32 explicitly: complex64
    try:
        model = float8_config(setup, titan_config(setup)).build()
    finally:
        torch.set_default_dtype(default)
    apply_ac(model, setup)
    model.train()
    return model


def apply_ac(model: Any, setup: Setup) -> None:
    """torchtitan's activation checkpointing for ``--checkpointing``: ``FullAC`` or ``SelectiveAC`` (their
    configs' defaults, as the trainer's) on every block."""
    tt, checkpointing = require_torchtitan(), setup.strategy.checkpointing
    if checkpointing is Checkpointing.FULL:
        tt.ac.FullAC(tt.ac.FullAC.Config()).apply(model)
    elif checkpointing is Checkpointing.SELECTIVE:
        tt.ac.SelectiveAC(tt.ac.SelectiveAC.Config()).apply(model)


def capture_sac(layers: list[Any]) -> dict[int, Any]:
    """Each ``SelectiveAC`` block's cache: its ``checkpoint_fn``'s ``context_fn`` wrapped so the storage of
    the caching mode it makes (``torch.utils.checkpoint.create_selective_checkpoint_contexts``: the
    outputs of the ops the policy saves, held from forward to the block's backward) is kept per layer."""
    caches: dict[int, Any] = {}
    for i, layer in enumerate(layers):
        fn = layer.checkpoint_fn  # partial(torch.utils.checkpoint.checkpoint, context_fn=..., ...)
        make = fn.keywords["context_fn"]

        def context_fn(make: Any = make, i: int = i) -> Any:
            modes = make()
            caches[i] = modes[0].storage  # op key → {call index → outputs or _RECOMPUTE}
            return modes

        layer.checkpoint_fn = partial(fn.func, *fn.args, **{**fn.keywords, "context_fn": context_fn})
    return caches


def cached_tensors(storage: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors one SAC cache holds, named ``sac · <op>``: each saved op's outputs (``_VersionWrapper``'s
    ``val``); ``_RECOMPUTE`` entries hold nothing."""
    for key, calls in storage.items():
        for out in calls.values():
            for leaf in tree_leaves(out):
                t = getattr(leaf, "val", None)
                if isinstance(t, torch.Tensor):
                    yield f"sac · {key}", t


def keep_sac(caches: dict[int, Any]) -> Callable[[PathRecorder], None]:
    """After forward: every tensor a block's SAC cache holds counted as kept by that layer
    (``sac · <op>``); the ops it recomputes hold nothing until backward."""

    def after_forward(recorder: PathRecorder) -> None:
        for i, storage in caches.items():
            with layer_scope(i):
                for name, t in cached_tensors(storage):
                    recorder.keep(t, name)

    return after_forward


def titan_path(path: str) -> str:
    """A module path inside block i: the part below ``layers.i`` (and below ``checkpoint_wrapper``'s
    ``_checkpoint_wrapped_module``)."""
    path = path.replace("_checkpoint_wrapped_module.", "").removesuffix("._checkpoint_wrapped_module")
    return re.sub(r"^layers\.\d+\.", "", path)


def rope_buffers(model: Any) -> SavedRecord:
    """Every block's RoPE cache buffer (module buffers, alive all step) as one model-level record of their
    storages' bytes: under ``--cp`` autograd keeps the gathered rows, not the buffers, so the run reads
    them from the model (``rope.caches`` in the estimate)."""
    caches = [block.attention.rope.cache for block in model.layers.values()]
    nbytes = sum(c.untyped_storage().nbytes() for c in caches)
    return SavedRecord("rope · buffers", None, (len(caches), *caches[0].shape), "complex64", nbytes)


def measure_titan(setup: Setup, fake: bool = True, cp_rank: int | None = None) -> Measured:
    """One forward (torchtitan's loss) and backward of torchtitan's Llama 3 for ``setup`` on CPU; with
    ``--cp`` as rank ``cp_rank`` of the ring (module docstring; by default ``--cp-rank``'s, else 0)."""
    torch.manual_seed(0)
    cp = setup.parallel.cp
    if cp_rank is None:
        cp_rank = setup.parallel.cp_rank or 0
    with (
        ring(cp, cp_rank, "cpu") as group,
        rotate_method(setup.parallel.cp_rotate.value) if cp > 1 else nullcontext(),
        FakeTensorMode(allow_non_fake_inputs=True) if fake else nullcontext(),
    ):
        return titan_step(build(setup), setup, group=group, cp_rank=cp_rank)


def titan_step(
    model: Any,
    setup: Setup,
    recorder_type: type[PathRecorder] = PathRecorder,
    group: Any = None,
    cp_rank: int = 0,
    after_forward: Callable[[PathRecorder], None] | None = None,
) -> Measured:
    """One step of a built torchtitan model (call under the fake mode, if any): torchtitan's loss as its
    trainer calls it, every save recorded per layer, ``SelectiveAC``'s cache counted after forward; with a
    context-parallel ``group``, rank ``cp_rank``'s share of the sequence through torch's ring;
    ``after_forward`` sees the recorder once the loss is computed (after the cache is counted)."""
    tt = require_torchtitan()
    ids, labels = make_batch(setup, "cpu")
    positions = None
    cp = setup.parallel.cp
    if cp > 1:
        from memplan.measure.reference.context import head_tail_positions

        mine = head_tail_positions(ids.shape[1], cp, cp_rank)
        ids, labels = ids[:, mine], labels[:, mine]
        # the dataset's positions [b, s] (one document: 0…s−1), sharded as the inputs: a new [b, s/c]
        positions = torch.arange(setup.training.seq_len).expand(ids.shape[0], -1)[:, mine]
    if group is not None:
        ring_attention(model, group, ring_kernel(setup))
    elif cp == 1 and setup.device is Device.CUDA:
        cudnn_attention(model)
    layers = [(layer, "checkpoint_fn") for layer in model.layers.values()]
    loss_fn = tt.loss.CrossEntropyLoss(tt.loss.CrossEntropyLoss.Config())
    # trainer.py: local_valid_tokens = tensor(0, int64) + (labels != IGNORE_INDEX).sum()
    tokens = torch.tensor(0, dtype=torch.int64) + (labels != tt.loss.IGNORE_INDEX).sum()

    def forward() -> torch.Tensor:
        return loss_fn(model(ids, positions), labels, global_valid_tokens=tokens)[0]

    checkpointed = setup.strategy.checkpointing is not Checkpointing.NONE
    selective = setup.strategy.checkpointing is Checkpointing.SELECTIVE
    cache = keep_sac(capture_sac(list(model.layers.values()))) if selective else None

    def after(recorder: PathRecorder) -> None:
        for hook in (cache, after_forward):
            if hook is not None:
                hook(recorder)

    fused = setup.device is Device.CUDA and setup.impl.norm_kernel is NormKernel.AUTO
    fused_norm = cuda_rms_norm() if fused else nullcontext()
    with fused_norm:
        measured = run_step(model, layers, forward, checkpointed, titan_path, after, recorder_type)
    if cp > 1:
        measured.records.append(rope_buffers(model))
    return measured


def compiled_block_records(setup: Setup, layer: int = 0) -> list[SavedRecord]:
    """What one torchtitan block keeps under ``torch.compile`` (``apply_compile``: each block compiled
    alone): AOTAutograd's min-cut partitioner over the block, its parameters and its rotary cache buffer
    as inputs (``memplan.measure.runs.compiled``)."""
    m, t = setup.model, setup.training
    one = setup.model_copy(update={"model": m.model_copy(update={"num_layers": 1})})
    with torch.device("meta"):
        block = build(one).layers["0"]
    meta = dict(block.named_parameters())
    buffers = dict(block.named_buffers())
    compiled, graphs = partitioned_forward(
        lambda inputs, x: torch.func.functional_call(block, inputs, (x, None))
    )
    with FakeTensorMode(allow_non_fake_inputs=True):
        inputs = {k: torch.empty(v.shape, dtype=v.dtype, requires_grad=True) for k, v in meta.items()}
        inputs.update({k: torch.empty(v.shape, dtype=v.dtype) for k, v in buffers.items()})
        x = torch.empty(t.micro_batch, t.seq_len, m.hidden_size, dtype=activation_dtype(setup))
        compiled(inputs, x.requires_grad_()).sum().backward()
    return saved_records(graphs["forward"], len(inputs), 1, layer)


def compiled_sac_block_records(setup: Setup, layer: int = 0) -> list[SavedRecord]:
    """What one torchtitan block under ``SelectiveAC`` keeps under ``torch.compile``: the checkpoint-wrapped
    block compiled by dynamo (which turns the selective checkpoint into its higher-order op, the policy's
    tags on its nodes) with AOTAutograd's backend — Inductor's decompositions, the min-cut partitioner,
    graphs recorded and run boxed, no kernel compiled — under fake tensors. The saves are the forward
    graph's outputs beyond the block's output (``runs.compiled.saved_records``: parameters and buffers
    are no new memory; the block input is; a symbolic size — the CPU generator state kept for the CPU
    flash op's re-run — is not counted)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch._aot_autograd.utils import make_boxed_func
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    m, t = setup.model, setup.training
    one = setup.model_copy(update={"model": m.model_copy(update={"num_layers": 1})})
    graphs: dict[str, Any] = {}

    def record(kind: str) -> Any:
        def compiler(gm: Any, _inputs: Any) -> Any:
            graphs[kind] = gm
            return make_boxed_func(gm.forward)

        return compiler

    backend = aot_autograd(
        fw_compiler=record("forward"),
        bw_compiler=record("backward"),
        partition_fn=min_cut_rematerialization_partition,
        decompositions=select_decomp_table(),
    )
    torch._dynamo.reset()
    with FakeTensorMode(allow_non_fake_inputs=True):
        block = build(one).layers["0"]
        x = torch.empty(t.micro_batch, t.seq_len, m.hidden_size, dtype=activation_dtype(setup))
        out = torch.compile(block, backend=backend, dynamic=False)(x.requires_grad_(), None, None)
        out.sum().backward()
    torch._dynamo.reset()
    forward = graphs["forward"]
    shape = tuple(x.shape)
    placeholders = [n for n in forward.graph.nodes if n.op == "placeholder"]
    x_at = next(i for i, n in enumerate(placeholders) if tuple(n.meta["val"].shape) == shape)
    records = saved_records(forward, x_at, 1, layer)
    return [r for r in records if not r.name.endswith("(input)")] + [
        r for r in records if r.name.endswith("(input)")
    ]


def measure_titan_compiled(setup: Setup) -> Measured:
    """torchtitan's Llama with every block compiled (``--compile``): the eager run's model-level saves and
    FLOPs (the embedding, final norm, head and loss stay eager; the partitioner runs the same matmuls), and
    each block's compiled saves; with ``FullAC`` a checkpointed block keeps its input alone."""
    eager = setup.model_copy(update={"impl": setup.impl.model_copy(update={"compile": False})})
    base = measure_titan(eager)
    if setup.strategy.checkpointing is Checkpointing.FULL:
        return base
    selective = setup.strategy.checkpointing is Checkpointing.SELECTIVE
    block = compiled_sac_block_records(setup) if selective else compiled_block_records(setup)
    layers = [replace(r, layer=i) for i in range(setup.model.num_layers) for r in block]
    model = [r for r in base.records if r.layer is None]
    return Measured(records=model + layers, flops=base.flops, by_op=base.by_op)
