"""``--impl hf`` follows one family's transformers code, so a layout that code cannot run is refused
(``config.hf_rules.check_family_layout``, ``check_qk_norm``), never estimated as other code: the norm and
the MLP the family's decoder layer has, a parallel layer, a partial rotary and q/k norms only where its code
has them."""

from __future__ import annotations

from typing import Any

import pytest

from memplan.api import build_setup
from memplan.config import ImplConfig, ModelConfig
from memplan.presets import load_model_preset


def hf(**fields: Any) -> Any:
    m = load_model_preset("llama-3-8b").model
    model = ModelConfig.model_validate({**m.model_dump(), "num_layers": 2, **fields})
    return build_setup(model, seq=256, impl=ImplConfig(impl="hf"))


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"family": "granite", "norm": "layernorm"}, "norm: transformers' granite code has rmsnorm"),
        ({"family": "falcon", "parallel_residual": True}, "norm: transformers' falcon code has layernorm"),
        ({"family": "glm", "mlp": "gelu"}, "mlp: transformers' glm code has a swiglu MLP"),
        ({"parallel_residual": True}, "parallel_residual: transformers' llama code has none"),
        ({"family": "starcoder2", "norm": "layernorm", "mlp": "gelu", "rotary_pct": 0.5}, "rotary_pct: "),
        ({"family": "granite", "qk_norm": True}, "qk_norm: granite's code has no q_norm/k_norm"),
        (
            {"family": "cohere", "norm": "layernorm", "parallel_residual": True, "qk_norm": True},
            "qk_norm_whole",
        ),
    ],
)
def test_layout_the_family_code_cannot_run_is_refused(fields: dict[str, Any], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        hf(**fields)


def test_the_families_own_layouts_pass() -> None:
    hf(family="granite")
    hf(family="glm", rotary_pct=0.5)
    hf(family="stablelm", norm="layernorm", rotary_pct=0.25, parallel_residual=True, shared_norm=True)
