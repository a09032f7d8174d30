"""The SDK's heartbeats never wait behind the work of the process that sends them.

A sync worker's heartbeats run on the SDK's loop, in a thread of its own; whatever the training
code does on its own thread shares only the GIL with them. Work done on that loop instead (opening
S3 storage, which imports aioboto3) held every heartbeat for as long as the import took."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from nats.aio.msg import Msg
from strata.bus import Bus
from strata.bus.server import NatsServer
from strata.events import subjects

from tests.faults.conftest import Heartbeater, failed_workers, registry
from tests.support import new_job

pytestmark = [pytest.mark.nats, pytest.mark.slow]

INTERVAL = 0.5
SLOW_IMPORT_S = 4.0
"""How long the first import of aioboto3 computes first (a cold import on a loaded machine)."""


async def test_heartbeats_flow_while_the_main_thread_opens_s3_checkpoints(
    own_nats_server: NatsServer, tmp_path: Path
) -> None:
    url = own_nats_server.url
    job = new_job("busy-main")
    service = registry(url, tmp_path, interval=INTERVAL, timeout=3.0).start()
    try:
        async with await Bus.connect(url, deadline=10) as bus:
            arrivals: list[float] = []

            async def heard(_: Msg) -> None:
                arrivals.append(time.monotonic())

            # The heartbeats as the registry receives them, on the same subject.
            await bus.nc.subscribe(subjects.heartbeat_subject(job, "w0"), cb=heard)
            work = (f"slow-import:aioboto3:{SLOW_IMPORT_S}", "s3-checkpoints")
            worker = Heartbeater(job, url, "w0", work)
            try:
                worker.wait_line("registered")
                started = time.monotonic()
                await asyncio.to_thread(worker.wait_line, "done")
                ended = time.monotonic()
                assert ended - started >= SLOW_IMPORT_S  # the work did take that long
                during = [t for t in arrivals if started <= t <= ended]
                gaps = [b - a for a, b in zip([started, *during], [*during, ended], strict=True)]
                # Held behind the import, one gap would be the whole import (4 s or more).
                assert max(gaps) < SLOW_IMPORT_S / 2, f"heartbeat gaps {gaps}"
                assert await failed_workers(bus, job) == []
            finally:
                worker.stop()
    finally:
        service.stop()
