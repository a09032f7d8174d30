"""The request intake (`strata.bus.intake`) reads the NATS protocol as nats-py does: whatever way
the bytes are split over reads, every request of a direct subscription reaches its handler once,
in order, with its reply subject, and everything else (PINGs, other subscriptions' messages)
still reaches nats-py."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st
from nats.aio.subscription import Subscription
from strata.bus.intake import FAST_LANE, FRAMES_PER_TURN, RequestIntakeClient

REQUESTS_SID = 1
OTHER_SID = 2


class Recording(RequestIntakeClient):
    def __init__(self) -> None:
        super().__init__()
        self.pings = 0
        self.reads = 0
        self.taken: list[tuple[bytes, bytes, bytes]] = []
        self.direct[REQUESTS_SID] = self.take
        self.after_read.append(self.read)
        self.other = Subscription(self, OTHER_SID, "other", pending_msgs_limit=100)
        self._subs[OTHER_SID] = self.other

    def take(self, subject: bytes, reply: bytes, payload: bytes) -> None:
        if payload == b"boom":
            raise ValueError("a handler that fails on one message")
        self.taken.append((subject, reply, payload))

    def read(self) -> None:
        self.reads += 1

    async def _process_ping(self) -> None:
        self.pings += 1


def msg(subject: str, sid: int, payload: bytes, reply: str = "", header: bytes = b"") -> bytes:
    to = f" {reply}" if reply else ""
    if not header:
        return f"MSG {subject} {sid}{to} {len(payload)}\r\n".encode() + payload + b"\r\n"
    sizes = f"{len(header)} {len(header) + len(payload)}"
    return f"HMSG {subject} {sid}{to} {sizes}\r\n".encode() + header + payload + b"\r\n"


HEADER = b"NATS/1.0\r\nX: y\r\n\r\n"
SUBJECT = "strata.rpcp.3.registry.members.j.w1"
STREAM = [
    msg(SUBJECT, REQUESTS_SID, b"one", "_INBOX_strata.j.w1.a"),
    msg(SUBJECT, REQUESTS_SID, b"two \r\n with a line break", "_INBOX_strata.j.w1.b", HEADER),
    b"PING\r\n",
    msg(SUBJECT, REQUESTS_SID, b"boom", "_INBOX_strata.j.w1.c"),
    msg("other", OTHER_SID, b"not a request", "_INBOX.x", HEADER),
    msg(SUBJECT, REQUESTS_SID, b"no reply"),
    msg(SUBJECT, REQUESTS_SID, b"", "_INBOX_strata.j.w1.d", HEADER),
]
EXPECTED = [
    (SUBJECT.encode(), b"_INBOX_strata.j.w1.a", b"one"),
    (SUBJECT.encode(), b"_INBOX_strata.j.w1.b", b"two \r\n with a line break"),
    (SUBJECT.encode(), b"", b"no reply"),
    (SUBJECT.encode(), b"_INBOX_strata.j.w1.d", b""),
]


async def feed(client: Recording, data: bytes, cuts: list[int]) -> None:
    start = 0
    for cut in [*sorted(set(cuts)), len(data)]:
        await client._ps.parse(data[start:cut])
        start = cut


@given(
    cuts=st.lists(st.integers(0, len(b"".join(STREAM)))),
    frames_per_turn=st.sampled_from([1, 2, 3, FRAMES_PER_TURN]),
)
def test_every_request_is_read_once_in_order_however_the_reads_split_it(
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
    # The handler's counts are settled after every read that handed a request out.
    assert 1 <= client.reads <= len(EXPECTED) + 1


def test_a_flood_gives_the_event_loop_a_turn_every_frames_per_turn_frames() -> None:
    """However many frames one read brings (or reads buffered back to back), another task runs
    after every `frames_per_turn` of them: a flood on one connection cannot hold the event loop
    while another connection's requests wait."""
    client = Recording()
    client._ps.frames_per_turn = 4
    flood = b"".join(msg(SUBJECT, REQUESTS_SID, b"%d" % i, "_INBOX.r") for i in range(10))
    turns: list[int] = []

    async def read_twice() -> None:
        async def other_connection() -> None:
            while True:
                turns.append(len(client.taken))
                await asyncio.sleep(0)

        other = asyncio.create_task(other_connection())
        await asyncio.sleep(0)
        await client._ps.parse(flood)  # 10 frames: a turn after the 4th and the 8th
        await client._ps.parse(flood)  # 20: after the 12th (the count goes on), 16th and 20th
        other.cancel()

    asyncio.run(read_twice())
    assert [payload for _, _, payload in client.taken] == [b"%d" % (i % 10) for i in range(20)]
    assert turns == [0, 4, 8, 12, 16, 20]


def test_a_malformed_frame_is_refused_as_nats_py_refuses_it() -> None:
    from nats.errors import ProtocolError

    client = Recording()
    with pytest.raises(ProtocolError):
        asyncio.run(client._ps.parse(msg("a", REQUESTS_SID, b"x", "r") + b"HMSG a 1 x y\r\n"))
    assert client.taken == [(b"a", b"r", b"x")]


def test_an_answer_is_not_queued_on_a_connection_that_is_not_up() -> None:
    assert not RequestIntakeClient().reply_now(b"_INBOX.x", b"answer")


def test_the_installed_nats_py_is_a_release_the_fast_lane_is_written_for() -> None:
    """On another release the intake falls back to a plain subscription, correct but slower: an
    upgrade of nats-py must come with a look at `DirectParser` (and this release list)."""
    assert FAST_LANE
