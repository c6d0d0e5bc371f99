"""``Frozen.replaced`` and ``unvalidated``: the fast copies and constructions ``fit``'s hot paths use make
the same objects pydantic's ``model_copy`` and validated construction make."""

from __future__ import annotations

import pydantic
import pytest

from memplan.api import AttentionChoice, build_setup
from memplan.blocks.inventory import Dims, Kept
from memplan.config import (
    Attention,
    Checkpointing,
    Frozen,
    Impl,
    ImplConfig,
    Method,
    Parallel,
    ZeroStage,
)
from memplan.config.finetune import FineTune
from memplan.engine import estimate
from memplan.presets import load_gpu
from memplan.time.predict import Prediction, unstaged
from memplan.time.timing import peak_flops, timing

H100 = load_gpu("h100-sxm")


def _same(a: pydantic.BaseModel, b: pydantic.BaseModel, hashable: bool = True) -> None:
    assert a == b
    assert type(a) is type(b)
    assert list(a.__dict__) == list(b.__dict__)  # field order: repr, dumps
    assert a.__pydantic_fields_set__ == b.__pydantic_fields_set__
    assert a.__pydantic_extra__ == b.__pydantic_extra__ and a.__pydantic_private__ == b.__pydantic_private__
    assert repr(a) == repr(b) and a.model_dump() == b.model_dump()
    assert a.model_dump_json() == b.model_dump_json()  # the types too: 0 and 0.0 dump apart
    if hashable:
        assert hash(a) == hash(b)


@pytest.mark.parametrize(
    "update",
    [
        {"micro_batch": 3, "grad_accum": 5},
        {},
    ],
)
def test_replaced_is_model_copy(update: dict[str, int]) -> None:
    t = build_setup("llama-3-8b", seq=2048).training
    _same(t.replaced(**update), t.model_copy(update=update))


def test_replaced_nested_setup_is_model_copy() -> None:
    setup = build_setup("llama-3-8b", seq=2048, zero=1, dp=8)
    strategy = {
        "zero": ZeroStage.PARAMETERS,
        "attention": Attention.EAGER,
        "checkpointing": Checkpointing.FULL,
    }
    parallel = Parallel(tp=2, sp=True)
    fast = setup.replaced(parallel=parallel, strategy=setup.strategy.replaced(**strategy))
    slow = setup.model_copy(
        update={"parallel": parallel, "strategy": setup.strategy.model_copy(update=strategy)}
    )
    _same(fast, slow)
    assert fast.strategy.zero is ZeroStage.PARAMETERS and setup.strategy.zero is ZeroStage.OPTIMIZER
    _same(fast.strategy, slow.strategy)


def test_every_config_model_has_no_private_attributes() -> None:
    """``replaced`` and ``unvalidated`` set ``__pydantic_private__`` to None: no model may declare any."""
    seen: set[type] = set()
    todo: list[type] = [Frozen, Kept, Dims]
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        assert not cls.__private_attributes__, cls
        todo.extend(cls.__subclasses__())
    assert len(seen) > 10


def test_dims_of_is_validated_dims() -> None:
    for setup in (
        build_setup("llama-3-8b", seq=4096, parallel=Parallel(cp=2)),
        build_setup(
            "deepseek-v2-lite", seq=4096, impl=ImplConfig(impl=Impl.HF), attention=AttentionChoice.EAGER
        ),
    ):
        fast = Dims.of(setup)
        assert set(fast.__dict__) == set(Dims.model_fields)
        _same(fast, Dims(**fast.__dict__))


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("llama-3-8b", {"seq": 4096, "dp": 8, "zero": 3, "parallel": Parallel(tp=2, sp=True, cp=2)}),
        ("llama-3.2-1b", {"seq": 2048, "dp": 4, "offload": "optimizer,activations"}),
        ("mixtral-8x7b", {"seq": 4096, "dp": 8, "parallel": Parallel(tp=2, ep=4, pp=4), "grad_accum": 8}),
        ("llama-3.2-1b", {"seq": 2048, "dp": 4, "finetune": FineTune(method=Method.QLORA)}),
    ],
)
def test_prediction_is_validated_prediction(name: str, options: dict[str, object]) -> None:
    """``time.predict.predict`` builds its ``Prediction`` unvalidated: the object validation makes of the
    same fields (floats where an int was given, the rows a tuple), alone and from a shared part."""
    r = estimate(build_setup(name, **options))  # type: ignore[arg-type]
    for shared in (None, unstaged(r, H100, peak_flops(H100, r.setup.training.precision))):
        fast = timing(r, H100, shared=shared).prediction
        assert set(fast.__dict__) == set(Prediction.model_fields)
        _same(fast, Prediction(**fast.__dict__), hashable=False)
