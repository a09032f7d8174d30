"""Event ids: deterministic, so that a decision made again (after a crash, a retry, a restart)
gets the id it had the first time and JetStream drops the second copy as a duplicate."""

from __future__ import annotations

import hashlib
import uuid
from typing import Final

_IDS: Final = uuid.UUID("6d0e2a4c-29a8-4a43-9a57-5bb4c0f1d3a1")
_PREFIX: Final = _IDS.bytes


def event_id(*parts: object) -> str:
    """A deterministic event id, so a decision re-made after a crash is dropped as a duplicate.

    The hex of `uuid.uuid5(_IDS, "|".join(parts))`, computed without building the UUID: a job
    start decides thousands of these at once.
    """
    digest = bytearray(
        hashlib.sha1(_PREFIX + "|".join(str(p) for p in parts).encode()).digest()[:16]
    )
    digest[6] = (digest[6] & 0x0F) | 0x50  # version 5
    digest[8] = (digest[8] & 0x3F) | 0x80  # RFC 4122 variant
    return digest.hex()
