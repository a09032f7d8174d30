"""Event ids: deterministic, so that a decision made again (after a crash, a retry, a restart)
gets the id it had the first time and JetStream drops the second copy as a duplicate."""

from __future__ import annotations

import uuid
from typing import Final

_IDS: Final = uuid.UUID("6d0e2a4c-29a8-4a43-9a57-5bb4c0f1d3a1")


def event_id(*parts: object) -> str:
    """A deterministic event id, so a decision re-made after a crash is dropped as a duplicate."""
    return uuid.uuid5(_IDS, "|".join(str(p) for p in parts)).hex
