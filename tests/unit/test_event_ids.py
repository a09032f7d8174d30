"""Event ids are uuid5 of their parts: the fast computation must give exactly the ids stored
before it (a decision re-made after an upgrade must still be dropped as a duplicate)."""

from __future__ import annotations

import uuid

from hypothesis import given
from hypothesis import strategies as st
from strata.events.ids import event_id

NAMESPACE = uuid.UUID("6d0e2a4c-29a8-4a43-9a57-5bb4c0f1d3a1")

_part = st.one_of(st.text(), st.integers(), st.floats(allow_nan=False), st.none(), st.booleans())


@given(st.lists(_part, max_size=6))
def test_an_event_id_is_the_uuid5_of_its_parts(parts: list[object]) -> None:
    assert event_id(*parts) == uuid.uuid5(NAMESPACE, "|".join(str(p) for p in parts)).hex


def test_a_stored_id_is_unchanged() -> None:
    assert event_id("registered", "job", "w", "p", 1) == "20922f057e1c5ef9b685781bd879cd5a"
