"""nats-py 2.16's flush defect, reproduced against a real nats-server, and the registry's intake
client that survives it (see docs/operations.md, known issues).

`flush(timeout)` that times out cancels its PONG future but leaves it queued; when the PONG
comes late, nats-py sets the result of the cancelled future, InvalidStateError ends the read
loop, and the client still says it is connected (and `flush()` then returns at once)."""

from __future__ import annotations

import nats
import nats.errors
import pytest
from nats.aio.client import Client
from nats.aio.client import __version__ as nats_version
from strata.bus.server import NatsServer
from strata.services.registry.intake import IntakeClient

from tests.faults.conftest import pause, resume
from tests.support import async_wait_until

pytestmark = pytest.mark.nats


async def _flush_past_a_pause(server: NatsServer, nc: Client) -> None:
    """A flush that times out while the server is stopped; the server resumed after it."""
    pid = server.pid
    assert pid is not None
    pause(pid)
    try:
        with pytest.raises(nats.errors.TimeoutError):
            await nc.flush(timeout=1)
    finally:
        resume(pid)


@pytest.mark.skipif(not nats_version.startswith("2.16."), reason="the defect of nats-py 2.16")
async def test_a_late_pong_ends_the_read_loop_of_nats_py(own_nats_server: NatsServer) -> None:
    nc = await nats.connect(own_nats_server.url, allow_reconnect=False)
    try:
        await _flush_past_a_pause(own_nats_server, nc)

        async def reader_died() -> bool:
            task = nc._reading_task
            return task is not None and task.done()

        await async_wait_until(reader_died, 10, "the late PONG to reach the client")
        assert nc.is_connected  # and yet it hears nothing
    finally:
        await nc.close()


async def test_the_intake_client_keeps_reading_after_a_late_pong(
    own_nats_server: NatsServer,
) -> None:
    nc = IntakeClient()
    await nc.connect(own_nats_server.url, allow_reconnect=False)
    received: list[bytes] = []
    try:
        await nc.subscribe_direct(
            "faults.flush", lambda _subject, _reply, data: received.append(data)
        )
        await _flush_past_a_pause(own_nats_server, nc)
        publisher = await nats.connect(own_nats_server.url)
        try:

            async def heard() -> bool:
                await publisher.publish("faults.flush", b"after")
                return b"after" in received

            await async_wait_until(heard, 10, "a message after the late PONG")
        finally:
            await publisher.close()
        assert nc.reader_alive
    finally:
        await nc.close()
