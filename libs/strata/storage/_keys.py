"""The key check both backends apply before any I/O: `check_key`, and no control characters."""

from __future__ import annotations

from strata.errors import ValidationError
from strata.storage.base import check_key


def valid_key(key: str) -> str:
    """`key` if it is allowed as a storage key, else `ValidationError`."""
    check_key(key)
    # The id pattern ends in `$`, which also matches before a trailing newline; control
    # characters never belong in a file name or an object key.
    if any(ord(char) < 0x20 or char == "\x7f" for char in key):
        raise ValidationError(f"storage key {key!r} contains control characters", field="key")
    return key
