"""Which ``memplan.options.Options`` fields ``memplan fit`` takes as they are (beside ``model``), and which
of those no setup holds: the search's own option set, apart from the declarations themselves."""

from __future__ import annotations

from memplan.config import FINETUNE_OPTIONS

FIT_PASSTHROUGH = (
    "dropout",
    "device",
    "mfu",
    "gpus_per_node",
    "intra_node_bw",
    "inter_node_bw",
    "reserve",
    "expandable_segments",
    "host_memory",
)
"""``FIT_OPTIONS`` no setup holds (the model's dropout is rebuilt from the preset; the rest shape the GPU,
its budget — the allocator the memory is judged with among them — or the time basis): each ``fit`` row's
``memplan estimate`` command repeats them as given."""

FIT_OPTIONS = (
    "seq",
    "precision",
    "optimizer",
    "optimizer_impl",
    "clip_grad",
    "reduce_dtype",
    *FIT_PASSTHROUGH,
    "finetune",
    *FINETUNE_OPTIONS,
    "double_quant",
    "impl",
    "attention_kernel",
    "norm_kernel",
    "compile",
    "compile_loss",
    "fsdp_wrap",
    "fp8",
    "fp8_all_gather",
    "fp8_tp",
    "overlap_grad_reduce",
    "overlap_param_gather",
    "tp_comm_overlap",
    "async_tp",
    "fp8_param_gather",
)
"""The ``Options`` fields ``memplan fit`` takes as they are (beside ``model``): ``cli.search`` declares its
options from them and ``advice`` suggests a ``fit`` command only for settings among them."""
