"""Estimating a candidate of the verdict (``memplan.advice``): the estimate of a change of the user's
options, or the one line that refuses it (a rejected candidate is dropped, or named where no candidate of
its kind plans)."""

from __future__ import annotations

from pydantic import ValidationError

from memplan.api import Options, setup_of
from memplan.engine import Result, estimate
from memplan.errors import describe_validation_error


def planned(o: Options) -> Result | str:
    """The estimate of ``o``, or the one line that refuses it (``errors.describe_validation_error``)."""
    try:
        return estimate(setup_of(o))
    except ValidationError as exc:  # a ValueError: first
        return describe_validation_error(exc)
    except ValueError as exc:
        return str(exc)


def result(o: Options) -> Result | None:
    """The estimate of ``o``, or None when its settings cannot be planned."""
    got = planned(o)
    return None if isinstance(got, str) else got


def refusal(o: Options) -> str | None:
    """The one line that refuses ``o``, None if it plans."""
    got = planned(o)
    return got if isinstance(got, str) else None
