"""``fit`` over models whose code refuses part of the space it searches: the refused families are not
searched (``search.methods.valid``: the ``Setup`` rules and the implementation's profile), and the search
starts from an attention kernel the model's code runs (``cli.search._fit_base``).

Found by running ``memplan fit`` on every model preset: ``fit -m deepseek-v2-lite --gpus 16`` stopped with
"ep: --ep with deepseek_v2's MLA and dense first layers is not modelled; drop --ep" (an option the user had
not given: transformers' DeepSeek code refuses tp, pp, cp and ep in its profile, which the validity check
did not ask), and ``fit -m gemma-2-2b`` stopped with "use --attention eager" even when given
``--attention eager`` (the search's base setup was built with flash attention whatever was searched)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from memplan.api import build_setup
from memplan.blocks.profiles import profile_of
from memplan.cli.app import app
from memplan.config import Attention, AttentionChoice, Impl, ImplConfig, Parallel
from memplan.search.methods import valid

runner = CliRunner(env={"COLUMNS": "120", "NO_COLOR": "1"})
SMALL = ["--seq", "1024", "--gpus", "8", "--gpu", "h100-sxm", "--micro-batches", "1", "--zero", "3"]


def _fit(model: str, *extra: str) -> dict:  # type: ignore[type-arg]
    r = runner.invoke(app, ["fit", "-m", model, *SMALL, *extra, "--json", "--top", "0"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)  # type: ignore[no-any-return]


def test_valid_asks_the_implementations_profile() -> None:
    """transformers' DeepSeek code refuses ep (its profile raises it); the ``Setup`` rules alone do not."""
    setup = build_setup(
        "deepseek-v2-lite", seq=1024, dp=2, attention=AttentionChoice.EAGER, impl=ImplConfig(impl=Impl.HF)
    )
    assert valid(setup)
    refused = setup.model_copy(update={"parallel": Parallel(ep=2)})
    with pytest.raises(ValueError, match="ep: --ep with deepseek_v2"):
        profile_of(refused)
    assert not valid(refused)


def test_fit_skips_the_layouts_deepseeks_code_refuses() -> None:
    """On 8 GPUs the space holds ep 2, 4 and 8 (DeepSeek-V2-Lite's 64 experts) and tp, pp and cp; the
    search lists and rejects only what transformers' DeepSeek code runs: data parallelism, eager
    attention (its MLA runs torch's memory-efficient kernel on CUDA, not modelled)."""
    doc = _fit("deepseek-v2-lite", "--checkpointing", "none,full")
    families = [c["settings"] for c in doc["configs"]] + doc["rejected"]
    assert families
    for s in families:
        assert (s["tp"], s["pp"], s["cp"], s["ep"], s["attention"]) == (1, 1, 1, 1, "eager"), s


@pytest.mark.parametrize("model", ["gemma-2-2b", "gpt-oss-20b"])
def test_fit_of_an_eager_only_model(model: str) -> None:
    """Gemma-2's softcaps and gpt-oss's sinks have no SDPA path in transformers: by default (eager and
    flash searched) and with ``--attention eager`` the search runs and lists eager rows only; with
    ``--attention flash`` alone it stops with the rule's one line, exit 2."""
    for extra in ((), ("--attention", "eager")):
        doc = _fit(model, "--checkpointing", "full", *extra)
        assert doc["configs"] and {c["settings"]["attention"] for c in doc["configs"]} == {"eager"}
    r = runner.invoke(app, ["fit", "-m", model, *SMALL, "--attention", "flash"])
    lines = r.output.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: attention:"), r.output


def test_fit_of_no_attention_kernel_the_model_runs_is_one_line() -> None:
    """The API's ``fit`` with a space of flash alone for Gemma-2: one line naming why
    (``fit.runnable_attention``)."""
    from memplan.presets import load_gpu
    from memplan.search.fit import Space, fit

    base = build_setup("gemma-2-2b", seq=1024, attention=AttentionChoice.EAGER, impl=ImplConfig(impl=Impl.HF))
    with pytest.raises(
        ValueError, match=r"^attention: gemma-2-2b runs none of flash \(transformers has no SDPA"
    ):
        fit(base, load_gpu("h100-sxm"), 8, space=Space(attention=(Attention.FLASH,)))
