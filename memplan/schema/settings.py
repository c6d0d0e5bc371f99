"""``estimate --json``'s ``setup``: every setting of ``Setup.settings``, typed from the config field it comes
from, so a new option's setting is in the schema without a line here.

Known limitations: the settings written as text (checkpointing, offload, loss) are checked by a pattern,
not parsed.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, get_args

from pydantic.fields import FieldInfo

from memplan.config import Device, ImplConfig, Parallel, StrategyConfig, TrainingConfig, ZeroStage
from memplan.config.finetune import Method
from memplan.config.setup import json_value
from memplan.schema.parts import COUNT, obj


def _setting(field: FieldInfo) -> dict[str, Any]:
    """The schema of one setting, from its config field: what ``Setup.settings`` writes for it."""
    kind = field.annotation
    if kind is bool:
        return {"type": "boolean"}
    if kind == bool | None:  # a tri-state switch (``--clip-grad``): null when neither flag is given
        return {"type": ["boolean", "null"]}
    if isinstance(kind, type) and issubclass(kind, Enum):
        values = [json_value(member) for member in kind]
        return {"type": "integer" if kind is ZeroStage else "string", "enum": values}
    members = [k for k in get_args(kind) if k is not type(None)]
    if len(members) == 1 and isinstance(members[0], type) and issubclass(members[0], Enum):
        # An optional choice (``--optimizer-impl``): one of its values, or null when not given. Typed by
        # its values, never as an array (the bug that failed every output given --optimizer-impl).
        values = [json_value(member) for member in members[0]]
        return {"type": ["string", "null"], "enum": [*values, None]}
    if kind == int | None:  # an optional number (``--cp-rank``): null when not given
        return {"type": ["integer", "null"], **_minimum(field)}
    if kind is not int:  # a list of whole numbers or nothing (pipeline stages' layers; with --vpp a
        # virtual stage of the embedding or head alone holds 0: Parallel.pp_layers)
        return {"type": ["array", "null"], "items": COUNT}
    return {"type": "integer", **_minimum(field)}


def _minimum(field: FieldInfo) -> dict[str, int]:
    """The field's lower bound (``gt`` or ``ge``) as the schema's ``minimum``; none without one."""
    for m in field.metadata:
        if getattr(m, "gt", None) is not None:
            return {"minimum": m.gt + 1}
        if getattr(m, "ge", None) is not None:
            return {"minimum": m.ge}
    return {}


def setup_schema() -> dict[str, Any]:
    """``setup``: every setting of ``Setup.settings``, typed from the config fields it comes from."""
    fields = {
        **TrainingConfig.model_fields,
        **StrategyConfig.model_fields,
        **Parallel.model_fields,
        **ImplConfig.model_fields,
    }
    del fields["checkpoint_every"]
    properties = {name: _setting(field) for name, field in fields.items()}
    properties["checkpointing"] = {"type": "string", "pattern": "^(none|selective|full|every-[1-9][0-9]*)$"}
    properties["device"] = {"type": "string", "enum": [d.value for d in Device]}
    offload = "(none|optimizer|params|activations)(,(optimizer|params|activations))*"
    properties["offload"] = {"type": "string", "pattern": f"^{offload}$"}
    properties["loss"] = {"type": "string", "pattern": "^(standard|xentropy|te|fused|chunked:[1-9][0-9]*)$"}
    properties["finetune"] = {"type": "string", "enum": [m.name.lower() for m in Method]}
    return obj(properties, required=[])
