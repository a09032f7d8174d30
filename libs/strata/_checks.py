"""Argument checks of the SDK's public calls: a `ValidationError` naming the argument, before
anything is sent."""

from __future__ import annotations

import operator
import re

from strata.errors import ValidationError
from strata.events import ID_PATTERN

_ID = re.compile(ID_PATTERN)


def is_id(value: object) -> bool:
    return isinstance(value, str) and _ID.match(value) is not None


def check_id(what: str, value: object, hint: str = "") -> str:
    """`value` if it is a valid id (worker, job, dataset)."""
    if not isinstance(value, str) or not is_id(value):
        raise ValidationError(
            f"{what} {value!r} is not a valid id: use 1 to 128 letters, digits, '_', '.' or '-', "
            f"starting with a letter or digit{f' ({hint})' if hint else ''}",
            field=what,
        )
    return value


def check_int(what: str, value: object, low: int, high: int) -> int:
    """`value` as an int if it is an integer (numpy's too, never a bool) in [low, high]."""
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(value)  # type: ignore[arg-type]  # TypeError is the check
    except TypeError:
        raise ValidationError(
            f"{what} must be an integer, got {type(value).__name__} {value!r}", field=what
        ) from None
    if not low <= number <= high:
        raise ValidationError(f"{what} must be between {low} and {high}, got {value!r}", field=what)
    return int(number)
