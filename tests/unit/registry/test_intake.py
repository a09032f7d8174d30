"""The registry's heartbeat intake reads the NATS protocol as nats-py does: whatever way the bytes
are split over reads, every message of a direct subscription reaches its handler once, in order,
and everything else (PINGs, other subscriptions' messages) still reaches nats-py."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st
from nats.aio.subscription import Subscription
from strata.bus.intake import FRAMES_PER_TURN
from strata.services.registry.intake import FAST_LANE, IntakeClient

HEARTBEATS_SID = 1
OTHER_SID = 2


class Recording(IntakeClient):
    def __init__(self) -> None:
        super().__init__()
        self.pings = 0
        self.taken: list[tuple[bytes, bytes]] = []
        self.direct[HEARTBEATS_SID] = self.take
        self.other = Subscription(self, OTHER_SID, "other", pending_msgs_limit=100)
        self._subs[OTHER_SID] = self.other

    def take(self, subject: bytes, reply: bytes, payload: bytes) -> None:
        if payload == b"boom":
            raise ValueError("a handler that fails on one message")
        self.taken.append((subject, payload))

    async def _process_ping(self) -> None:
        self.pings += 1


def msg(subject: str, sid: int, payload: bytes, header: bytes = b"") -> bytes:
    if not header:
        return f"MSG {subject} {sid} {len(payload)}\r\n".encode() + payload + b"\r\n"
    head = f"HMSG {subject} {sid} {len(header)} {len(header) + len(payload)}\r\n".encode()
    return head + header + payload + b"\r\n"


HEADER = b"NATS/1.0\r\nNats-Msg-Id: abc\r\n\r\n"
STREAM = [
    msg("strata.hb.0a.j.w1", HEARTBEATS_SID, b"one", HEADER),
    msg("strata.hb.0a.j.w2", HEARTBEATS_SID, b"two \r\n with a line break"),
    b"PING\r\n",
    msg("strata.hb.1f.j.w3", HEARTBEATS_SID, b"boom", HEADER),
    msg("other", OTHER_SID, b"not a heartbeat", HEADER),
    msg("strata.hb.1f.j.w3", HEARTBEATS_SID, b"", HEADER),
    msg("strata.hb.33.j.w4", HEARTBEATS_SID, b"four", HEADER),
]
EXPECTED = [
    (b"strata.hb.0a.j.w1", b"one"),
    (b"strata.hb.0a.j.w2", b"two \r\n with a line break"),
    (b"strata.hb.1f.j.w3", b""),
    (b"strata.hb.33.j.w4", b"four"),
]


async def feed(client: Recording, data: bytes, cuts: list[int]) -> None:
    start = 0
    for cut in [*sorted(set(cuts)), len(data)]:
        await client._ps.parse(data[start:cut])
        start = cut


@given(
    cuts=st.lists(st.integers(0, len("".join(m.decode() for m in STREAM)))),
    frames_per_turn=st.sampled_from([1, 2, 3, FRAMES_PER_TURN]),
)
def test_every_message_is_read_once_in_order_however_the_reads_split_it(
    cuts: list[int], frames_per_turn: int
) -> None:
    client = Recording()
    client._ps.frames_per_turn = frames_per_turn
    asyncio.run(feed(client, b"".join(STREAM), cuts))
    assert client.taken == EXPECTED
    assert client.pings == 1
    assert client.handler_errors == 1
    assert client.other.pending_msgs == 1
    assert client.stats["in_msgs"] == 6
    assert client._ps.buf == bytearray()


def test_a_malformed_frame_is_refused_as_nats_py_refuses_it() -> None:
    from nats.errors import ProtocolError

    client = Recording()
    with pytest.raises(ProtocolError):
        asyncio.run(client._ps.parse(msg("a", HEARTBEATS_SID, b"x") + b"HMSG a 1 x y\r\n"))
    assert client.taken == [(b"a", b"x")]


def test_the_installed_nats_py_is_a_release_the_fast_lane_is_written_for() -> None:
    """On another release the intake falls back to a plain subscription, correct but slower: an
    upgrade of nats-py must come with a look at `strata.bus.intake.DirectParser` (and this
    release list)."""
    assert FAST_LANE
