"""The held-out published runs (benchmarks/heldout.py, docs/step-time.md "Held-out runs"): each typed setup is
what its source states, and the doc holds the code's output. No error bound is asserted: the set is held
out, and a bound here would be fitting by test (issue #21)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.heldout import DOC, END, RUNS, START, TITAN_RUNS, Run, markdown, predict
from benchmarks.heldout_bridge import BRIDGE_RUNS
from benchmarks.heldout_bridge_gb import BRIDGE_GB_RUNS
from benchmarks.heldout_bridge_moe import BRIDGE_MOE_RUNS
from benchmarks.heldout_bridge_moe_fp8 import BRIDGE_MOE_FP8_RUNS
from benchmarks.heldout_bridge_more import BRIDGE_MORE_RUNS
from benchmarks.heldout_nemo import NEMO_RUNS
from memplan.api import load_model
from memplan.presets import load_gpu

ROOT = Path(__file__).resolve().parents[1]

MPT_YAML = {
    # scripts/train/yamls/pretrain/mpt-<size>.yaml: d_model, n_heads, n_layers (expansion_ratio 4,
    # vocab_size 50368 in every one)
    "125m": (768, 12, 12),
    "350m": (1024, 16, 24),
    "760m": (1536, 12, 24),
    "1b": (2048, 16, 24),
    "3b": (2560, 20, 32),
    "7b": (4096, 32, 32),
    "13b": (5120, 40, 40),
    "30b": (7168, 56, 48),
    "70b": (8192, 64, 80),
}

LF_ROWS = {
    # (size, seq, GPUs, GPU): (MicroBatchSize, GradAccum, GlobalBatchSize, Throughput (T/s), T/s/GPU) as the
    # llm-foundry tables print them; the global batch and the per-GPU figure are checked against the others
    ("760m", 2048, 8, "h100-sxm"): (24, 2, 384, 505177, 63147),
    ("7b", 2048, 8, "h100-sxm"): (6, 1, 48, 85144, 10643),
    ("70b", 2048, 64, "h100-sxm"): (8, 4, 2048, 66523, 1039),
    ("7b", 2048, 8, "a100-80gb"): (6, 2, 96, 37130, 4641),
    ("70b", 2048, 64, "a100-80gb"): (8, 4, 2048, 26274, 410),
    ("70b", 2048, 128, "a100-40gb"): (4, 1, 512, 48194, 376),
}


# One xdist worker runs this file (pyproject.toml's --dist loadgroup): the module fixture below predicts
# every held-out run once in the suite rather than once per worker.
pytestmark = pytest.mark.xdist_group("heldout")


@pytest.fixture(scope="module")
def predicted() -> dict[str, dict]:  # type: ignore[type-arg]
    return {run.name: predict(run) for run in RUNS}


def test_the_docs_table_is_the_codes_output() -> None:
    text = DOC.read_text(encoding="utf-8")
    table = text.split(START + "\n", 1)[1].split(END, 1)[0]
    assert table == markdown()


def test_each_typed_setup_is_what_its_source_states(predicted: dict[str, dict]) -> None:  # type: ignore[type-arg]
    for run in RUNS:
        j, st = predicted[run.name], run.stated
        s = j["setup"]
        got = (
            j["model"],
            j["verdict"]["gpu"],
            s["devices"],
            s["seq_len"],
            s["micro_batch"],
            s["global_batch"],
            s["tp"],
            s["sp"],
            s["cp"],
            s["pp"],
            s["vpp"],
            tuple(s["pp_layers"]) if st.pp_layers else (),
            s["ep"],
            s["zero"],
            s["checkpointing"],
            s["reduce_dtype"],
            s["compile"],
            s["compile_loss"],
            s["fp8"],
            s["fp8_tp"],
            s["async_tp"],
            s["fsdp_wrap"],
            s["precision"],
            s["attention_kernel"],
            s["norm_kernel"],
            s["impl"],
            s["optimizer_impl"] or "",
            s["clip_grad"],
            s["loss"],
        )
        want = (
            st.model,
            st.gpu,
            st.gpus,
            st.seq,
            st.micro_batch,
            st.global_batch,
            st.tp,
            st.tp > 1,
            st.cp,
            st.pp,
            st.vpp,
            st.pp_layers,
            st.ep,
            st.zero,
            st.checkpointing,
            st.reduce_dtype,
            st.compile,
            st.compile_loss,
            st.fp8,
            st.fp8_tp,
            st.async_tp,
            st.fsdp_wrap,
            "bf16-mixed",
            st.attention_kernel,
            st.norm_kernel,
            st.impl,
            st.optimizer_impl,
            st.clip_grad,
            st.loss,
        )
        assert got == want, run.name


def _mpt(run: Run) -> bool:
    return run.stated.model.startswith("mpt-")


def test_mpt_models_are_the_yamls() -> None:
    for run in filter(_mpt, RUNS):
        size = run.stated.model.removeprefix("mpt-").removesuffix("-8k")
        m = load_model(str(ROOT / "benchmarks" / "published" / f"{run.stated.model}.toml")).model
        d, heads, layers = MPT_YAML[size]
        assert (m.hidden_size, m.num_heads, m.num_layers, m.ffn_size, m.vocab_size) == (
            d,
            heads,
            layers,
            4 * d,
            50368,
        ), run.name
        # learned positions up to the run's sequence (MPT's max_seq_len is the benchmark's SeqLen)
        assert m.max_positions == run.stated.seq, run.name


def test_llm_foundry_rows_as_printed() -> None:
    """Micro-batch × grad-accum × GPUs is the table's global batch, its T/s over the GPUs its T/s/GPU (the
    table rounds down), and the run carries those figures."""
    for run in filter(_mpt, RUNS):
        st = run.stated
        key = (st.model.removeprefix("mpt-").removesuffix("-8k"), st.seq, st.gpus, st.gpu)
        if key not in LF_ROWS:
            continue
        mb, ga, gb, tps, per_gpu = LF_ROWS[key]
        assert mb * ga * st.gpus == gb
        assert int(tps / st.gpus) == per_gpu
        assert (st.micro_batch, st.global_batch, run.published) == (mb, gb, per_gpu)


def test_torchtitan_selective_rows_are_its_per_op_policy() -> None:
    """torchtitan's "selective" AC in these runs is its per-op policy (train_configs/llama3_8b.toml of the
    64-A100 preset: ``mode = 'selective'``, ``selective_ac_option = 'op'``; the 2025 tables: "Selective
    activation checkpointing" at the trainer's default): typed ``--impl torchtitan --checkpointing
    selective``, the float8 rows too (``--impl torchtitan --fp8 tensorwise``)."""
    selective = [r for r in RUNS if r.stated.checkpointing == "selective"]
    assert len(selective) == 8
    for run in selective:
        assert "--impl torchtitan" in run.typed and "--checkpointing selective" in run.typed, run.name
        assert run.note.startswith("torchtitan's per-op selective AC typed as --impl torchtitan's"), run.name


def test_torchtitan_float8_rows_are_what_ran(predicted: dict[str, dict]) -> None:  # type: ignore[type-arg]
    """Every float8 run of the 2025 tables (T1, T3 "+ torch.compile + Float8", T2's CP rows, T4's 2D and
    2D + AsyncTP) ran
    torchtitan 9dec370's converter: torchao's ``Float8LinearConfig()``, tensorwise dynamic scaling (its only
    recipe then), on FSDP2 with torchtitan's mixed precision (fp32 shards, bf16 gathered: no master copy
    beside the shards) and the run's own AC mode: typed ``--impl torchtitan --fp8 tensorwise``, the note
    saying the all-gather is typed in bf16 (the doc does not state float8 all-gather)."""
    float8 = [r for r in TITAN_RUNS if r.stated.fp8 != "none"]
    assert len(float8) == 2 + 4 + 2
    for run in float8:
        s = predicted[run.name]["setup"]
        assert (s["impl"], s["fp8"], s["compile"]) == ("torchtitan", "tensorwise", True), run.name
        assert s["precision"] == "bf16-mixed" and s["zero"] == 3, run.name
        assert predicted[run.name]["memory"]["master_weights"] == 0, run.name  # FSDP2's fp32 shards
        assert "float8: torchao tensorwise, FSDP2 all-gather in bf16" in run.note, run.name


def test_torchtitan_runs_have_no_accumulation(predicted: dict[str, dict]) -> None:  # type: ignore[type-arg]
    """torchtitan without pipelining runs the local batch as one micro-batch: global = local × dp, with
    dp = GPUs / (tp·cp) (Table 4: 16 × 32 = 512 on 256 GPUs at tp 8; Table 2: 1 × 8/cp)."""
    for run in TITAN_RUNS:
        st = run.stated
        assert predicted[run.name]["setup"]["micro_batches"] == 1, run.name
        assert st.micro_batch * st.gpus // (st.tp * st.cp) == st.global_batch, run.name


def test_grand_teton_preset_is_what_torchtitan_states() -> None:
    """presets/gpus/h100-teton.toml against torchtitan docs/performance.md (eaea6f6): "96GB HBM2e with
    2.4 TB/sec peak memory bandwidth" (96 GB read as 96·2³⁰ bytes, as every preset's vendor GB), 8 H100 per
    host, "400 Gb/s per GPU" (50 GB/s per direction); the peak is not stated ("between SXM and NVL"): the
    SXM5's dense BF16 989.5 TFLOP/s (1,979 sparse ÷ 2) is kept as its upper bound."""
    gpu = load_gpu("grand-teton-h100")
    assert gpu.name == "h100-teton"
    assert gpu.memory_bytes == 96 * 2**30
    assert gpu.hbm_bandwidth_gbps == 2400
    assert gpu.topology.gpus_per_node == 8 and gpu.topology.inter_node_gbps == 400 / 8
    assert gpu.peak_tflops.bf16 == 1979 / 2 == load_gpu("h100-sxm").peak_tflops.bf16
    assert gpu.device_mib is None  # nvidia-smi's total for this part is not published


def test_grand_teton_moves_the_memory_bound_seconds_only(predicted: dict[str, dict]) -> None:  # type: ignore[type-arg]
    """The same Table 1 run on h100-sxm and h100-teton: the element-wise kernels and the optimizer step are
    memory-bound, so they take 3,350/2,400 times as long on 2.4 TB/s; the 16,384-token GEMMs are above
    the ridge (compute-bound) and the flash kernel runs at a fraction of the peak both share: unchanged."""
    run = next(r for r in RUNS if r.name == "Llama 3.1 8B, 8 × H100, FSDP")
    assert "--gpu h100-teton" in run.typed
    sxm = Run(run.name, run.source, run.stated, run.published, run.typed.replace("h100-teton", "h100-sxm"))
    teton_p = predicted[run.name]["time"]["predicted"]
    sxm_p = predict(sxm)["time"]["predicted"]
    ratio = 3350 / 2400
    assert teton_p["elementwise_s"] == pytest.approx(sxm_p["elementwise_s"] * ratio, rel=1e-12)
    assert teton_p["optimizer_s"] == pytest.approx(sxm_p["optimizer_s"] * ratio, rel=1e-12)
    assert teton_p["matmul_s"] == pytest.approx(sxm_p["matmul_s"], rel=1e-12)
    assert teton_p["attention_s"] == pytest.approx(sxm_p["attention_s"], rel=1e-12)


NEMO_ROWS = {
    # NVIDIA/NeMo docs/source/performance/performance_summary.md (the 24.07 "Pretraining" and the 24.03.01
    # "Long Input Sequences" tables, DGX-H100, FP8), as printed: (#-GPUs, GBS, MBS, sequence, TP, PP, CP,
    # VP) → tokens/s/GPU; the long-sequence table's sequence in K (× 1,024) and its DP column (checked:
    # GPUs / (TP·PP·CP))
    "GPT3-5B": ((64, 2048, 4, 2048, 1, 1, 1, 1), 23406),
    "GPT3-20B": ((64, 256, 2, 2048, 2, 1, 1, 1), 5851),
    "GPT3-175B 128": ((128, 256, 1, 2048, 4, 8, 1, 6), 716),
    "GPT3-175B 512": ((512, 2048, 2, 2048, 4, 8, 1, 6), 825),
    "LLAMA2-7B": ((8, 128, 1, 4096, 1, 1, 1, 1), 16934),
    "LLAMA2-13B": ((16, 128, 1, 4096, 1, 4, 1, 10), 8715),
    "LLAMA2-70B": ((64, 128, 1, 4096, 4, 4, 1, 20), 1728),
    "LLAMA3-8B": ((8, 128, 1, 8192, 1, 1, 2, 1), 12273),
    "LLAMA3-70B": ((64, 128, 1, 8192, 4, 4, 2, 5), 1524),
    **{
        f"long {k}K": ((gpus, gbs, 1, k * 1024, tp, 1, cp, 1), tps)
        for k, gpus, gbs, tp, cp, dp, tps in (
            (4, 4, 1024, 1, 1, 4, 16671),
            (16, 16, 256, 2, 1, 8, 10082),
            (32, 32, 128, 2, 2, 8, 6687),
            (64, 64, 64, 4, 2, 8, 4021),
            (128, 128, 32, 4, 4, 8, 2260),
            (256, 256, 16, 4, 8, 8, 1214),
            (512, 512, 8, 8, 16, 4, 635),
            (1024, 1024, 4, 8, 32, 4, 318),
        )
        if gpus // (tp * cp) == dp
    },
    "long 8K": ((8, 512, 1, 8192, 1, 2, 1, 1), 13907),  # PP 2, DP 4
}


def test_nemo_rows_as_printed() -> None:
    """Every row of the two tables memplan can type is in the set, with the table's figures (the
    Nemotron rows, a squared-ReLU MLP, and the packed fine-tuning rows are left out: heldout_nemo.py)."""
    assert len(NEMO_ROWS) == len(NEMO_RUNS) == 18
    got = sorted(
        (
            (st.gpus, st.global_batch, st.micro_batch, st.seq, st.tp, st.pp, st.cp, st.vpp),
            run.published,
        )
        for run in NEMO_RUNS
        for st in [run.stated]
    )
    assert got == sorted(NEMO_ROWS.values())


def test_nemo_runs_are_typed_as_the_launcher_configures_them(predicted: dict[str, dict]) -> None:  # type: ignore[type-arg]
    """Megatron-core with TE's delayed-scaling float8 (amax history 1024), the distributed optimizer with
    overlapped gradient and parameter sync, sequence parallelism with TP, gradient clipping, TE's
    point-to-point context-parallel ring, accumulation to the global batch: GBS = MBS × micro-batches × dp."""
    for run in NEMO_RUNS:
        s, st = predicted[run.name]["setup"], run.stated
        history = 1 if st.model == "llama-2-70b" else 1024  # llama2_70b.yaml's fp8_amax_history_len: 1
        assert (s["impl"], s["fp8"], s["fp8_amax_history_len"]) == ("megatron", "delayed", history), run.name
        assert (s["zero"], s["overlap_grad_reduce"], s["overlap_param_gather"]) == (1, True, True), run.name
        assert s["reduce_dtype"] == "bf16", run.name  # the H100 scripts' grad_sync_dtype=bf16
        assert s["sp"] == (st.tp > 1) and s["clip_grad"] and s["checkpointing"] == "none", run.name
        assert st.cp == 1 or s["cp_rotate"] == "alltoall", run.name  # TE's point-to-point ring
        dp = st.gpus // (st.tp * st.pp * st.cp)
        assert st.micro_batch * s["micro_batches"] * dp == st.global_batch, run.name
        # TE's userbuffers: the Llama 70B configs' ub_tp_comm_overlap: true, every GPT-3 config's False,
        # the long-sequence rows' Llama 2 7B config's False (heldout_nemo.py)
        ub = st.model in ("llama-2-70b", "llama-3-70b")
        assert s["tp_comm_overlap"] == ub and ("--tp-comm-overlap" in run.typed) == ub, run.name


def test_nemo_gpt3_models_are_the_launcher_configs() -> None:
    """launcher_scripts/conf/training/gpt3/{5b,20b,175b}.yaml: num_layers, hidden_size,
    num_attention_heads, ffn 4·hidden, seq 2048, dropout 0.1; the GPT-2 BPE vocabulary (50,257) padded to a
    multiple of 128 × the row's TP (Megatron's _vocab_size_with_padding): TP 1, 2, 4."""
    sizes = {"5b": (24, 4096, 32, 1), "20b": (44, 6144, 48, 2), "175b": (96, 12288, 96, 4)}
    for size, (layers, hidden, heads, tp) in sizes.items():
        m = load_model(str(ROOT / "benchmarks" / "published" / f"nemo-gpt3-{size}.toml")).model
        multiple = 128 * tp
        vocab = -(-50257 // multiple) * multiple
        assert (m.num_layers, m.hidden_size, m.num_heads, m.ffn_size) == (layers, hidden, heads, 4 * hidden)
        assert (m.vocab_size, m.max_positions, m.attn_dropout, m.resid_dropout) == (vocab, 2048, 0.1, 0.1)
        rows = [r for r in NEMO_RUNS if r.stated.model == f"nemo-gpt3-{size}"]
        assert rows and all(r.stated.tp == tp for r in rows), size


BRIDGE_ROWS = {
    # NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md (00b7660), "25.11 NeMo Container", DGX-H100 and
    # DGX-B200, as printed: (system, model, precision) → (#-GPUs, GBS, MBS, sequence, FSDP, TP, PP, CP, VP,
    # GA), tokens/s/GPU; VP "n/a" read as 1, each "FP8-CS (FP8-MX)" row as two rows
    ("DGX-H100", "LLAMA3_8B", "FP8-CS"): ((8, 128, 1, 8192, 1, 1, 1, 1, 1, 16), 14451),
    ("DGX-H100", "LLAMA3_70B", "FP8-CS"): ((64, 128, 1, 8192, 0, 4, 8, 1, 5, 64), 1602),
    ("DGX-H100", "LLAMA3.1_405B", "FP8-CS"): ((1024, 512, 1, 8192, 0, 8, 8, 2, 8, 64), 292),
    ("DGX-B200", "LLAMA3_8B", "FP8-CS"): ((8, 128, 2, 8192, 0, 1, 1, 1, 1, 8), 30624),
    ("DGX-B200", "LLAMA3_8B", "FP8-MX"): ((8, 128, 2, 8192, 0, 1, 1, 1, 1, 8), 29521),
    ("DGX-B200", "LLAMA3.1_405B", "FP8-CS"): ((128, 64, 1, 8192, 0, 4, 8, 2, 8, 32), 661),
    ("DGX-B200", "LLAMA3.1_405B", "FP8-MX"): ((128, 64, 1, 8192, 0, 4, 8, 2, 8, 32), 624),
}
BRIDGE_MODELS = {"llama-3-8b": "LLAMA3_8B", "llama-3-70b": "LLAMA3_70B", "llama-3.1-405b": "LLAMA3.1_405B"}
BRIDGE_FP8 = {"tensorwise": "FP8-CS", "mxfp8": "FP8-MX"}
BRIDGE_GPU = {
    "DGX-H100": "h100-sxm",
    "DGX-B200": "b200",
    "DGX-B300": "b300",
    "DGX-GB200": "gb200",
    "DGX-GB300": "gb300",
}


def _bridge_key(run: Run) -> tuple[str, str, str]:
    system = run.source.rsplit(", ", 1)[1]
    return system, BRIDGE_MODELS[run.stated.model], BRIDGE_FP8[run.stated.fp8]


def test_bridge_rows_as_printed() -> None:
    """Every dense Llama row of the DGX-H100 and DGX-B200 tables is in the set, with the table's figures;
    its GA is GBS / (MBS × dp), dp = GPUs / (TP·PP·CP) (the DGX-GB200 and -GB300 rows: heldout_bridge_gb.py;
    the MoE rows memplan cannot type are left out: heldout_bridge.py)."""
    assert len(BRIDGE_RUNS) == len(BRIDGE_ROWS) == 7
    got = {}
    for run in BRIDGE_RUNS:
        st = run.stated
        system, _, _ = key = _bridge_key(run)
        dp = st.gpus // (st.tp * st.pp * st.cp)
        ga = st.global_batch // (st.micro_batch * dp)
        fsdp = int(st.zero == 3)
        got[key] = (
            (st.gpus, st.global_batch, st.micro_batch, st.seq, fsdp, st.tp, st.pp, st.cp, st.vpp, ga),
            run.published,
        )
        assert st.gpu == BRIDGE_GPU[system], run.name
    assert got == BRIDGE_ROWS


def test_bridge_runs_are_typed_as_the_recipes_configure_them(predicted: dict[str, dict]) -> None:  # type: ignore[type-arg]
    """Megatron-core with TE float8 (FP8-CS: current scaling, --fp8 tensorwise; FP8-MX: --fp8 mxfp8), the
    distributed optimizer (FSDP 1: Megatron FSDP's optim_grads_params, --zero 3) with overlapped gradient
    and parameter sync, gradients in bf16 (grad_reduce_in_fp32 False), SP with TP, no recompute, gradient
    clipping at 1.0, TE's p2p context-parallel ring; the table's GA is memplan's micro-batches."""
    for run in BRIDGE_RUNS:
        s, st = predicted[run.name]["setup"], run.stated
        (_, _, _, _, fsdp, *_, ga), _ = BRIDGE_ROWS[_bridge_key(run)]
        assert (s["impl"], s["fp8"]) == ("megatron", st.fp8) and st.fp8 in BRIDGE_FP8, run.name
        assert (s["zero"], s["overlap_grad_reduce"], s["overlap_param_gather"]) == (
            3 if fsdp else 1,
            True,
            True,
        )
        assert s["reduce_dtype"] == "bf16" and s["clip_grad"] and s["checkpointing"] == "none", run.name
        assert s["sp"] == (st.tp > 1) and s["seq_len"] == 8192, run.name
        assert st.cp == 1 or s["cp_rotate"] == "alltoall", run.name
        assert s["micro_batches"] == ga, run.name
        # CommOverlapConfig(tp_comm_overlap=True), kept with TP ≥ 2 and sp (heldout_bridge.py)
        assert s["tp_comm_overlap"] == (st.tp > 1), run.name
        # both float8 recipes set fp8_param_gather (MXFP8's with reuse_grad_buf_for_mxfp8_param_ag), each
        # modelled where these rows run it (per-tensor: distributed optimizer or Megatron FSDP; MXFP8: the
        # distributed optimizer)
        assert s["fp8_param_gather"], run.name


def _megatron_layers_to_build(layers: int, pp: int, vp: int, rank: int, stage: int) -> int:
    """Megatron-core's ``get_num_layers_to_build`` with account_for_embedding_in_pipeline_split and
    account_for_loss_in_pipeline_split: (L + 2)/pp per rank, /vp per virtual stage, one fewer on the first
    virtual stage of the first rank and on the last of the last."""
    n = (layers + 2) // pp // vp
    return n - int(rank == 0 and stage == 0) - int(rank == pp - 1 and stage == vp - 1)


def test_bridge_405b_splits_embedding_and_loss_as_layers(predicted: dict[str, dict]) -> None:  # type: ignore[type-arg]
    """llama31_405b_pretrain_config sets account_for_embedding_in_pipeline_split and account_for_loss_in_
    pipeline_split: the 126 layers and the two over PP × VP virtual stages are (126 + 2)/(PP·VP) a virtual
    stage, one fewer on the first (embedding) and on the last (loss) — PP 8 × VP 8 and PP 16 × VP 4: 2,
    and 1 at the ends; PP 8 × VP 4 (GB300): 4, and 3; PP 16 × VP 8 (GB200's FP8-MX): 1, and none at the
    ends; --pp-layers lists them in model order (virtual stage v = k·pp + i is chunk k of rank i)."""
    rows = [r for r in BRIDGE_RUNS + BRIDGE_MORE_RUNS + BRIDGE_GB_RUNS if r.stated.model == "llama-3.1-405b"]
    assert len(rows) == 3 + 1 + 3 + 3  # 25.11; 26.02 (heldout_bridge_more.py); GB200, GB300 (_gb.py)
    for run in rows:
        st = run.stated
        per = 128 // (st.pp * st.vpp)
        want = [
            _megatron_layers_to_build(126, st.pp, st.vpp, v % st.pp, v // st.pp)
            for v in range(st.pp * st.vpp)
        ]
        assert sum(want) == 126 and want[0] == want[-1] == per - 1 and set(want[1:-1]) == {per}, run.name
        assert predicted[run.name]["setup"]["pp_layers"] == want, run.name


BRIDGE_MORE_ROWS = {
    # Megatron-Bridge docs/performance-summary.md (df0289c), "26.02 NeMo Container", the DGX-H100 dense Llama
    # rows as printed: (release, system, model, precision) → (#-GPUs, GBS, MBS, sequence, FSDP, TP, PP, CP,
    # VP, GA), tokens/s/GPU (the 25.09 table states no precision: left out, heldout_bridge_more.py)
    ("26.02", "DGX-H100", "LLAMA3_70B", "FP8-CS"): ((64, 256, 1, 8192, 0, 4, 8, 1, 5, 128), 1621),
    ("26.02", "DGX-H100", "LLAMA3.1_405B", "FP8-CS"): ((1024, 1536, 1, 8192, 0, 8, 8, 2, 8, 192), 311),
}


def _bridge_more_key(run: Run) -> tuple[str, str, str, str]:
    release = run.source.split("(", 1)[1].split(")", 1)[0]
    return (release, *_bridge_key(run))


def _release_rows_as_printed(runs: tuple[Run, ...]) -> dict[tuple[str, str, str, str], tuple]:  # type: ignore[type-arg]
    """Each run as its table prints it: (release, system, model, precision) → (#-GPUs, GBS, MBS, sequence,
    FSDP, TP, PP, CP, VP, GA), tokens/s/GPU; GA = GBS / (MBS × dp), dp = GPUs / (TP·PP·CP); the GPU is the
    system's and the name ends with the release."""
    got = {}
    for run in runs:
        st = run.stated
        release, system, _, _ = key = _bridge_more_key(run)
        dp = st.gpus // (st.tp * st.pp * st.cp)
        ga = st.global_batch // (st.micro_batch * dp)
        layout = (int(st.zero == 3), st.tp, st.pp, st.cp, st.vpp, ga)
        got[key] = ((st.gpus, st.global_batch, st.micro_batch, st.seq, *layout), run.published)
        assert st.gpu == BRIDGE_GPU[system] and run.name.endswith(f"({release})"), run.name
    return got


def test_bridge_more_rows_as_printed() -> None:
    """Every dense Llama row of the 26.02 DGX-H100 table is in the set once, with the table's figures; names
    are unique across the set (the 26.02 rows repeat 25.11's layouts, named with their release)."""
    assert len(BRIDGE_MORE_RUNS) == len(BRIDGE_MORE_ROWS) == 2
    assert len({run.name for run in RUNS}) == len(RUNS)
    assert _release_rows_as_printed(BRIDGE_MORE_RUNS) == BRIDGE_MORE_ROWS


BRIDGE_GB_ROWS = {
    # Megatron-Bridge docs/performance-summary.md, the DGX-GB200 and DGX-GB300 dense Llama rows as printed,
    # FP8-CS and FP8-MX: 25.11 (00b7660; the same at df0289c) and 26.02 (df0289c); keys and values as
    # BRIDGE_MORE_ROWS', VP "n/a" read as 1, "FP8-CS (FP8-MX)" as two rows (26.02's NVFP4 rows are left out:
    # heldout_bridge_gb.py)
    ("25.11", "DGX-GB200", "LLAMA3_8B", "FP8-CS"): ((8, 128, 2, 8192, 0, 1, 1, 1, 1, 8), 31508),
    ("25.11", "DGX-GB200", "LLAMA3_8B", "FP8-MX"): ((8, 128, 2, 8192, 0, 1, 1, 1, 1, 8), 29789),
    ("25.11", "DGX-GB200", "LLAMA3_70B", "FP8-CS"): ((64, 256, 2, 8192, 1, 1, 1, 1, 1, 2), 4312),
    ("25.11", "DGX-GB200", "LLAMA3.1_405B", "FP8-CS"): ((256, 1536, 1, 8192, 0, 4, 16, 1, 4, 384), 813),
    ("26.02", "DGX-GB200", "LLAMA3_70B", "FP8-CS"): ((64, 256, 2, 8192, 1, 1, 1, 1, 1, 2), 4040),
    ("26.02", "DGX-GB200", "LLAMA3_70B", "FP8-MX"): ((64, 256, 1, 8192, 0, 2, 4, 1, 5, 32), 3887),
    ("26.02", "DGX-GB200", "LLAMA3.1_405B", "FP8-CS"): ((256, 1536, 1, 8192, 0, 4, 16, 1, 4, 384), 793),
    ("26.02", "DGX-GB200", "LLAMA3.1_405B", "FP8-MX"): ((256, 1536, 1, 8192, 0, 4, 16, 1, 8, 384), 786),
    ("25.11", "DGX-GB300", "LLAMA3_8B", "FP8-CS"): ((8, 128, 2, 8192, 0, 1, 1, 1, 1, 8), 37556),
    ("25.11", "DGX-GB300", "LLAMA3_8B", "FP8-MX"): ((8, 128, 2, 8192, 0, 1, 1, 1, 1, 8), 36108),
    ("25.11", "DGX-GB300", "LLAMA3_70B", "FP8-CS"): ((64, 256, 2, 8192, 1, 1, 1, 1, 1, 2), 4520),
    ("25.11", "DGX-GB300", "LLAMA3.1_405B", "FP8-CS"): ((256, 1536, 1, 8192, 0, 2, 8, 2, 4, 192), 999),
    ("26.02", "DGX-GB300", "LLAMA3_70B", "FP8-CS"): ((64, 256, 2, 8192, 1, 1, 1, 1, 1, 2), 5003),
    ("26.02", "DGX-GB300", "LLAMA3_70B", "FP8-MX"): ((64, 256, 1, 8192, 0, 1, 4, 1, 5, 16), 4596),
    ("26.02", "DGX-GB300", "LLAMA3.1_405B", "FP8-CS"): ((256, 1536, 1, 8192, 0, 4, 8, 1, 4, 192), 988),
    ("26.02", "DGX-GB300", "LLAMA3.1_405B", "FP8-MX"): ((256, 1536, 1, 8192, 0, 2, 8, 2, 4, 192), 931),
}


def test_bridge_gb_rows_as_printed() -> None:
    """Every FP8-CS and FP8-MX dense Llama row of the 25.11 and 26.02 DGX-GB200 and DGX-GB300 tables is in
    the set once, with the table's figures, on the gb200 and gb300 presets (NVL72: one NVLink domain of 72
    GPUs)."""
    assert len(BRIDGE_GB_RUNS) == len(BRIDGE_GB_ROWS) == 8 + 8
    assert _release_rows_as_printed(BRIDGE_GB_RUNS) == BRIDGE_GB_ROWS
    assert load_gpu("gb200").topology.gpus_per_node == load_gpu("gb300").topology.gpus_per_node == 72


def test_bridge_more_runs_are_typed_as_the_recipes_configure_them(predicted: dict[str, dict]) -> None:  # type: ignore[type-arg]
    """26.02 (the *_V2 presets, scripts/performance/configs/llama) and both releases' DGX-GB200 and -GB300
    rows (heldout_bridge_gb.py): Megatron-core with TE current scaling (FP8-CS) or MXFP8 (FP8-MX), the
    distributed optimizer (FSDP 1: Megatron FSDP, --zero 3) with overlapped gradient and parameter sync,
    gradients in bf16 (grad_reduce_in_fp32 False), SP with TP, no recompute, clipping at 1.0, TE's p2p
    context-parallel ring, the table's GA as memplan's micro-batches; tp_comm_overlap (the 70B and 405B
    recipes, TP ≥ 2); fp8_param_gather (current scaling under the distributed optimizer or Megatron FSDP,
    MXFP8 under the distributed optimizer)."""
    rows = {**BRIDGE_MORE_ROWS, **BRIDGE_GB_ROWS}
    for run in BRIDGE_MORE_RUNS + BRIDGE_GB_RUNS:
        s, st = predicted[run.name]["setup"], run.stated
        release, _, _, kind = _bridge_more_key(run)
        (_, _, _, _, fsdp, *_, ga), _ = rows[release, *_bridge_key(run)]
        fp8 = {"FP8-CS": "tensorwise", "FP8-MX": "mxfp8"}[kind]
        assert (s["impl"], s["fp8"], s["zero"]) == ("megatron", fp8, 3 if fsdp else 1), run.name
        assert s["overlap_grad_reduce"] and s["overlap_param_gather"], run.name
        assert s["reduce_dtype"] == "bf16" and s["clip_grad"] and s["checkpointing"] == "none", run.name
        assert s["sp"] == (st.tp > 1) and s["seq_len"] == 8192, run.name
        assert st.cp == 1 or s["cp_rotate"] == "alltoall", run.name
        assert s["micro_batches"] == ga, run.name
        assert s["tp_comm_overlap"] == (st.tp > 1), run.name
        assert s["fp8_param_gather"] == (kind == "FP8-CS" or not fsdp), run.name


BRIDGE_MOE_ROWS = {
    # Megatron-Bridge docs/performance-summary.md (df0289c), "25.11 NeMo Container", the BF16 Qwen3 235B-A22B
    # rows of DGX-GB300 and DGX-GB200 as printed: (release, system, model, precision) → (#-GPUs, GBS, MBS,
    # sequence, FSDP, TP, PP, CP, VP, EP, GA), tokens/s/GPU (the float8 Qwen3 rows: BRIDGE_MOE_FP8_ROWS)
    ("25.11", "DGX-GB300", "Qwen3_235B_a22B", "BF16"): ((256, 8192, 2, 4096, 0, 1, 4, 1, 12, 16, 32), 6131),
    ("25.11", "DGX-GB200", "Qwen3_235B_a22B", "BF16"): ((256, 8192, 1, 4096, 0, 1, 8, 1, 3, 32, 256), 4916),
}
MOE_GA_AS_LAID_OUT = {
    # rows whose printed GA is not GBS / (MBS × dp): the micro-batches their layout makes (GB300: dp 64,
    # 8192 / (2 × 64) = 64, printed 32), which the typed run takes
    ("25.11", "DGX-GB300", "Qwen3_235B_a22B", "BF16"): 64,
}


def test_bridge_moe_rows_as_printed() -> None:
    """Both BF16 Qwen3 235B-A22B rows of the 25.11 DGX-GB300 and DGX-GB200 tables are in the set once, with
    the table's figures, on the gb300 and gb200 presets; GA is GBS / (MBS × dp), dp = GPUs / (TP·PP·CP),
    except where the printed GA disagrees with the row's own layout (``MOE_GA_AS_LAID_OUT``)."""
    assert len(BRIDGE_MOE_RUNS) == len(BRIDGE_MOE_ROWS) == 2
    got = {}
    for run in BRIDGE_MOE_RUNS:
        st = run.stated
        release = run.source.split("(", 1)[1].split(")", 1)[0]
        system = run.source.rsplit(", ", 1)[1]
        key = (release, system, "Qwen3_235B_a22B", "BF16")
        assert (st.model, st.fp8, st.gpu) == ("qwen3-235b-a22b", "none", BRIDGE_GPU[system]), run.name
        assert run.name.endswith(f"({release})"), run.name
        dp = st.gpus // (st.tp * st.pp * st.cp)
        ga = st.global_batch // (st.micro_batch * dp)
        printed = BRIDGE_MOE_ROWS[key][0][-1]
        assert ga == MOE_GA_AS_LAID_OUT.get(key, printed), run.name
        layout = (int(st.zero == 3), st.tp, st.pp, st.cp, st.vpp, st.ep, printed)
        got[key] = ((st.gpus, st.global_batch, st.micro_batch, st.seq, *layout), run.published)
    assert got == BRIDGE_MOE_ROWS


def test_bridge_moe_runs_are_typed_as_the_recipes_configure_them(predicted: dict[str, dict]) -> None:  # type: ignore[type-arg]
    """The 25.11 BF16 Qwen3 235B-A22B rows (heldout_bridge_moe.py): Megatron-core in BF16 (no float8), the
    distributed optimizer with overlapped gradient and parameter sync, gradients in bf16
    (grad_reduce_in_fp32 False), clipping at 1.0, no recompute, no offload (set_qwen3_common_configs, the
    library recipe, the V2 presets), TP 1 (no SP, TE's userbuffers moot), the printed EP taken from dp, the
    micro-batches GBS / (MBS × dp); the 94 layers split with account_for_embedding_in_pipeline_split and
    account_for_loss_in_pipeline_split: (94 + 2)/(PP·VP) a virtual stage, one fewer at each end — PP 4 × VP
    12: 2, and 1 at the ends; PP 8 × VP 3: 4, and 3."""
    for run in BRIDGE_MOE_RUNS:
        s = predicted[run.name]["setup"]
        assert s["fp8"] == "none", run.name
        _qwen3_typed_as_bridge_ran(run, s)


def _qwen3_typed_as_bridge_ran(run: Run, s: dict) -> None:  # type: ignore[type-arg]
    """What every Qwen3 row's recipes set (its test's docstring): Megatron-core, bf16-mixed, the distributed
    optimizer with both overlaps, clipping, bf16 gradients, no recompute or offload, the printed TP (SP with
    it, TE's userbuffers not typed), sequence 4096, ETP 1 (EP from dp, or from TP × DP under TP 2), GA
    micro-batches; 235B-A22B's embedding-and-loss split, 30B-A3B's even one."""
    st = run.stated
    assert (s["impl"], s["fp8"], s["precision"], s["zero"]) == ("megatron", st.fp8, "bf16-mixed", 1), run.name
    assert s["overlap_grad_reduce"] and s["overlap_param_gather"] and s["clip_grad"], run.name
    assert (s["reduce_dtype"], s["checkpointing"], s["offload"]) == ("bf16", "none", "none"), run.name
    # TE's userbuffers where the recipe sets them and memplan models them: 25.11's H100 235B-A22B config
    # (tp_comm_overlap=True, under parallel folding); 26.02's sets it off
    userbuffers = st.tp > 1 and run.name.endswith("(25.11)")
    layout = (s["tp"], s["sp"], s["cp"], s["tp_comm_overlap"], s["seq_len"])
    assert layout == (st.tp, st.tp > 1, 1, userbuffers, 4096), run.name
    dp = st.gpus // (st.pp * st.cp * st.tp)
    # the recipes' ETP 1 (``expert_tensor_parallel_size=1``): with TP 2 parallel folding, EP from TP × DP
    assert s["etp"] == (1 if st.tp > 1 else None) and (dp * st.tp) % st.ep == 0, run.name
    assert (s["ep"], s["dp"]) == (st.ep, dp) and (st.tp > 1 or dp % st.ep == 0), run.name
    assert s["micro_batches"] == st.global_batch // (st.micro_batch * dp), run.name
    if st.model == "qwen3-30b-a3b":
        assert s["pp_layers"] is None and 48 % (st.pp * st.vpp) == 0, run.name
        return
    want = [
        _megatron_layers_to_build(94, st.pp, st.vpp, v % st.pp, v // st.pp) for v in range(st.pp * st.vpp)
    ]
    per = 96 // (st.pp * st.vpp)
    assert sum(want) == 94 and want[0] == want[-1] == per - 1 and set(want[1:-1]) == {per}, run.name
    assert s["pp_layers"] == want, run.name


def test_bridge_moe_model_is_the_providers() -> None:
    """memplan's qwen3-235b-a22b is Megatron-Bridge's Qwen3MoEModelProvider235B_A22B (qwen_provider.py,
    07d0d14): 94 layers, hidden 4096, 64 heads of 128, 4 query groups, moe_ffn_hidden_size 1536, 128 experts,
    top-8, vocabulary 151,936 (a multiple of 128: no padding at TP 1), untied embeddings, no shared expert."""
    m = load_model("qwen3-235b-a22b").model
    moe = m.moe
    assert moe is not None
    assert (m.num_layers, m.hidden_size, m.num_heads, m.head_dim, m.num_kv_heads) == (94, 4096, 64, 128, 4)
    assert (m.ffn_size, moe.experts, moe.top_k, m.vocab_size) == (1536, 128, 8, 151936)
    assert m.vocab_size % 128 == 0 and not m.tied_embeddings and not moe.shared_experts


BRIDGE_MOE_FP8_ROWS = {
    # Megatron-Bridge docs/performance-summary.md, the float8 Qwen3 rows as printed: 25.11 (00b7660; the same
    # at df0289c) and 26.02 (df0289c); keys and values as BRIDGE_MOE_ROWS', VP "n/a" read as 1 (the DGX-H100
    # 235B-A22B rows, EP 32 across TP × DP: --etp 1; 25.11's GBS from df0289c, 00b7660's row lacks it)
    ("25.11", "DGX-GB300", "Qwen3_30B_a3B", "FP8-MX"): ((8, 512, 4, 4096, 0, 1, 1, 1, 1, 8, 16), 28934),
    ("25.11", "DGX-GB200", "Qwen3_30B_a3B", "FP8-MX"): ((8, 512, 4, 4096, 0, 1, 1, 1, 1, 8, 16), 23766),
    ("25.11", "DGX-B200", "Qwen3_30B_a3B", "FP8-MX"): ((8, 512, 1, 4096, 0, 1, 1, 1, 1, 8, 64), 9299),
    ("25.11", "DGX-B200", "Qwen3_235B_a22B", "FP8-MX"): ((64, 1024, 1, 4096, 0, 1, 8, 1, 2, 8, 128), 3269),
    ("25.11", "DGX-H100", "Qwen3_30B_a3B", "FP8-CS"): ((16, 512, 2, 4096, 0, 1, 2, 1, 24, 8, 32), 5275),
    ("26.02", "DGX-GB300", "Qwen3_30B_a3B", "FP8-MX"): ((8, 512, 8, 4096, 0, 1, 1, 1, 1, 8, 8), 30376),
    ("26.02", "DGX-GB300", "Qwen3_235B_a22B", "FP8-MX"): ((256, 8192, 2, 4096, 0, 1, 4, 1, 1, 32, 64), 6583),
    ("26.02", "DGX-GB200", "Qwen3_30B_a3B", "FP8-MX"): ((8, 512, 4, 4096, 0, 1, 1, 1, 1, 8, 16), 26084),
    ("26.02", "DGX-GB200", "Qwen3_235B_a22B", "FP8-MX"): ((256, 8192, 1, 4096, 0, 1, 8, 1, 1, 32, 256), 5448),
    ("26.02", "DGX-B300", "Qwen3_30B_a3B", "FP8-MX"): ((8, 512, 8, 4096, 0, 1, 1, 1, 1, 8, 8), 29521),
    ("26.02", "DGX-B300", "Qwen3_235B_a22B", "FP8-MX"): ((256, 8192, 1, 4096, 0, 1, 8, 1, 4, 8, 256), 2691),
    ("26.02", "DGX-B200", "Qwen3_30B_a3B", "FP8-MX"): ((8, 512, 1, 4096, 0, 1, 1, 1, 1, 8, 64), 9691),
    ("26.02", "DGX-B200", "Qwen3_235B_a22B", "FP8-MX"): ((256, 8192, 1, 4096, 0, 1, 8, 1, 1, 8, 256), 3805),
    ("26.02", "DGX-H100", "Qwen3_30B_a3B", "FP8-CS"): ((16, 1024, 1, 4096, 0, 1, 2, 1, 12, 8, 128), 2557),
    ("25.11", "DGX-H100", "Qwen3_235B_a22B", "FP8-CS"): ((256, 2048, 1, 4096, 0, 2, 8, 1, 4, 32, 128), 1575),
    ("26.02", "DGX-H100", "Qwen3_235B_a22B", "FP8-CS"): ((256, 8192, 1, 4096, 0, 2, 8, 1, 4, 32, 512), 1633),
}
QWEN3_MODELS = {"qwen3-30b-a3b": "Qwen3_30B_a3B", "qwen3-235b-a22b": "Qwen3_235B_a22B"}


def test_bridge_moe_fp8_rows_as_printed() -> None:
    """Every typable float8 Qwen3 row of the 25.11 and 26.02 tables is in the set once, with the table's
    figures, on its system's GPU preset; FP8-CS is --fp8 tensorwise, FP8-MX --fp8 mxfp8; the printed GA is
    GBS / (MBS × dp), dp = GPUs / (TP·PP·CP), on every row."""
    assert len(BRIDGE_MOE_FP8_RUNS) == len(BRIDGE_MOE_FP8_ROWS) == 6 + 10
    got = {}
    for run in BRIDGE_MOE_FP8_RUNS:
        st = run.stated
        release = run.source.split("(", 1)[1].split(")", 1)[0]
        system = run.source.rsplit(", ", 1)[1]
        key = (release, system, QWEN3_MODELS[st.model], BRIDGE_FP8[st.fp8])
        assert st.gpu == BRIDGE_GPU[system] and run.name.endswith(f"({release})"), run.name
        dp = st.gpus // (st.tp * st.pp * st.cp)
        ga = st.global_batch // (st.micro_batch * dp)
        layout = (int(st.zero == 3), st.tp, st.pp, st.cp, st.vpp, st.ep, ga)
        got[key] = ((st.gpus, st.global_batch, st.micro_batch, st.seq, *layout), run.published)
    assert got == BRIDGE_MOE_FP8_ROWS


def test_bridge_moe_fp8_runs_are_typed_as_the_recipes_configure_them(predicted: dict[str, dict]) -> None:  # type: ignore[type-arg]
    """The float8 Qwen3 rows (heldout_bridge_moe_fp8.py): Megatron-core with TE current scaling (FP8-CS) or
    MXFP8 (FP8-MX), fp8_param_gather (both recipes; the experts' primary weights too), the plain distributed
    optimizer (use_precision_aware_optimizer is bf16's only) with overlapped gradient and parameter sync,
    gradients in bf16, clipping at 1.0, no recompute, no offload, the printed TP (TP 1 but the DGX-H100
    235B-A22B rows' TP 2 with SP; TE's userbuffers not typed), the printed EP taken from dp (from TP × DP
    under the recipes' ETP 1 at TP 2: --etp 1), the micro-batches GBS / (MBS × dp); 235B-A22B's 94 layers
    split with the embedding and the loss ((94 + 2)/(PP·VP) a virtual stage, one fewer at each end),
    30B-A3B's 48 evenly (its recipe sets no such split)."""
    for run in BRIDGE_MOE_FP8_RUNS:
        s = predicted[run.name]["setup"]
        assert run.stated.fp8 in BRIDGE_FP8 and s["fp8_param_gather"], run.name
        _qwen3_typed_as_bridge_ran(run, s)


def test_bridge_moe_30b_model_is_the_providers() -> None:
    """memplan's qwen3-30b-a3b is Megatron-Bridge's Qwen3MoEModelProvider30B_A3B (qwen_provider.py, 07d0d14):
    48 layers, hidden 2048, 32 heads of 128 (kv_channels), 4 query groups, moe_ffn_hidden_size 768, 128
    experts, top-8, vocabulary 151,936, untied embeddings, no shared expert."""
    m = load_model("qwen3-30b-a3b").model
    moe = m.moe
    assert moe is not None
    assert (m.num_layers, m.hidden_size, m.num_heads, m.head_dim, m.num_kv_heads) == (48, 2048, 32, 128, 4)
    assert (m.ffn_size, moe.experts, moe.top_k, m.vocab_size) == (768, 128, 8, 151936)
    assert not m.tied_embeddings and not moe.shared_experts


def test_torchtitans_generated_split_points_by_hand() -> None:
    """``generate_split_points`` of late 2024 for Llama 3.1 405B's 126 blocks: over 8 stages 126 // 8 = 15
    on the first, the 6 left over one each to stages 1-6, the last the rest (15); over 16 virtual stages 7,
    then 14 × 8, then 7."""
    from benchmarks.heldout import split_points

    assert split_points(126, 8) == (15, 16, 16, 16, 16, 16, 16, 15)
    assert split_points(126, 16) == (7, *[8] * 14, 7)
    assert sum(split_points(126, 16)) == 126
