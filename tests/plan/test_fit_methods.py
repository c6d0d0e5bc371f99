"""``fit`` over training methods and memory savers (memplan/search/methods.py), against published claims.

Independent sources: the model-state arithmetic of ZeRO (Rajbhandari et al. 2019 §3: mixed-precision
Adam holds 16 bytes per parameter), the QLoRA paper's claim (Dettmers et al. 2023, abstract: a 65B model
fine-tuned on a single 48 GB GPU, NF4 with double quantisation, LoRA on every linear, paged 8-bit AdamW,
gradient checkpointing) and ZeRO-Offload's (Ren et al. 2021, abstract: "train models with over 13 billion
parameters on a single GPU", a 32 GB V100 of a DGX-2 with 1.5 TB of host memory).
"""

from __future__ import annotations

import json

import jsonschema  # type: ignore[import-untyped]  # (no stubs installed)
import pytest
from typer.testing import CliRunner

from memplan.api import build_setup
from memplan.cli.app import app
from memplan.config import DType, Method, Optimizer, Precision, finetune_from
from memplan.presets import load_gpu, load_model_preset
from memplan.schema import command_schema
from memplan.search.fit import Space, fit
from memplan.search.methods import SAVERS, finetunes, parse_methods

H100 = load_gpu("h100-sxm")
GiB = 1 << 30


def test_70b_on_8_h100s_fits_by_offload_lora_and_qlora() -> None:
    """Full training of 70.55 B parameters holds 16 bytes each in states (1.13 TB) against 8 × 80 GB: it
    cannot fit without offload; with ZeRO-Offload, LoRA or QLoRA it does, each at a peak under the
    usable memory."""
    preset = load_model_preset("70b")
    assert 16 * preset.published_params > 8 * H100.memory_bytes  # needs a saver
    base = build_setup(preset.model, seq=8192)
    tunes, _ = finetunes(Method.FULL, (Method.FULL, Method.LORA, Method.QLORA), {}, False, base)
    r = fit(base, H100, 8, finetunes=tunes, max_seq=False)
    by_method = {o.finetune.method: o.best for o in r.methods}
    assert set(by_method) == {Method.FULL, Method.LORA, Method.QLORA}
    full, lora, qlora = by_method[Method.FULL], by_method[Method.LORA], by_method[Method.QLORA]
    assert full is not None and lora is not None and qlora is not None
    assert full.family.saver >= 2  # the optimizer states leave the device (ZeRO-Offload)
    assert lora.family.saver == 0 and qlora.family.saver == 0
    for best in (full, lora, qlora):
        assert best.verdict.peak <= r.usable
        assert best.result.device.peak.bytes == best.verdict.peak
    assert not any(c.family.finetune.method is Method.FULL and c.family.saver < 2 for c in r.fitting)
    # peft's count for r = 8 on q, v: 80 layers × r·(h + h) for q plus r·(h + kv·d) for v
    assert lora.result.params_trainable == 80 * 8 * ((8192 + 8192) + (8192 + 1024))


def test_default_search_stops_at_the_first_method_that_fits_plainly() -> None:
    """Without --method: the named method first; LoRA and QLoRA only when it needs savers."""
    base = build_setup(load_model_preset("gpt2").model, seq=1024)
    tunes, escalate = finetunes(Method.FULL, None, {}, False, base)
    assert escalate and [t.method for t in tunes] == [Method.FULL, Method.LORA, Method.QLORA]
    r = fit(base, H100, 1, finetunes=tunes, escalate=escalate, max_seq=False)
    assert [o.finetune.method for o in r.methods] == [Method.FULL]
    assert r.best is not None and r.best.family.saver == 0


def test_qlora_fine_tunes_65b_on_one_48gb_gpu() -> None:
    """QLoRA's headline: LLaMA-65B on one 48 GB GPU (r = 64, every linear, NF4 + double quant, paged 8-bit
    AdamW, checkpointing); full training and 16-bit LoRA do not fit there (no host memory given: offload
    is not searched)."""
    gpu = load_gpu("l40s").model_copy(update={"memory_bytes": 48 * 10**9, "host_memory_gib": None})
    base = build_setup(load_model_preset("65b").model, seq=512, optimizer=Optimizer.ADAMW_8BIT)
    given = {"lora_rank": 64, "lora_targets": "all-linear"}
    tunes, _ = finetunes(Method.FULL, (Method.FULL, Method.LORA, Method.QLORA), given, True, base)
    r = fit(base, gpu, 1, finetunes=tunes, global_batch=16, max_seq=False, reserve=0)
    by_method = {o.finetune.method: o.best for o in r.methods}
    assert by_method[Method.FULL] is None and by_method[Method.LORA] is None
    q = by_method[Method.QLORA]
    assert q is not None and q.family.saver == 0 and q.verdict.peak <= 48 * 10**9
    assert q.result.setup.finetune.double_quant


def test_zero_offload_trains_13b_on_one_32gb_gpu() -> None:
    """ZeRO-Offload's claim: a 13B model (fp16 mixed precision, Adam) on one 32 GB V100 with the
    optimizer on a 1.5 TB host; without offload 16 bytes × 13 B = 208 GB of states cannot fit."""
    v100 = H100.model_copy(update={"memory_bytes": 32 * GiB, "host_memory_gib": 1536.0})
    preset = load_model_preset("13b")
    assert 16 * preset.published_params > v100.memory_bytes
    base = build_setup(preset.model, seq=1024, precision=Precision.FP16_MIXED)
    space = Space(checkpointing=Space().checkpointing, micro_batches=(1, 2, 4))
    r = fit(base, v100, 1, space=space, global_batch=8, max_seq=False, reserve=0)
    assert r.best is not None and r.best.family.saver >= 2
    assert r.best.result.setup.offload is SAVERS[r.best.family.saver].offload


def test_host_memory_bounds_offload() -> None:
    """A node whose host cannot hold the offloaded 12 bytes per parameter (ZeRO-Offload's fp32 master
    and Adam states) does not fit that way."""
    v100 = H100.model_copy(update={"memory_bytes": 32 * GiB, "host_memory_gib": 64.0})
    base = build_setup(load_model_preset("13b").model, seq=1024, precision=Precision.FP16_MIXED)
    r = fit(base, v100, 1, global_batch=8, max_seq=False, reserve=0)
    assert r.best is None or r.best.family.saver == 0


def test_parse_methods() -> None:
    assert parse_methods(None) is None
    assert parse_methods("qlora, full") == (Method.FULL, Method.QLORA)
    for bad in ("", "lora,bogus", ","):
        with pytest.raises(ValueError, match=r"^method: "):
            parse_methods(bad)


def test_each_method_takes_only_its_options() -> None:
    base = build_setup(load_model_preset("7b").model, seq=512)
    given = {"lora_rank": 16, "quant": None, "freeze": None}
    tunes, _ = finetunes(Method.FULL, (Method.FULL, Method.QLORA), given, True, base)
    assert tunes[0] == finetune_from(Method.FULL, {}, False, DType.BF16)
    assert tunes[1].rank == 16 and tunes[1].double_quant


def test_cli_fit_method_json() -> None:
    runner = CliRunner()
    args = ["fit", "--model", "70b", "--seq", "8192", "--gpu", "h100-sxm", "--gpus", "8", "--json"]
    out = runner.invoke(app, [*args, "--method", "lora,qlora", "--top", "3"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    assert [m["method"] for m in data["methods"]] == ["lora", "qlora"]
    assert all(m["fits"] and m["peak"] <= 80 * 10**9 for m in data["methods"])
    bad = runner.invoke(app, [*args, "--method", "lora,nope"])
    assert bad.exit_code == 2 and "method: unknown method 'nope'" in bad.output


def test_a_method_that_fits_nothing_says_which_savers_were_searched() -> None:
    """Llama 3 70B fits no RTX 4090 by itself. Full training is searched without savers and with the fused
    loss only: the preset states no host memory, so offload's levels are not judged; LoRA without savers
    and with the fused loss (``check_finetune``: no offload; Liger's loss follows its frozen head). Neither
    is "even with every saver" (what both said before); ``--json`` lists the savers searched."""
    runner = CliRunner(env={"COLUMNS": "200", "NO_COLOR": "1"})
    args = ["fit", "-m", "70b", "--gpus", "1", "--gpu", "rtx-4090", "--method", "full,lora"]
    assert load_gpu("rtx-4090").host_memory_gib is None
    data = json.loads(runner.invoke(app, [*args, "--json"]).output)
    assert [(m["method"], m["fits"], m["savers_searched"]) for m in data["methods"]] == [
        ("full", False, [SAVERS[0].label(), SAVERS[1].label()]),
        ("lora", False, [SAVERS[0].label(), SAVERS[1].label()]),
    ]
    text = runner.invoke(app, args).stdout
    assert "even with every saver" not in text
    assert (
        "full: does not fit, with fused loss (offload needs the node's host memory: this GPU preset " in text
    )
    assert "lora: does not fit, with fused loss (memplan models lora without offload)" in text


def test_a_method_memplan_does_not_model_for_the_model_is_named_not_searched() -> None:
    """Mixtral with QLoRA, or with adapters on its experts, is refused by ``check_finetune``. ``fit``
    searched such a method anyway and found nothing: it printed "searched 0 configurations … nothing fits:
    see the rejected families below" over no family, exit 0; by default the method was dropped from the
    summary without a word. Now: every asked method refused is a one-line error (exit 2); a method
    refused beside one that runs is listed as not searched, with the reason (``--json`` too). LoRA on
    Mixtral's attention is modelled, and searched."""
    runner = CliRunner(env={"COLUMNS": "200", "NO_COLOR": "1"})
    args = ["fit", "-m", "mixtral-8x7b", "--seq", "4096", "--gpus", "2", "--gpu", "a100", "--top", "1"]
    for asked in (["--finetune", "qlora"], ["--method", "lora,qlora", "--lora-targets", "all-linear"]):
        bad = runner.invoke(app, [*args, *asked])
        assert bad.exit_code == 2 and "Traceback" not in bad.output
        assert bad.output.startswith("error: method: ") and "mixture of experts" in bad.output
        assert len(bad.output.strip().splitlines()) == 1
    every = [*args, "--method", "full,lora,qlora"]
    data = json.loads(runner.invoke(app, [*every, "--json"]).output)
    jsonschema.validate(data, command_schema("fit"))
    methods = {m["method"]: m for m in data["methods"]}
    assert methods["full"]["fits"] and methods["full"]["not_searched"] is None
    assert methods["lora"]["not_searched"] is None and methods["lora"]["savers_searched"]  # searched
    assert not methods["qlora"]["fits"] and "QLoRA" in methods["qlora"]["not_searched"]
    text = runner.invoke(app, every).stdout
    assert "qlora: not searched: fine-tuning or freezing with a mixture of experts (QLoRA:" in text
