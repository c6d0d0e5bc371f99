"""The error catalogue: every bad input a user can give memplan, through every command and input path.

Each case runs ``memplan …`` through typer's ``CliRunner`` on ``memplan.cli.app`` and asserts the contract
of DESIGN.md / memplan.cli.common: exit code 2; exactly ONE line on stderr (``error: …``) that names the
field at fault; nothing on stdout; no traceback, and no exception escaping the command.

Input paths covered: flags (types, signs, zero, NaN/inf, absurd sizes, incompatible combinations,
unknown names), preset and config files (syntax, fields, types, validation, file-system trouble, size,
encoding; preset TOML, preset JSON and Hugging Face config.json), and each command (estimate, presets
show, trace, profile, schema, and the planning commands when they exist).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from memplan.cli.app import app


@dataclass(frozen=True)
class Case:
    id: str
    args: tuple[str, ...]
    field: str
    """A string the one error line must contain: the field, option or file at fault."""


def case(id: str, cmd: str, field: str) -> Case:
    return Case(id, tuple(cmd.split()), field)


PRESET_HEAD = 'name = "x"\nsource = "test"\npublished_params = 1\n'
GOOD_MODEL = "hidden_size = 64\nnum_layers = 2\nnum_heads = 4\nffn_size = 128\nvocab_size = 10\n"


def preset(model_lines: str) -> str:
    return f"{PRESET_HEAD}[model]\n{model_lines}"


# Files written into the test's folder ({dir} in the arguments): name → bytes.
FILES: dict[str, bytes] = {
    "bad-syntax.toml": f"{PRESET_HEAD}[model\nhidden_size = 1\n".encode(),
    "bad-syntax.json": b'{"name": "x", "model": {',
    "bool-int.toml": preset(GOOD_MODEL.replace("hidden_size = 64", "hidden_size = true")).encode(),
    "hf-no-model-type.json": b'{"architectures": ["LlamaForCausalLM"], "hidden_size": 64}',
    "missing-field.toml": preset(GOOD_MODEL.replace("vocab_size = 10\n", "")).encode(),
    "unknown-field.toml": preset(GOOD_MODEL + "hiden = 3\n").encode(),
    "unknown-top-field.toml": (PRESET_HEAD + "colour = 'red'\n[model]\n" + GOOD_MODEL).encode(),
    "wrong-type.toml": preset(GOOD_MODEL.replace("hidden_size = 64", 'hidden_size = "big"')).encode(),
    "negative.toml": preset(GOOD_MODEL.replace("num_layers = 2", "num_layers = -2")).encode(),
    "zero-vocab.toml": preset(GOOD_MODEL.replace("vocab_size = 10", "vocab_size = 0")).encode(),
    "heads-not-dividing.toml": preset(GOOD_MODEL.replace("num_heads = 4", "num_heads = 5")).encode(),
    "kv-not-dividing.toml": preset(GOOD_MODEL + "num_kv_heads = 3\n").encode(),
    "swiglu-no-ffn.toml": preset(GOOD_MODEL.replace("ffn_size = 128\n", "")).encode(),
    "odd-rope-head.toml": preset(
        GOOD_MODEL.replace("hidden_size = 64", "hidden_size = 63").replace("num_heads = 4", "num_heads = 7")
    ).encode(),
    "unknown-norm.toml": preset(GOOD_MODEL + 'norm = "batchnorm"\n').encode(),
    "nan-dropout.toml": preset(GOOD_MODEL + "attn_dropout = nan\n").encode(),
    "inf-positions.toml": preset(GOOD_MODEL + "max_positions = inf\n").encode(),
    "top-level-array.json": b"[1, 2, 3]",
    "empty.toml": b"",
    "not-utf8.toml": PRESET_HEAD.encode() + b"notes = '\xff\xfe caf\xe9'\n",
    "hf-missing.json": b'{"model_type": "llama", "hidden_size": 64}',
    "hf-unsupported.json": b'{"model_type": "bert", "hidden_size": 64}',
    "hf-wrong-type.json": (
        b'{"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,'
        b' "intermediate_size": "x", "vocab_size": 10}'
    ),
    "unreadable.toml": preset(GOOD_MODEL).encode(),
    # The families' unmodelled features (tests/hf/test_<family>.py): refused, one line each.
    **{
        f"hf-{name}.json": (
            b'{"model_type": "%s", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,'
            b' "intermediate_size": 128, "vocab_size": 10, %s}' % (name.encode(), extra)
        )
        for name, extra in {
            "olmo2": b'"rms_norm_eps": 1e-6',
            "falcon": b'"alibi": true',
            "phimoe": b'"num_local_experts": 4, "num_experts_per_tok": 3',
            "gpt_neox": b'"rope_parameters": [0.25]',  # an object in transformers 5, not a list
        }.items()
    },
}
BIG_FILE = "fifty-megabytes.toml"
BIG_SIZE = 50 * 1024 * 1024

CASES: list[Case] = [
    # --- estimate: numbers of the wrong type, sign or size ------------------------------------------
    case("seq-not-int", "estimate -m 70b --seq abc", "seq"),
    case("seq-float", "estimate -m 70b --seq 8192.5", "seq"),
    case("seq-hex", "estimate -m 70b --seq 0x10", "seq"),
    case("seq-negative", "estimate -m 70b --seq -5", "seq"),
    case("seq-zero", "estimate -m 70b --seq 0", "seq"),
    case("seq-absurd", f"estimate -m 70b --seq {10**12}", "seq"),
    case("seq-beyond-int64", f"estimate -m 70b --seq {10**30}", "seq"),
    case("seq-over-learned-positions", "estimate -m gpt2 --seq 2048", "seq"),
    case("seq-missing-value", "estimate -m 70b --seq", "--seq"),
    case("batch-zero", "estimate -m 70b --batch 0", "batch"),
    case("batch-negative", "estimate -m 70b --batch -1", "batch"),
    case("batch-float", "estimate -m 70b --batch 1.5", "batch"),
    case("batch-absurd", f"estimate -m 70b --batch {10**20}", "batch"),
    case("grad-accum-zero", "estimate -m 70b --grad-accum 0", "grad-accum"),
    case("grad-accum-absurd", "estimate -m 70b --grad-accum 99999999", "grad-accum"),
    case("dp-zero", "estimate -m 70b --dp 0", "dp"),
    case("dp-negative", "estimate -m 70b --dp -3", "dp"),
    case("dp-absurd", "estimate -m 70b --dp 99999999", "dp"),
    case("hsdp-zero", "estimate -m 70b --dp 16 --zero 3 --hsdp 0", "hsdp"),
    case("hsdp-not-dividing", "estimate -m 70b --dp 16 --zero 3 --hsdp 3", "hsdp"),
    case("hsdp-without-zero", "estimate -m 70b --dp 16 --hsdp 8", "hsdp"),
    case("hsdp-with-ep", "estimate -m mixtral-8x7b --dp 16 --ep 8 --zero 3 --hsdp 8", "hsdp"),
    case("reduce-dtype-unknown", "estimate -m 70b --reduce-dtype fp8", "reduce-dtype"),
    case("cp-rotate-unknown", "estimate -m 70b --cp 2 --cp-rotate ring", "cp-rotate"),
    case("zero-5", "estimate -m 70b --zero 5", "zero"),
    # fine-tuning (LoRA, QLoRA, freezing)
    case("lora-rank-without-lora", "estimate -m 7b --lora-rank 8", "lora-rank"),
    case("lora-rank-zero", "estimate -m 7b --finetune lora --lora-rank 0", "rank"),
    case("lora-dropout-one", "estimate -m 7b --finetune lora --lora-dropout 1", "dropout"),
    case("lora-alpha-negative", "estimate -m 7b --finetune lora --lora-alpha -1", "alpha"),
    case("lora-targets-unknown", "estimate -m 7b --finetune lora --lora-targets q,x", "lora-targets"),
    case("lora-targets-twice", "estimate -m 7b --finetune lora --lora-targets q,q", "lora-targets"),
    case("lora-targets-gate-gelu", "estimate -m gpt2 --finetune lora --lora-targets gate", "lora-targets"),
    case("finetune-unknown", "estimate -m 7b --finetune bogus", "finetune"),
    case("freeze-unknown", "estimate -m 7b --freeze head", "freeze"),
    case("freeze-layers-beyond", "estimate -m 7b --freeze layers:0-99", "freeze"),
    case("freeze-layers-reversed", "estimate -m 7b --freeze layers:3-1", "freeze"),
    case("freeze-layers-garbage", "estimate -m 7b --freeze layers:a-b", "freeze"),
    case("freeze-embeddings-under-lora", "estimate -m 7b --finetune lora --freeze embeddings", "freeze"),
    case("freeze-every-layer-under-lora", "estimate -m 7b --finetune lora --freeze layers:0-31", "freeze"),
    case("quant-without-qlora", "estimate -m 7b --quant nf4", "quant"),
    case("double-quant-without-qlora", "estimate -m 7b --double-quant", "quant"),
    case("lora-with-selective", "estimate -m 7b --finetune lora --checkpointing selective", "finetune"),
    case("frozen-layers-checkpointed", "estimate -m 7b --freeze layers:0-3 --checkpointing full", "finetune"),
    case("qlora-with-tp", "estimate -m 7b --finetune qlora --tp 2", "finetune"),
    case("qlora-with-moe", "estimate -m mixtral-8x7b --finetune qlora", "finetune"),
    case("lora-on-experts", "estimate -m mixtral-8x7b --finetune lora --lora-targets all-linear", "finetune"),
    case("lora-moe-ep", "estimate -m mixtral-8x7b --finetune lora --ep 2 --gpus 2", "finetune"),
    case("hf-lora-gpt2-split-c-attn", "estimate -m gpt2 --finetune lora --impl hf", "lora-targets"),
    case("hf-lora-neox-split-qkv", "estimate -m pythia-160m --finetune lora --impl hf", "lora-targets"),
    case("hf-lora-phi3-split-qkv", "estimate -m phi-3-mini --finetune lora --impl hf", "lora-targets"),
    case("trace-hf-qlora", "trace -m tiny --seq 32 --impl hf --finetune qlora", "finetune"),
    case("zero-negative", "estimate -m 70b --zero -1", "zero"),
    case("zero-not-int", "estimate -m 70b --zero abc", "zero"),
    case("zero-float", "estimate -m 70b --zero 1.5", "zero"),
    case("dropout-nan", "estimate -m 70b --dropout nan", "dropout"),
    case("dropout-inf", "estimate -m 70b --dropout inf", "dropout"),
    case("dropout-minus-inf", "estimate -m 70b --dropout -inf", "dropout"),
    case("dropout-overflow", "estimate -m 70b --dropout 1e309", "dropout"),
    case("dropout-one", "estimate -m 70b --dropout 1", "dropout"),
    case("dropout-negative", "estimate -m 70b --dropout -0.1", "dropout"),
    case("dropout-not-number", "estimate -m 70b --dropout abc", "dropout"),
    # --- estimate: incompatible combinations and checkpointing spellings ------------------------------
    case("reversible-with-full", "estimate -m 70b --reversible --checkpointing full", "reversible"),
    case("reversible-with-selective", "estimate -m 70b --reversible --checkpointing selective", "reversible"),
    case("reversible-with-every-k", "estimate -m 70b --reversible --checkpointing every-4", "reversible"),
    case("every-0", "estimate -m 70b --checkpointing every-0", "checkpointing"),
    case("every-999-on-80-layers", "estimate -m 70b --checkpointing every-999", "checkpointing"),
    case("every-huge", f"estimate -m 70b --checkpointing every-{10**30}", "checkpointing"),
    case("every-no-k", "estimate -m 70b --checkpointing every-", "checkpointing"),
    case("every-not-int", "estimate -m 70b --checkpointing every-4.5", "checkpointing"),
    case("every-negative", "estimate -m 70b --checkpointing every--4", "checkpointing"),
    # --- estimate: unknown names ----------------------------------------------------------------------
    case("unknown-checkpointing", "estimate -m 70b --checkpointing sometimes", "checkpointing"),
    case("unknown-precision", "estimate -m 70b --precision fp8", "precision"),
    case("fsdp2-mixed-one-rank", "estimate -m 70b --precision fsdp2-mixed --zero 3", "precision"),
    case("fsdp2-mixed-fit", "fit -m 8b --precision fsdp2-mixed --gpu h100-sxm --gpus 8", "precision"),
    case("fsdp2-mixed-zero1", "estimate -m 70b --precision fsdp2-mixed --zero 1 --dp 8", "precision"),
    case(
        "fsdp2-mixed-megatron",
        "estimate -m 8b --impl megatron --precision fsdp2-mixed --zero 3 --dp 8",
        "precision",
    ),
    case(
        "fsdp2-mixed-lora",
        "estimate -m 8b --finetune lora --precision fsdp2-mixed --zero 3 --dp 8",
        "precision",
    ),
    case("trace-reference-pp", "trace -m tiny --pp 2 --grad-accum 4", "pp"),
    case("profile-moe-tp", "profile -m qwen-moe --device cpu --seq 32 --nproc 4 --tp 2", "tp"),
    case(
        "profile-moe-fp8-ranks", "profile -m qwen-moe --device cpu --seq 32 --nproc 2 --fp8 tensorwise", "fp8"
    ),
    case(
        "fsdp2-mixed-profile-one-process",
        "profile -m tiny --device cpu --precision fsdp2-mixed --zero 3",
        "precision",
    ),
    case("megatron-fp8-rowwise", "estimate -m 8b --impl megatron --fp8 rowwise", "fp8"),
    case("titan-fp8-delayed", "estimate -m tiny --impl torchtitan --fp8 delayed", "fp8"),
    case("reference-fp8-delayed", "estimate -m tiny --fp8 delayed", "fp8"),
    case("megatron-fp8-blockwise", "estimate -m 8b --impl megatron --fp8 blockwise", "fp8"),
    case("mxfp8-hopper", "estimate -m 8b --impl megatron --fp8 mxfp8 --gpu h100", "mxfp8"),
    case("titan-mxfp8", "estimate -m tiny --impl torchtitan --fp8 mxfp8", "fp8"),
    case("amax-history-not-delayed", "estimate -m tiny --fp8-amax-history-len 4", "fp8_amax_history_len"),
    case("fp8-all-gather-reference", "estimate -m tiny --fp8 tensorwise --fp8-all-gather", "fp8_all_gather"),
    case(
        "fp8-all-gather-rowwise",
        "estimate -m tiny --impl torchtitan --fp8 rowwise --zero 3 --dp 2 --gpus 2 --fp8-all-gather",
        "fp8_all_gather",
    ),
    case(
        "fp8-all-gather-no-fsdp",
        "estimate -m tiny --impl torchtitan --fp8 tensorwise --fp8-all-gather",
        "fp8_all_gather",
    ),
    case(
        "fp8-all-gather-tp",
        "estimate -m tiny --impl torchtitan --fp8 tensorwise --zero 3 --dp 2 --tp 2 --fp8-all-gather",
        "fp8_all_gather",
    ),
    case("fp8-tp-no-sp", "estimate -m tiny --impl torchtitan --fp8 tensorwise --tp 2 --fp8-tp", "fp8_tp"),
    case("fp8-tp-reference", "estimate -m tiny --fp8 tensorwise --tp 2 --sp --fp8-tp", "fp8_tp"),
    case(
        "fp8-tp-compile",
        "estimate -m tiny --impl torchtitan --fp8 tensorwise --tp 2 --sp --compile --seq 64 --fp8-tp",
        "fp8_tp",
    ),
    case("fsdp-wrap-reference", "estimate -m tiny --zero 3 --dp 2 --gpus 2 --fsdp-wrap root", "fsdp_wrap"),
    case(
        "fsdp-wrap-zero2", "estimate -m tiny --impl torchtitan --zero 2 --dp 2 --fsdp-wrap root", "fsdp_wrap"
    ),
    case("fsdp-wrap-one-rank", "estimate -m tiny --impl torchtitan --zero 3 --fsdp-wrap root", "fsdp_wrap"),
    case(
        "fsdp-wrap-cp",
        "estimate -m tiny --impl torchtitan --zero 3 --dp 2 --cp 2 --fsdp-wrap root",
        "fsdp_wrap",
    ),
    case(
        "fsdp-wrap-hsdp",
        "estimate -m tiny --impl torchtitan --zero 3 --dp 4 --hsdp 2 --fsdp-wrap root",
        "fsdp_wrap",
    ),
    case("fsdp-wrap-typo", "estimate -m tiny --impl torchtitan --fsdp-wrap roots", "fsdp-wrap"),
    # torchtitan's TP plan unties a tied embedding before FSDP2 wraps it (analytic.fsdp.moments.zero3_tied)
    case("titan-tied-tp-fsdp", "estimate -m llama-3.2-1b --impl torchtitan --tp 2 --zero 3 --dp 2", "tp"),
    case("compile-loss-eager", "estimate -m tiny --impl torchtitan --no-compile-loss", "compile_loss"),
    case("compile-loss-reference", "estimate -m tiny --compile --no-compile-loss", "compile_loss"),
    case(
        "amax-history-zero", "estimate -m 8b --impl megatron --fp8 delayed --fp8-amax-history-len 0", "amax"
    ),
    case("megatron-fp8-moe", "estimate -m mixtral-8x7b --impl megatron --fp8 delayed", "fp8"),
    case("hf-fp8", "estimate -m tiny --impl hf --fp8 rowwise", "fp8"),
    case("trace-hf-compile", "trace -m tiny --seq 32 --impl hf --compile", "compile"),
    # CPU's SDPA runs its math kernel under attention dropout, CUDA's flash: not the cuda estimate's saves
    case("trace-hf-cuda-math", "trace -m tiny --seq 32 --impl hf --device cuda --dropout 0.1", "device"),
    case(
        "trace-compile-fp8-tp",
        "trace -m tiny --seq 32 --impl torchtitan --tp 2 --compile --fp8 rowwise",
        "compile",
    ),
    case(
        "trace-titan-rank-compile",
        "trace -m tiny --seq 32 --impl torchtitan --dp 2 --zero 2 --checkpointing selective --compile",
        "compile",
    ),
    case("titan-pp-compile-cp", "estimate -m 8b --impl torchtitan --pp 2 --cp 2 --compile", "compile"),
    case("unknown-optimizer", "estimate -m 70b --optimizer adam", "optimizer"),
    case("unknown-optimizer-impl", "estimate -m 70b --optimizer-impl apex", "optimizer-impl"),
    case("torch-impl-for-sgd", "estimate -m 70b --optimizer sgd --optimizer-impl fused", "optimizer_impl"),
    case("bnb-impl-for-adamw", "estimate -m 70b --optimizer-impl bitsandbytes", "optimizer_impl"),
    case("unknown-attention", "estimate -m 70b --attention sparse", "attention"),
    case("unknown-device", "estimate -m 70b --device tpu", "device"),
    case("unknown-preset", "estimate -m nosuch", "model"),
    case("misspelt-preset", "estimate -m lama-70b", "model"),
    case("model-missing", "estimate --seq 1024", "model"),
    case("unknown-option", "estimate -m 70b --sequence 8", "--sequence"),
    case("unknown-command", "nosuchcommand", "nosuchcommand"),
    # --- model files: preset TOML / JSON --------------------------------------------------------------
    case("toml-syntax", "estimate -m {dir}/bad-syntax.toml", "bad-syntax.toml"),
    case("json-syntax", "estimate -m {dir}/bad-syntax.json", "bad-syntax.json"),
    case("file-missing-field", "estimate -m {dir}/missing-field.toml", "vocab_size"),
    case("file-unknown-field", "estimate -m {dir}/unknown-field.toml", "hiden"),
    case("file-unknown-top-field", "estimate -m {dir}/unknown-top-field.toml", "colour"),
    case("file-wrong-type", "estimate -m {dir}/wrong-type.toml", "hidden_size"),
    case("file-negative", "estimate -m {dir}/negative.toml", "num_layers"),
    case("file-zero-vocab", "estimate -m {dir}/zero-vocab.toml", "vocab_size"),
    case("file-heads-not-dividing", "estimate -m {dir}/heads-not-dividing.toml", "num_heads"),
    case("file-kv-not-dividing", "estimate -m {dir}/kv-not-dividing.toml", "num_kv_heads"),
    case("file-swiglu-no-ffn", "estimate -m {dir}/swiglu-no-ffn.toml", "ffn_size"),
    case("file-odd-rope-head", "estimate -m {dir}/odd-rope-head.toml", "head_dim"),
    case("file-unknown-norm", "estimate -m {dir}/unknown-norm.toml", "norm"),
    case("file-nan-dropout", "estimate -m {dir}/nan-dropout.toml", "attn_dropout"),
    case("file-inf-positions", "estimate -m {dir}/inf-positions.toml", "max_positions"),
    case("file-top-level-array", "estimate -m {dir}/top-level-array.json", "top-level-array.json"),
    case("file-empty", "estimate -m {dir}/empty.toml", "name"),
    case("file-not-utf8", "estimate -m {dir}/not-utf8.toml", "UTF-8"),
    case("file-50-mb", f"estimate -m {{dir}}/{BIG_FILE}", BIG_FILE),
    case("file-directory", "estimate -m {dir}", "directory"),
    case("file-does-not-exist", "estimate -m {dir}/nowhere.toml", "nowhere.toml"),
    case("file-unreadable", "estimate -m {dir}/unreadable.toml", "unreadable.toml"),
    # --- model files: Hugging Face config.json ----------------------------------------------------------
    case("hf-missing-field", "estimate -m {dir}/hf-missing.json", "num_hidden_layers"),
    case("hf-unsupported-type", "estimate -m {dir}/hf-unsupported.json", "model_type"),
    case("hf-wrong-type", "estimate -m {dir}/hf-wrong-type.json", "intermediate_size"),
    case(
        "hf-olmo2-reference",
        "estimate -m {dir}/hf-olmo2.json --impl reference",
        "post_norms: modelled for transformers'",
    ),
    case("hf-falcon-alibi", "estimate -m {dir}/hf-falcon.json --impl hf", "alibi"),
    case("hf-phimoe-top3", "estimate -m {dir}/hf-phimoe.json --impl hf", "num_experts_per_tok: 3"),
    case("hf-rope-list", "estimate -m {dir}/hf-gpt_neox.json", "rope_parameters: expected an object"),
    case(
        "phimoe-reference",
        "estimate -m phi-3.5-moe --impl reference",
        "moe.input_jitter: modelled for transformers'",
    ),
    # --- other commands ---------------------------------------------------------------------------------
    case("presets-show-unknown", "presets show nosuch", "model"),
    case("presets-show-directory", "presets show {dir}", "directory"),
    case("presets-show-bad-file", "presets show {dir}/bad-syntax.toml", "bad-syntax.toml"),
    case("presets-unknown-subcommand", "presets bogus", "bogus"),
    case("schema-unknown-option", "schema --bogus", "--bogus"),
    case("trace-seq-zero", "trace -m tiny --seq 0", "seq"),
    case("trace-unknown-preset", "trace -m nosuch", "model"),
    case(
        "trace-reversible-with-selective",
        "trace -m tiny --reversible --checkpointing selective",
        "reversible",
    ),
    case("trace-flash-dropout-on-cpu", "trace -m tiny --seq 8 --dropout 0.1", "dropout"),
    case("profile-steps-zero", "profile -m tiny --device cpu --steps 0", "steps"),
    case("profile-steps-not-int", "profile -m tiny --device cpu --steps abc", "steps"),
    case("profile-warmup-negative", "profile -m tiny --device cpu --warmup -1", "warmup"),
    case("profile-unknown-device", "profile -m tiny --device tpu", "device"),
    case(
        "profile-snapshot-on-cpu",
        "profile -m tiny --device cpu --seq 8 --memory-snapshot {dir}/s.pickle",
        "memory-snapshot",
    ),
    case(
        "profile-trace-unwritable",
        "profile -m tiny --device cpu --seq 8 --steps 1 --warmup 0 --torch-trace {dir}/nowhere/t.json",
        "torch-trace",
    ),
    # --- planning commands: plan, compare, fit ----------------------------------------------------------
    case("plan-tp-not-dividing-heads", "plan -m 70b --tp 3", "tp"),
    case("plan-tp-zero", "plan -m 70b --tp 0", "tp"),
    case("plan-pp-more-than-layers", "plan -m 70b --pp 81", "pp"),
    case("plan-pp-zero", "plan -m 70b --pp 0", "pp"),
    case("plan-vpp-not-dividing", "plan -m 70b --pp 4 --vpp 3", "vpp"),
    case("plan-gpus-not-splitting", "plan -m 70b --gpus 7 --tp 2", "gpus"),
    case("plan-ep-on-dense", "plan -m 70b --ep 2", "ep"),
    case("plan-sp-without-tp", "plan -m 70b --sp", "sp"),
    case("plan-global-batch-not-multiple", "plan -m 70b --global-batch 7 --batch 2", "global"),
    case("plan-global-batch-zero", "plan -m 70b --global-batch 0", "global"),
    case("plan-unknown-gpu", "plan -m 70b --gpu nosuch", "gpu"),
    case("plan-gpu-file-directory", "plan -m 70b --gpu {dir}", "directory"),
    case("plan-gpu-file-bad-toml", "plan -m 70b --gpu {dir}/bad-syntax.toml", "bad-syntax.toml"),
    case("plan-mfu-without-gpu", "plan -m 70b --mfu 0.4", "gpu"),
    case("plan-mfu-over-one", "plan -m 70b --gpu h100-sxm --mfu 1.5", "mfu"),
    case("plan-mfu-nan", "plan -m 70b --gpu h100-sxm --mfu nan", "mfu"),
    case("plan-step-time-zero", "plan -m 70b --gpu h100-sxm --step-time 0", "step-time"),
    case("plan-step-time-inf", "plan -m 70b --gpu h100-sxm --step-time inf", "step-time"),
    case("plan-tokens-negative", "plan -m 70b --gpu h100-sxm --tokens -5", "tokens"),
    case("plan-tokens-nan", "plan -m 70b --gpu h100-sxm --tokens nan", "tokens"),
    case("compare-tp-not-dividing-heads", "compare -m 70b --tp 3", "tp"),
    case("compare-pp-more-than-layers", "compare -m 70b --pp 81", "pp"),
    case("compare-unknown-gpu", "compare -m 70b --gpu nosuch", "gpu"),
    case("compare-unknown-model-in-list", "compare -m 70b,nosuch", "nosuch"),
    case("compare-empty-model-list", "compare -m ,", "model"),
    case("compare-vary-unknown-key", "compare -m 70b --vary nokey=1,2", "nokey"),
    case("compare-vary-no-values", "compare -m 70b --vary seq", "vary"),
    case("compare-vary-bad-int", "compare -m 70b --vary seq=abc", "seq"),
    case("compare-vary-zero-5", "compare -m 70b --vary zero=5", "zero"),
    case("compare-sort-unknown-column", "compare -m 70b --sort nocolumn", "sort"),
    case("compare-two-output-formats", "compare -m 70b --json --csv", "csv"),
    case("fit-gpus-zero", "fit -m 70b --gpu h100-sxm --gpus 0", "gpus"),
    case("fit-missing-gpu", "fit -m 70b --gpus 8", "gpu"),
    case("fit-unknown-gpu", "fit -m 70b --gpu nosuch --gpus 8", "gpu"),
    case("fit-unknown-model", "fit -m nosuch --gpu h100-sxm --gpus 8", "model"),
    case(
        "fit-bad-checkpointing-list",
        "fit -m 70b --gpu h100-sxm --gpus 8 --checkpointing bogus",
        "checkpointing",
    ),
    case("fit-zero-7", "fit -m 70b --gpu h100-sxm --gpus 8 --zero 7", "zero"),
    case("fit-micro-batches-zero", "fit -m 70b --gpu h100-sxm --gpus 8 --micro-batches 0", "micro-batches"),
    case("fit-tp-max-zero", "fit -m 70b --gpu h100-sxm --gpus 8 --tp-max 0", "tp-max"),
    case("fit-top-negative", "fit -m 70b --gpu h100-sxm --gpus 8 --top -1", "top"),
    case("fit-global-batch-zero", "fit -m 70b --gpu h100-sxm --gpus 8 --global-batch 0", "global"),
    case("fit-mfu-over-one", "fit -m 70b --gpu h100-sxm --gpus 8 --mfu 2", "mfu"),
    # --- issue #13: every bad input is an error (the field, and for compare the failing row) ------------
    case(
        "compare-vary-bad-checkpointing",
        "compare -m 7b --vary checkpointing=none,bogus",
        "checkpointing=bogus",
    ),
    case("compare-vary-zero-0-5", "compare -m 7b --vary zero=0,5", "zero=5"),
    case("compare-vary-seq-0", "compare -m 7b --vary seq=1024,0", "seq=0"),
    case("compare-vary-gpu-nosuch", "compare -m 7b --vary gpu=h100,nosuch", "gpu=nosuch"),
    case("compare-vary-tp-gpus-7", "compare -m 7b --vary tp=1,2 --gpus 7", "tp=2"),
    case("compare-vary-tp-1-sp", "compare -m 7b --vary tp=1,2,4,8 --sp", "tp=1"),
    case("plan-step-time-over-peak", "plan -m 7b --gpu h100 --step-time 0.001", "--step-time 0.0887"),
    case("plan-step-time-denormal", "plan -m 7b --gpu h100 --step-time 1e-320 --json", "step-time"),
    case("plan-unknown-gpu-lists-gpus", "plan -m 7b --gpu nosuch", "`memplan gpus`"),
    case("plan-global-batch-huge", "plan -m 7b --global-batch 1000000000000", "global-batch"),
    case("plan-tp-zero-fix", "plan -m 7b --tp 0", "use --tp N"),
    case("plan-dp-zero-fix", "plan -m 7b --dp 0", "use --dp N"),
    case("plan-gpus-zero-fix", "plan -m 7b --gpus 0", "use --gpus N"),
    case("fit-nothing-to-search", "fit -m 7b --gpu h100 --gpus 1000 --global-batch 3", "global-batch"),
    case("plan-reserve-whole-gpu", "plan -m 7b --gpu h100 --reserve 80", "reserve"),
    case("plan-reserve-negative", "plan -m 7b --gpu h100 --reserve -1", "reserve"),
    case("plan-reserve-without-gpu", "plan -m 7b --reserve 2", "reserve"),
    case("fit-reserve-nan", "fit -m 7b --gpu h100 --gpus 8 --reserve nan", "reserve"),
    case("plan-model-empty", "plan --model=", "--model NAME"),
    # --- options whose constraint failed in pydantic's words, without the option or a fix --------------
    case("plan-cp-zero-fix", "plan -m 7b --cp 0", "use --cp N"),
    case("plan-lora-rank-zero-fix", "plan -m 7b --finetune lora --lora-rank 0", "use --lora-rank R"),
    case("plan-lora-alpha-nan-fix", "plan -m 7b --finetune lora --lora-alpha nan", "use --lora-alpha A"),
    case("plan-lora-dropout-one-fix", "plan -m 7b --finetune qlora --lora-dropout 1", "use --lora-dropout P"),
    case(
        "fit-lora-rank-huge-fix", "fit -m 7b --gpu h100 --gpus 8 --finetune lora --lora-rank 1e9", "lora-rank"
    ),
    case("plan-loss-chunks-huge-fix", "plan -m 7b --loss chunked:99999999999", "use --loss chunked:N"),
    case("plan-xentropy-tp", "plan -m 7b --loss xentropy --tp 2 --gpus 2", "--tp 1"),
    case(
        "plan-xentropy-offload", "plan -m 7b --loss xentropy --zero 3 --offload optimizer", "--offload none"
    ),
    case("plan-loss-unknown", "plan -m 7b --loss softmax", "choose standard, xentropy"),
    case("plan-plot-txt", "plan -m 7b --plot {dir}/step.txt", "--plot step.svg"),
    case("file-bool-for-int", "estimate -m {dir}/bool-int.toml", "hidden_size"),
    case("hf-config-without-model-type", "estimate -m {dir}/hf-no-model-type.json", "model_type: missing"),
]
TORCH_COMMANDS = {"trace", "profile"}
PLAN_COMMANDS = {"plan", "compare", "fit"}
# A raw pydantic dump is one line once folded, but it is not `field: what; fix`.
RAW_DUMPS = ("validation error for", "[type=", "errors.pydantic.dev")

# Cases that fail today: they are bugs (see the report), not relaxed expectations.
KNOWN_FAILURES: dict[str, str] = {}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    folder = tmp_path_factory.mktemp("catalogue")
    for name, data in FILES.items():
        (folder / name).write_bytes(data)
    with (folder / BIG_FILE).open("wb") as f:  # sparse where the file system allows: 50 MB, no RAM
        f.truncate(BIG_SIZE)
    (folder / "unreadable.toml").chmod(0)
    yield folder
    (folder / "unreadable.toml").chmod(0o600)


def _params() -> list[object]:
    params: list[object] = []
    for c in CASES:
        marks: list[pytest.MarkDecorator] = []
        if c.id in KNOWN_FAILURES:
            marks.append(pytest.mark.xfail(strict=True, reason=KNOWN_FAILURES[c.id]))
        params.append(pytest.param(c, id=c.id, marks=marks))
    return params


def registered_commands() -> set[str]:
    group = typer.main.get_command(app)
    return set(getattr(group, "commands", {}))


def run(args: list[str]) -> tuple[int, str, str, BaseException | None]:
    result = CliRunner().invoke(app, args, env={"COLUMNS": "100", "NO_COLOR": "1"})
    return result.exit_code, result.stdout, result.stderr, result.exception


@pytest.mark.parametrize("c", _params())
def test_bad_input_is_one_line_naming_the_field(c: Case, files: Path) -> None:
    if c.args[0] in TORCH_COMMANDS:
        pytest.importorskip("torch")
    if c.args[0] in PLAN_COMMANDS and c.args[0] not in registered_commands():
        pytest.skip(f"memplan {c.args[0]} is not registered in this build")
    if c.id == "file-unreadable" and hasattr(os, "geteuid") and os.geteuid() == 0:
        pytest.skip("running as root: chmod 000 does not stop root from reading the file")
    args = [a.replace("{dir}", str(files)) for a in c.args]
    code, stdout, stderr, exc = run(args)
    assert "Traceback" not in stdout + stderr
    assert exc is None or isinstance(exc, SystemExit), f"{type(exc).__name__}: {exc}"
    assert code == 2, f"exit {code}; stdout {stdout[:300]!r}; stderr {stderr[:300]!r}"
    assert stdout.strip() == "", f"stdout should be empty, got {stdout[:300]!r}"
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}: {stderr[:600]!r}"
    line = lines[0]
    assert line.startswith("error: "), line
    assert not any(raw in line for raw in RAW_DUMPS), f"raw pydantic message: {line!r}"
    assert c.field.lower() in line.lower(), f"{c.field!r} not named in {line!r}"


def test_catalogue_is_large_and_distinct() -> None:
    assert len(CASES) >= 40
    assert len({c.id for c in CASES}) == len(CASES)
    assert len({c.args for c in CASES}) == len(CASES)
    assert set(KNOWN_FAILURES) <= {c.id for c in CASES}


def test_the_big_file_is_not_read_into_memory(files: Path) -> None:
    """The 50 MB file is refused by its size before it is read (the loader caps reads at 1 MB)."""
    assert (files / BIG_FILE).stat().st_size == BIG_SIZE
    code, _out, err, _exc = run(["estimate", "-m", str(files / BIG_FILE)])
    assert code == 2
    assert str(BIG_SIZE) in err


def test_an_unknown_replay_policy_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """``MEMPLAN_JIT`` (memplan.reserved: 0, 1 or auto) is read before the search: one line, exit 2."""
    monkeypatch.setenv("MEMPLAN_JIT", "fast")
    code, stdout, stderr, exc = run(["fit", "-m", "gpt2", "--seq", "1024", "--gpu", "h100", "--gpus", "8"])
    assert exc is None or isinstance(exc, SystemExit)
    assert code == 2 and stdout == ""
    assert stderr.strip().splitlines() == [
        "error: MEMPLAN_JIT: must be 0, 1 or auto, got 'fast'; e.g. MEMPLAN_JIT=1 to replay compiled (numba)"
    ]
