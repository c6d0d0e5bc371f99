"""One rank of torchtitan's Llama 3 parallelised by torchtitan's own plan, in one process
(``--impl torchtitan --tp T [--sp]`` with a data-parallel degree and ``--cp``, at any world size).

``measure_titan_rank(setup)`` joins torch's fake process group (``FakeStore``: collectives return
tensors of the right shape and move nothing) as one rank of dp · cp · tp ranks (``rank_of``), builds
torchtitan's ``Llama3Model`` on the meta device (``memplan.measure.frameworks.titan.titan_config``) with
torchtitan's own sharding plan (``models/llama3/sharding.py`` ``set_llama3_sharding_config``:
``colwise_config`` on ``wqkv``, ``w1``, ``w3``; ``rowwise_config`` on ``wo``, ``w2``; SP norms; the
vocabulary-parallel embedding and lm head) applied by torchtitan's ``Module.parallelize(parallel_dims)`` (the
``partial_dtensor`` SPMD backend: DTensor on the tensor-parallel axis), its ``FullAC`` / ``SelectiveAC``,
and FSDP2 over dp with torchtitan's ``apply_fsdp_to_decoder`` (``reshard_after_forward_policy``
``"default"``, torchtitan's trainer default, for ZeRO-3: blocks and embedding resharded after forward,
[norm, lm_head] not; ``"never"`` for ZeRO-2; HSDP over ``["dp_replicate", "fsdp"]`` with
``--hsdp``). The parameters are then materialised under ``FakeTensorMode`` (``to_empty``) and one forward,
torchtitan's loss and backward run, every saved storage recorded per layer by its local shard, and the
live storages tracked for the peak (``titan_peak``).

Known limitations:
- NB: torchtitan 0.3.0's default backend is ``spmd_types`` (local tensors with explicit collectives); the
  ``partial_dtensor`` backend runs here because the default one leaves parameters plain, which FSDP2's
  ``fully_shard`` rejects on the CPU build (the sharding plan and the module-boundary redistributions are
  the same declarations, ``protocols/module.py``).
- NB: ``parallel_dims`` resolves its device to ``cuda``; the mesh is built on ``cpu`` (``device_type``
  patched for the build), so every kernel is the CPU one (the CPU flash SDPA).
- NB: the peak of forward and backward is measured and set beside the estimate's moments
  (``titan_peak``: FSDP2's resizes followed), not judged: ``trace`` exits on the saves and parameters,
  and shows the peak's moments with their differences (``titan_peak``'s NBs say which are not exact).
- NB: under ``--cp`` each block's attention is torch's ring over the mesh's cp group with the CPU flash
  kernel (``frameworks.titan_attention.ring_attention``), the rank's ids and positions sharded head-tail as
  torchtitan's trainer shards them, and FSDP2 shards over dp × cp (torchtitan's "fsdp" axis).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from memplan.blocks.profiles import compile_modelled
from memplan.blocks.torchtitan import fsdp2_mixed
from memplan.config import Checkpointing, FsdpWrap, Setup, ZeroStage
from memplan.measure.distributed import titan_fp8_tp
from memplan.measure.distributed.instruments import ParameterStorages, local
from memplan.measure.distributed.titan_compiled import block_input, compiled_blocks
from memplan.measure.distributed.titan_peak import (
    PeakRun,
    PeakTracker,
    boundaries,
    fsdp2_resizes,
    grads_of,
    peak_json,
    propagation_unseen,
)
from memplan.measure.frameworks.step import PathRecorder, activation_dtype
from memplan.measure.frameworks.titan import (
    apply_ac,
    float8_config,
    require_torchtitan,
    titan_config,
    titan_step,
)
from memplan.measure.frameworks.titan_attention import ring_attention, ring_kernel
from memplan.measure.instruments.measured import Measured
from memplan.measure.instruments.record import storage_ref
from memplan.measure.instruments.tracker import data_tensors
from memplan.measure.reference.context import rotate_method


@dataclass(frozen=True)
class RankRun:
    """One rank's step: what autograd kept, the bytes of the parameters the rank holds at rest, and the
    peak of its forward and backward."""

    measured: Measured
    param_bytes: int
    """Local shards of every parameter (FSDP2's padded dim-0 shard, the TP shard), after the step."""
    grad_bytes: int
    """Distinct local storages of every parameter's gradient after the step (FSDP2's reduce-scattered
    shards; without FSDP the gradients autograd left, ``Partial`` ones whole)."""
    peak: PeakRun
    """The highest live bytes over forward and backward, and what was alive then (``titan_peak``)."""


@contextmanager
def fake_world(rank: int, world: int) -> Iterator[None]:
    """The default process group as ``rank`` of ``world`` on torch's fake backend, torn down after; the CPU
    "host" counted as a GPU node of ``blocks.dtensor_cost.HOST_DEVICES`` devices where DTensor prices its
    redistributions (``MeshTopoInfo.build_from_mesh`` asks ``device_count()``: 1 on CPU, which would put
    every tensor-parallel group between hosts and could change the strategies it picks)."""
    from unittest import mock

    from torch.testing._internal.distributed.fake_pg import FakeStore

    from memplan.blocks.dtensor_cost import HOST_DEVICES

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        with mock.patch.object(torch.cpu, "device_count", lambda: HOST_DEVICES):
            yield
    finally:
        dist.destroy_process_group()


def world_size(setup: Setup) -> int:
    return setup.parallel.tp * setup.parallel.cp * setup.strategy.dp


def rank_of(setup: Setup) -> int:
    """The traced rank: data-parallel and tensor-parallel coordinate 0, context-parallel coordinate
    ``--cp-rank`` (0 by default) of torchtitan's row-major ["dp_replicate", "dp_shard", "cp", "tp"] world."""
    return (setup.parallel.cp_rank or 0) * setup.parallel.tp


def parallel_dims(setup: Setup) -> Any:
    """torchtitan's ``ParallelDims``: dp_shard = dp (``--hsdp R``: R shards, dp / R replicas), cp, tp, the
    ``partial_dtensor`` backend, on a CPU mesh (FSDP2 over its "fsdp" axis: dp_shard × cp)."""
    from torchtitan.distributed import ParallelDims, parallel_dims
    from torchtitan.distributed.utils import set_spmd_backend

    set_spmd_backend("partial_dtensor")  # what cross_entropy_loss and the modules read
    parallel_dims.device_type = "cpu"
    tp, dp, shard = setup.parallel.tp, setup.strategy.dp, setup.strategy.shard_group
    dims = ParallelDims(
        dp_replicate=dp // shard,  # HSDP (--hsdp R): replicas of R-way shards
        dp_shard=shard,
        cp=setup.parallel.cp,
        tp=tp,
        pp=1,
        ep=1,
        world_size=world_size(setup),
        spmd_backend="partial_dtensor",
    )
    dims.build_mesh()
    return dims


def reshard_policy(setup: Setup) -> str:
    """``reshard_after_forward_policy``: ZeRO-3 runs torchtitan's trainer default, "default"
    (torchtitan 0.3.0 config/configs.py ``Parallelism.fsdp_reshard_after_forward = "default"``), which
    torchtitan/distributed/fsdp.py resolves as: the embedding and each block resharded after forward
    unless pp is enabled (``get_fsdp_reshard_after_forward_policy``: ``not pp_enabled``), the
    [norm, lm_head] unit never (``reshard_after_forward_policy == "always"``: FSDP would prefetch it
    again at once), the root ``fully_shard(model)`` holding no parameters of its own. ZeRO-2 keeps the
    gathered parameters from forward to backward ("never")."""
    return "default" if setup.strategy.zero >= ZeroStage.PARAMETERS else "never"


def build_dtype(setup: Setup) -> torch.dtype:
    """The dtype the rank's model is built in: fp32 where FSDP2's mixed precision applies, as torchtitan
    0.3.0's trainer builds it (train.py: the model is built on meta in fp32 and FSDP2's
    ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` casts the gathered parameters
    only: ``blocks.torchtitan.fsdp2_mixed``); else the activation dtype (NB: without FSDP torchtitan
    trains the fp32 model under ``torch.autocast``, not modelled)."""
    return torch.float32 if fsdp2_mixed(setup) else activation_dtype(setup)


def meta_model(setup: Setup) -> Any:
    """torchtitan's Llama 3 for ``setup`` on the meta device in ``build_dtype`` (fp32 under FSDP2's mixed
    precision), its linears torchao's ``Float8Linear`` under ``--fp8`` (``float8_config``: torchtitan's
    converters rewrite the config at ``model_registry``, before ``update_from_config`` sets the sharding),
    its TP plan configured (``set_llama3_sharding_config``: SP or not)."""
    require_torchtitan()
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    config = float8_config(setup, titan_config(setup))
    if setup.impl.fp8_tp:
        titan_fp8_tp.set_sharding(config)  # the blocks laid out by torchao's float8 plan (parallelize_part)
    else:
        set_llama3_sharding_config(config, enable_sp=setup.parallel.sp)
    default = torch.get_default_dtype()
    torch.set_default_dtype(build_dtype(setup))
    try:
        with torch.device("meta"):
            model = config.build()
    finally:
        torch.set_default_dtype(default)
    if setup.impl.fp8_all_gather:
        wrap_float8_weights(model)
    return model


def split_part(model: Any, names: list[str]) -> Any:
    """torchtitan's ``_split_module(model, names)`` (distributed/pipeline_parallel.py), given a copy of
    ``model`` that holds only the layers it keeps. ``_split_module`` deep-copies the whole model and then
    drops the other layers (and sets the other top-level modules to None); here it deep-copies a shallow
    copy whose ``layers`` ModuleDict holds only the kept entries — the same keys, modules and order, so the
    same module comes out, without copying the layers it drops (125 of 126 per virtual stage of the 405B
    pipelines). ``model`` is not changed: the shallow copy has its own ``_modules``."""
    from torch import nn
    from torchtitan.distributed.pipeline_parallel import _split_module

    layers = model._modules.get("layers")
    if not isinstance(layers, nn.ModuleDict):  # only the ModuleDict case is shortened
        return _split_module(model, names)
    kept = {n.split(".", 1)[1] for n in names if n.startswith("layers.")}
    fewer = copy.copy(layers)  # the ModuleDict's own attributes (training, hooks) as they are
    fewer._modules = {k: v for k, v in layers._modules.items() if k in kept}
    shallow = copy.copy(model)
    shallow._modules = {**model._modules, "layers": fewer}
    return _split_module(shallow, names)


def wrap_float8_weights(model: Any) -> None:
    """``--fp8-all-gather``: every ``Float8Linear``'s weight wrapped as torchao's ``Float8Linear.from_float``
    does under ``enable_fsdp_float8_all_gather`` (``WeightWithDynamicFloat8CastTensor``, whose
    ``fsdp_pre_all_gather`` casts the fp32 shard to float8 and ``fsdp_post_all_gather`` makes the unsharded
    ``Float8TrainingTensor``): torchtitan 0.3.0's converter builds ``Float8Linear`` by its ``__init__``,
    which never wraps it (blocks/fp8.py NB), where the Dec-2024 torchtitan went through
    ``convert_to_float8_training`` → ``from_float``."""
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    for module in model.modules():
        if isinstance(module, Float8Linear):
            target = module.config.cast_config_weight.target_dtype
            wrapped = WeightWithDynamicFloat8CastTensor(module.weight, module.linear_mm_config, target)
            module.weight = torch.nn.Parameter(wrapped, requires_grad=module.weight.requires_grad)


def parallelize_part(part: Any, setup: Setup, dims: Any, pp_enabled: bool) -> Any:
    """``part`` (the model, or one pipeline stage's module) parallelised as torchtitan's
    ``parallelize_llama`` does it (``pipeline_llm``'s ``parallelize_fn`` after the split): TP, then the
    activation checkpointing, then FSDP2 over dp with bf16 gathered parameters and fp32 reduction
    (``pp_enabled``: torchtitan's reshard policy with pipelining); in training mode. Under ``--cp`` each
    block's attention is torch's ring over the mesh's cp group
    (``frameworks.titan_attention.ring_attention``), installed first, as torchtitan applies CP before the
    wrappers that follow."""
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

    s = setup.strategy
    if setup.parallel.cp > 1:
        ring_attention(part, dims.get_mesh("cp").get_group(), ring_kernel(setup))
    if setup.parallel.tp > 1:
        part.parallelize(dims)
        if setup.impl.fp8_tp:
            titan_fp8_tp.apply_plan(part, dims)
    apply_ac(part, setup)
    if s.dp > 1 and setup.impl.fsdp_wrap is FsdpWrap.ROOT:
        wrap_2024(part, dims.get_mesh("fsdp"), activation_dtype(setup))
    elif s.dp > 1 and s.zero >= ZeroStage.GRADIENTS:
        apply_fsdp_to_decoder(
            part,
            dims.get_mesh(["dp_replicate", "fsdp"] if dims.dp_replicate_enabled else ["fsdp"]),
            param_dtype=activation_dtype(setup),
            reduce_dtype=torch.float32,
            pp_enabled=pp_enabled,
            reshard_after_forward_policy=reshard_policy(setup),
        )
    part.train()
    return part


def wrap_2024(model: Any, mesh: Any, param_dtype: torch.dtype) -> None:
    """FSDP2 as torchtitan's ``parallelize_llama`` of 2024 applied it (``--fsdp-wrap root``; the code of
    its 2024 benchmark tables, ``apply_fsdp`` without pp): each block, resharded after forward but the
    last (``reshard_after_forward = int(layer_id) < len(model.layers) - 1``: "FSDP would prefetch it
    immediately"), then ``fully_shard(model)``, the root unit of the embedding, the final norm and the
    output, bf16 gathers and fp32 reduction. That code passed the root ``reshard_after_forward=True``,
    which the torch of the time overrode: its ``FSDPState._lazy_init`` cleared the root's
    ``post_forward_mesh_info`` unconditionally ("For the root, do not reshard after forward"); torch 2.13
    does so only when the flag is left unset (``_auto_reshard_after_forward``), so it is left unset here:
    the root is not resharded after forward, as then."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    last = len(model.layers) - 1
    for layer_id, block in model.layers.items():
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=int(layer_id) < last)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def retie(model: Any) -> None:
    """The tied embedding and lm head one parameter again after ``to_empty``, as torchtitan's trainer has
    it: materialising the meta model gives each module a parameter of its own (``Module._apply`` cannot
    keep a meta tensor's identity on another device), and torchtitan's ``Decoder.init_states``, which its
    trainer runs after ``to_empty``, re-points ``tok_embeddings.weight`` at ``lm_head.weight`` ("on meta
    device the ``__init__`` tying may not have taken effect"). Without it a tied model measured one
    [v, h] more than it holds."""
    if getattr(model, "enable_weight_tying", False):
        model.tok_embeddings.weight = model.lm_head.weight


def build_rank(setup: Setup) -> tuple[Any, Any]:
    """The rank's model on the meta device (``meta_model``), parallelised as torchtitan's
    ``parallelize_llama`` does (``parallelize_part``), and its ``ParallelDims``."""
    dims = parallel_dims(setup)
    return parallelize_part(meta_model(setup), setup, dims, pp_enabled=False), dims


class RankPathRecorder(PathRecorder):
    """``PathRecorder`` counting a DTensor by its local storage, every parameter the model holds when a
    tensor is saved excluded (FSDP2 swaps the unsharded ones in around a module's forward)."""

    def _parameters(self, model: Any) -> Any:
        self.model = model
        self._param_storages = ParameterStorages(model)
        return ()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        """A saved DTensor whose local tensor is itself a wrapper (``--fp8-tp``'s
        ``DTensor(Float8TrainingTensor)``: float8 data and an fp32 scale) counted by the tensors that hold
        its bytes (``data_tensors``): the wrapper's own storage holds none, and ``detach`` makes a new one
        (its record would be dropped as freed). Other wrappers as before: FSDP2's float8 unsharded weights
        (``--fp8-all-gather``) are parameters, excluded by their own storage."""
        if not (isinstance(t, DTensor) and is_traceable_wrapper_subclass(t._local_tensor)):
            return super()._pack(t)
        for part in data_tensors(t):
            super()._pack(part)
        return t.detach()

    def _info(self, t: torch.Tensor) -> Any:
        for ref in self._param_storages.new():
            self._excluded.setdefault(ref.cdata, ref)
        return super()._info(local(t))


def measure_titan_rank(setup: Setup, fake: bool = True, windows: bool = False) -> RankRun:
    """One forward (torchtitan's loss) and backward of torchtitan's Llama 3 on rank ``rank_of(setup)``
    (under ``--cp`` its share of the sequence through torch's ring); ``fake=False`` materialises real
    (uninitialised) tensors, for small models: the collectives still move nothing; ``windows`` keeps the
    live set of the highest point between each two boundaries (``PeakRun.windows``)."""
    recorders: list[PathRecorder] = []

    class Recorder(RankPathRecorder):
        def __init__(self, model: Any, short: Any) -> None:
            super().__init__(model, short)
            recorders.append(self)

    tracker = PeakTracker()
    tracker.keep_windows = windows

    def backward_begins(recorder: PathRecorder) -> None:
        tracker.phase = "backward"
        tracker.note("forward")

    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    # DTensor's sharding-propagation caches key a spec by its mesh's layout, not its process groups: one
    # cached in an earlier fake world would name a group destroyed with it (as ``titan_vpp`` does)
    _clear_sharding_prop_cache()
    cp = setup.parallel.cp
    with (
        fake_world(rank_of(setup), world_size(setup)),
        rotate_method(setup.parallel.cp_rotate.value) if cp > 1 else nullcontext(),
    ):
        model, dims = build_rank(setup)
        with FakeTensorMode(allow_non_fake_inputs=True) if fake else nullcontext():
            model.to_empty(device="cpu")
            retie(model)
            states = [*model.parameters(), *model.buffers()]
            tp_mesh = dims.get_mesh("tp") if setup.parallel.tp > 1 else None
            blocks = (
                compiled_blocks(dict(model.layers.items()), block_input(setup, tp_mesh))
                if compiles(setup)
                else nullcontext()
            )  # entered first: the partitioner traces before anything is recorded
            with (
                blocks,
                propagation_unseen(tracker),
                fsdp2_resizes(tracker),
                tracker,
                boundaries(model, tracker),
            ):
                tracker.track(states)
                measured = titan_step(
                    model, setup, Recorder, cp_rank=setup.parallel.cp_rank or 0, after_forward=backward_begins
                )
                tracker.note("backward")
            grads = grads_of(model)
            peak = tracker.result(states, recorders[0].saved_keys(), grads)
            params = sum(local(p).untyped_storage().nbytes() for p in model.parameters())
            grad_bytes = sum(
                {storage_ref(local(g)).cdata: local(g).untyped_storage().nbytes() for g in grads}.values()
            )
    return RankRun(measured, params, grad_bytes, peak)


def compiles(setup: Setup) -> bool:
    """The rank's blocks run through the partitioner (``--compile`` where ``blocks.profiles.compile_modelled``
    says, without checkpointing: under ``FullAC`` a compiled block keeps its input alone, as the eager one
    the rank runs)."""
    return compile_modelled(setup) and setup.strategy.checkpointing is Checkpointing.NONE


def needs_ranks(setup: Setup) -> bool:
    """``trace --impl torchtitan`` over more than one rank (tp or dp > 1, with or without cp): one rank on the
    fake group; cp alone runs the ring's rank in ``frameworks.titan.measure_titan``."""
    return setup.parallel.tp > 1 or setup.strategy.dp > 1


def rank_comparison_json(est: Any, run: RankRun) -> dict[str, Any]:
    """``trace --impl torchtitan`` on one rank: the saved tensors as ``impl_comparison_json`` compares them,
    and the rank's parameter bytes at rest against the estimate's weights (FSDP2's ZeRO-2 holds them
    sharded at rest, ``blocks.torchtitan``'s NB: compared with the ZeRO-3 shard). NB: FLOPs are shown, not
    judged: ``FlopCounterMode`` counts a DTensor op at its global shape and the ``local_map`` attention
    at the rank's, so neither the model's nor the rank's work."""
    from memplan.measure.compare.impl import impl_comparison_json

    setup = est.setup
    result = impl_comparison_json(est, run.measured)
    weights = est.device.states.weights
    if setup.strategy.zero is ZeroStage.GRADIENTS and setup.strategy.dp > 1:
        weights = estimate_zero3(setup).device.states.weights
    grads = est.device.states.gradients
    equal = weights == run.param_bytes
    grads_equal = grads == run.grad_bytes
    result["diff"]["weights"] = {"estimated": weights, "measured": run.param_bytes, "equal": equal}
    result["diff"]["gradients"] = {"estimated": grads, "measured": run.grad_bytes, "equal": grads_equal}
    result["diff"]["equal"] = result["diff"]["equal"] and equal and grads_equal
    result["diff"]["exact"] = result["diff"]["exact"] and equal and grads_equal
    result["rank"] = {
        "rank": rank_of(setup),
        "world": world_size(setup),
        "tp": setup.parallel.tp,
        "cp": setup.parallel.cp,
        "dp": setup.strategy.dp,
    }
    result["peak"] = peak_json(est, run.peak)
    return result


def estimate_zero3(setup: Setup) -> Any:
    """The estimate of ``setup`` under ZeRO-3 (its weights: FSDP2's shard at rest)."""
    from memplan.engine import estimate

    strategy = setup.strategy.model_copy(update={"zero": ZeroStage.PARAMETERS})
    return estimate(setup.model_copy(update={"strategy": strategy}))
