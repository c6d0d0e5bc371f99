"""Rendering of ``memplan presets`` and ``memplan gpus``: the shipped model and GPU presets."""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from memplan.analytic.params import ParamCount
from memplan.presets import GpuPreset, ModelPreset
from memplan.render.estimate import fmt_count, fmt_in, fmt_int, row
from memplan.render.fitted import Col, Fitted

PRESET_COLUMNS = (
    Col("name", "left", style="bold cyan"),
    Col("aliases", "left", priority=2, wrap=True, min_width=12, words=True),
    Col("published\nparams", priority=1),
    Col("layers", priority=1),
    Col("hidden", priority=2),
    Col("heads/kv", priority=3),
    Col("source", "left", priority=4, wrap=True, min_width=30),
)


def presets_table(
    presets: Sequence[ModelPreset], title: str = "Model presets (`memplan presets show NAME` for one)"
) -> Fitted:
    table = Fitted(PRESET_COLUMNS, title=title)
    for p in presets:
        m = p.model
        published = fmt_count(p.published_params) if p.published_params else "?"
        table.add(
            p.name,
            ", ".join(p.aliases),
            published,
            str(m.num_layers),
            fmt_int(m.hidden_size),
            f"{m.num_heads}/{m.kv_heads}",
            p.source,
        )
    return table


def _layer_rows(params: ParamCount) -> list[tuple[str, int]]:
    """One layer's total; with dense layers between MoE ones (Llama 4 Maverick) one of each, and how many."""
    if params.dense_layer is None:
        return [("one layer", params.layer.total)]
    moe = params.num_layers - params.dense_layers
    return [
        (f"one MoE layer (× {moe})", params.layer.total),
        ("  dense MLP", params.dense_layer.mlp),
        (f"one dense layer (× {params.dense_layers})", params.dense_layer.total),
    ]


def _params_table(preset: ModelPreset, params: ParamCount) -> Fitted:
    layer = params.layer
    cols = (Col("component", "left"), Col("parameters"), Col("", priority=1))
    table = Fitted(cols, title="Parameters (computed from the architecture)")
    rows = [
        ("token embedding [v, h]", params.embedding),
        ("learned positions", params.positions),
        ("  attention norm", layer.attn_norm),
        ("  W_Q", layer.q_proj),
        ("  W_K", layer.k_proj),
        ("  W_V", layer.v_proj),
        ("  W_O", layer.o_proj),
        ("  MLP norm", layer.mlp_norm),
        ("  MLP", layer.mlp),
        *_layer_rows(params),
        (f"{params.num_layers} layers", params.layers),
        ("final norm", params.final_norm),
        ("lm head [h, v]" + (" (tied: 0)" if preset.model.tied_embeddings else ""), params.lm_head),
    ]
    for name, n in rows:
        table.add(name, fmt_int(n), fmt_count(n), style="dim" if name[0] == " " else "")
    table.section()
    table.add("total", fmt_int(params.total), fmt_count(params.total), style="bold")
    if preset.published_params is not None:
        same = "matches" if preset.published_params == params.total else "DIFFERS from"
        table.add(f"published ({same} the count)", fmt_int(preset.published_params), "")
    return table


def preset_detail(preset: ModelPreset, params: ParamCount) -> Group:
    """One preset: its fields, architecture and computed parameter breakdown."""
    info = Table.grid(padding=(0, 2))
    info.add_column(style="bold")
    info.add_column(overflow="fold")
    row(info, "name", preset.name)
    row(info, "aliases", ", ".join(preset.aliases) or "-")
    row(info, "source", preset.source)
    if preset.notes:
        row(info, "notes", preset.notes)
    for key, value in preset.model.model_dump(mode="json").items():
        if key != "name":
            row(info, key, str(value))
    return Group(
        Panel(info, title=Text(f"model preset {preset.name}"), title_align="left"),
        _params_table(preset, params),
    )


GPU_COLUMNS = (
    Col("name", "left", style="bold cyan"),
    Col("aliases", "left", priority=3, wrap=True, min_width=12, words=True),
    Col("memory\nGiB", priority=1),
    Col("driver\nGiB", priority=2),
    Col("bf16\nTFLOP/s", priority=1),
    Col("fp8\nTFLOP/s", priority=2),
    Col("HBM\nGB/s", priority=2),
    Col("interconnect", "left", priority=2, wrap=True, min_width=14, words=True),
    Col("GPUs/node ×\nGB/s in/out", priority=3),
    Col("source", "left", priority=4, wrap=True, min_width=30),
)


def gpus_table(gpus: Sequence[GpuPreset]) -> Fitted:
    table = Fitted(
        GPU_COLUMNS,
        title="GPU presets (dense peak throughput, no sparsity; driver: the memory a process can have, "
        "CUDA's measured total or nvidia-smi's, where cited; GiB = 2³⁰ bytes, GB/s = 10⁹ bytes/s)",
    )
    for g in gpus:
        fp8 = g.peak_tflops.fp8
        table.add(
            g.name,
            ", ".join(g.aliases),
            fmt_in(g.memory_bytes, 1 << 30),
            # CUDA's measured total or nvidia-smi's, cited in the file
            "-" if g.device_mib is None and g.cuda_bytes is None else fmt_in(g.device_bytes, 1 << 30),
            f"{g.peak_tflops.bf16:,g}",
            "-" if fp8 is None else f"{fp8:,g}",
            f"{g.hbm_bandwidth_gbps:,g}",
            g.interconnect,
            f"{g.topology.gpus_per_node} × {g.topology.intra_node_gbps:,g} / {g.topology.inter_node_gbps:,g}",
            g.source,
        )
    return table
