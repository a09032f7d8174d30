"""How a service process runs: settings, logs, NATS, streams, probes, and a clean stop on SIGTERM.

Every service implements `Service` and is started by `run` (from its `__main__` or from
`strata serve <name>`); the runtime owns everything that is the same for all of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import signal
from typing import Protocol

import nats.js.errors
import structlog
from strata.bus import Bus, strata_streams
from strata.bus.connection import retry_transient
from strata.config import Settings
from strata.logs import bind, configure_logging
from strata.services.health import HealthServer

log = structlog.get_logger("strata.service")

GC_THRESHOLDS = (20_000, 10, 10)
"""The collector's thresholds once a service is started (Python's default first one is 700: at
thousands of requests a second that is a collection every few requests)."""


class Service(Protocol):
    name: str
    provisions_streams: bool
    """False for a reader (the gateway): it waits for the streams instead of creating them."""

    async def start(self, bus: Bus, settings: Settings) -> None: ...

    async def stop(self) -> None: ...

    def ready(self) -> tuple[bool, str]: ...


async def wait_for_streams(bus: Bus, poll_s: float = 0.5) -> None:
    """Until the other services have created the streams (a reader may not create them)."""
    names = [spec.name for spec in strata_streams()]
    waited = 0.0
    while True:
        try:
            for name in names:
                await retry_transient(
                    functools.partial(bus.js.stream_info, name), f"reading stream {name}"
                )
            return
        except nats.js.errors.NotFoundError:
            if waited == 0.0:
                log.info("waiting_for_streams", streams=names)
        await asyncio.sleep(poll_s)
        waited += poll_s


async def serve(service: Service, settings: Settings, stop: asyncio.Event) -> None:
    """Run `service` until `stop` is set; probes answer from the start."""
    bind(service=service.name)
    bus: Bus | None = None

    def ready() -> tuple[bool, str]:
        if bus is None or not bus.nc.is_connected:
            return False, "not connected to NATS"
        return service.ready()

    health = await HealthServer(
        service.name, ready, host=settings.listen_host, port=settings.health_port
    ).start()
    log.info("service_starting", service=service.name, health_port=health.port)
    try:
        bus = await Bus.connect(settings=settings, name=f"strata-{service.name}")
        if service.provisions_streams:
            # Every service provisions at start: several at once, or during an election, may
            # see a JetStream request go unanswered.
            await retry_transient(
                functools.partial(bus.ensure_streams, settings.stream_replicas, settings),
                "provisioning the streams",
            )
        else:
            await wait_for_streams(bus)
        await service.start(bus, settings)
        # What is here now (the imports, the state rebuilt from the stream) lives as long as
        # the process: left to the collector, every full collection walks all of it again, and
        # a burst of requests (a job start) triggers several. The young generation is collected
        # less often too: a request's objects die by reference counting, not by the collector.
        gc.freeze()
        gc.set_threshold(*GC_THRESHOLDS)
        log.info("service_started", service=service.name, nats=settings.nats_url)
        await stop.wait()
        log.info("service_stopping", service=service.name)
        await service.stop()
    finally:
        if bus is not None:
            with contextlib.suppress(Exception):
                await bus.close()
        await health.stop()
    log.info("service_stopped", service=service.name)


def run(service: Service, settings: Settings) -> None:
    """Blocking entry point: runs until SIGTERM or SIGINT."""
    configure_logging(settings.log_format, settings.log_level)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(service, settings, stop)

    asyncio.run(main())
