"""The gateway's HTTP edge under clients that never finish a request: a bounded number of
connections, each given a bounded time to send its headers, and an authenticated request that
still answers; and a 4xx, never a 500, for every parameter out of range."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from strata.bus import Bus
from strata.config import load_settings
from strata.services.gateway.service import Gateway

pytestmark = pytest.mark.nats

TOKEN = "edge-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
HALF_REQUEST = b"GET /api/jobs HTTP/1.1\r\nHost: gateway\r\n"
"""A request line and one header, and never the blank line that ends the headers."""


@contextlib.asynccontextmanager
async def gateway_of(bus: Bus, nats_url: str, **settings: Any) -> AsyncIterator[Gateway]:
    gateway = Gateway(host="127.0.0.1", api_token=TOKEN)
    await gateway.start(bus, load_settings(nats_url=nats_url, http_port=0, **settings))
    try:
        yield gateway
    finally:
        await gateway.stop()


def held(gateway: Gateway) -> int:
    """The connections uvicorn holds open."""
    assert gateway._server is not None
    return len(gateway._server.server_state.connections)


async def closed_by_peer(reader: asyncio.StreamReader) -> bool:
    """Whether the gateway has closed this connection (it reads as an end of stream)."""
    try:
        return await asyncio.wait_for(reader.read(1024), 0.01) == b""
    except TimeoutError:
        return False
    except ConnectionError:
        return True


async def test_half_sent_requests_do_not_keep_an_authenticated_request_out(
    bus: Bus, nats_url: str
) -> None:
    bound = 64
    async with gateway_of(
        bus, nats_url, gateway_max_connections=bound, gateway_header_timeout=600
    ) as gateway:
        sockets = []
        try:
            for _ in range(bound * 5):
                reader, writer = await asyncio.open_connection("127.0.0.1", gateway.port)
                writer.write(HALF_REQUEST)
                await writer.drain()
                sockets.append((reader, writer))
            async with httpx.AsyncClient(
                base_url=f"http://127.0.0.1:{gateway.port}", timeout=30
            ) as http:
                answer = await http.get("/api/jobs", headers=AUTH)
            assert answer.status_code == 200
            assert "jobs" in answer.json()
            # The gateway holds no more than its bound: the oldest half-sent ones were closed.
            assert held(gateway) <= bound
            deadline = time.monotonic() + 30
            while True:
                closed = sum([await closed_by_peer(reader) for reader, _ in sockets])
                if closed >= len(sockets) - bound or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.1)
            assert closed >= len(sockets) - bound
        finally:
            for _, writer in sockets:
                writer.close()


async def test_a_connection_that_does_not_finish_its_headers_is_closed(
    bus: Bus, nats_url: str
) -> None:
    async with gateway_of(bus, nats_url, gateway_header_timeout=1.0) as gateway:
        reader, writer = await asyncio.open_connection("127.0.0.1", gateway.port)
        # A whole request first: its answer comes, then the next request is left half sent.
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: gateway\r\n\r\n")
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
        assert head.startswith(b"HTTP/1.1 200")
        writer.write(HALF_REQUEST)
        await writer.drain()
        try:
            deadline = time.monotonic() + 30
            while not await closed_by_peer(reader):
                assert time.monotonic() < deadline, "a half-sent request kept its connection"
                await asyncio.sleep(0.1)
        finally:
            writer.close()
        # A slow but whole request is not cut: its headers arrived in time.
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{gateway.port}", timeout=30
        ) as http:
            assert (await http.get("/api/jobs", headers=AUTH)).status_code == 200


@pytest.mark.parametrize(
    ("path", "params"),
    [
        ("/api/jobs/edge-job/events", {"after_seq": "99999999999999999999"}),
        ("/api/jobs/edge-job/events", {"after_seq": "-1"}),
        ("/api/jobs/edge-job/events", {"limit": "0"}),
        ("/api/jobs/edge-job/events", {"limit": "1e9"}),
        ("/api/replay", {"job": "edge-job", "seq": "99999999999999999999"}),
        ("/api/replay", {"job": "edge-job", "at": "99999999999999999999"}),
        ("/api/replay", {"job": "edge-job", "seq": "1", "at": "1"}),
        ("/api/jobs/edge-job/metrics", {"until_ns": "99999999999999999999"}),
        ("/api/jobs/edge-job/workers", {"offset": "99999999999999999999"}),
        ("/api/jobs/edge-job/workers", {"status": "x" * 10_000}),
        ("/api/dashboard", {"job": "not a job"}),
    ],
)
async def test_a_parameter_out_of_range_is_a_4xx(
    bus: Bus, nats_url: str, path: str, params: dict[str, str]
) -> None:
    async with (
        gateway_of(bus, nats_url) as gateway,
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{gateway.port}", timeout=30) as http,
    ):
        answer = await http.get(path, params=params, headers=AUTH)
    assert 400 <= answer.status_code < 500, (answer.status_code, answer.text[:500])
