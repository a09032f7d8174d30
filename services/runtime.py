"""How a service process runs: settings, logs, NATS, streams, probes, and a clean stop on SIGTERM.

Every service implements `Service` and is started by `run` (from its `__main__` or from
`strata serve <name>`); the runtime owns everything that is the same for all of them.

A service's background tasks are supervised (`Service.tasks`): the runtime waits on SIGTERM and on
them alike, whichever comes first. A task that dies of an exception nothing handles makes the
service unready at once (`/readyz` answers 503 with the task's name), is logged with its
traceback, and the process stops as it would on SIGTERM and then exits with `EXIT_TASK_FAILED`:
the orchestrator starts it again, and the new process rebuilds its state from the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import functools
import gc
import os
import signal
import threading
from collections.abc import Callable, Coroutine
from typing import Any, Final, Protocol

import nats.js.errors
import structlog
from strata._supervise import Supervisor
from strata.bus import Bus, strata_streams
from strata.bus.connection import retry_transient
from strata.config import Settings
from strata.errors import BackgroundTaskFailed
from strata.logs import bind, configure_logging
from strata.services.health import HealthServer

log = structlog.get_logger("strata.service")

GC_THRESHOLDS = (20_000, 10, 10)
"""The collector's thresholds once a service is started (Python's default first one is 700: at
thousands of requests a second that is a collection every few requests)."""

EXIT_TASK_FAILED: Final = 70
"""The exit status of a service whose background task died (EX_SOFTWARE)."""
EXIT_STOP_STUCK: Final = 1
"""The exit status of a service stopped by SIGTERM that did not finish stopping in time."""
STOP_TIMEOUT_S: Final = 30.0
"""How long a service process may take to stop, from the signal or the task's death to its exit
(Kubernetes' default grace period, after which the kubelet kills it anyway). Past it, the process
writes every thread's stack to stderr and exits: a stop that hangs must not leave an unready
process running for ever."""


class Service(Protocol):
    name: str
    provisions_streams: bool
    """False for a reader (the gateway): it waits for the streams instead of creating them."""
    tasks: Supervisor
    """Its background tasks: one that dies stops the process (`serve`)."""

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


async def _unless_failed(tasks: Supervisor, work: Coroutine[Any, Any, None]) -> None:
    """Run `work`, unless one of `tasks` dies first: then raise its failure."""
    job = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(tasks.failed())
    try:
        await asyncio.wait({job, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in (job, watch):
            pending.cancel()
    if job.done() and not job.cancelled():
        job.result()
        return
    await asyncio.wait([job])
    raise watch.result()


async def _stop_or_failure(stop: asyncio.Event, tasks: Supervisor) -> BackgroundTaskFailed | None:
    """Wait for SIGTERM or a task's death, whichever comes first; the failure, if it was one."""
    stopped = asyncio.ensure_future(stop.wait())
    failed = asyncio.ensure_future(tasks.failed())
    try:
        await asyncio.wait({stopped, failed}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        failed.cancel()
    if failed.done() and not failed.cancelled():
        return failed.result()
    return None


async def serve(
    service: Service,
    settings: Settings,
    stop: asyncio.Event,
    on_stopping: Callable[[bool], None] | None = None,
) -> None:
    """Run `service` until `stop` is set; probes answer from the start. Raises
    `BackgroundTaskFailed` when one of its tasks died (after stopping it as `stop` would).
    `on_stopping(failed)` is called as the stop begins."""
    bind(service=service.name)
    bus: Bus | None = None
    failure: BackgroundTaskFailed | None = None

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
        try:
            await _unless_failed(service.tasks, service.start(bus, settings))
        except BackgroundTaskFailed:
            await service.tasks.stop()
            raise
        # What is here now (the imports, the state rebuilt from the stream) lives as long as
        # the process: left to the collector, every full collection walks all of it again, and
        # a burst of requests (a job start) triggers several. The young generation is collected
        # less often too: a request's objects die by reference counting, not by the collector.
        gc.freeze()
        gc.set_threshold(*GC_THRESHOLDS)
        log.info("service_started", service=service.name, nats=settings.nats_url)
        failure = await _stop_or_failure(stop, service.tasks)
        if on_stopping is not None:
            on_stopping(failure is not None)
        if failure is None:
            log.info("service_stopping", service=service.name)
        else:
            log.error(
                "service_stopping",
                service=service.name,
                task=failure.details.get("task"),
                error=failure.message,
                consequence=f"unready; the process stops and exits with {EXIT_TASK_FAILED}",
            )
        await service.stop()
    finally:
        if bus is not None:
            with contextlib.suppress(Exception):
                await bus.close()
        await health.stop()
    log.info("service_stopped", service=service.name)
    if failure is not None:
        raise failure


def run(service: Service, settings: Settings) -> None:
    """Blocking entry point: runs until SIGTERM or SIGINT, or until a task of the service dies
    (then exits with `EXIT_TASK_FAILED`)."""
    configure_logging(settings.log_format, settings.log_level)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(service, settings, stop, functools.partial(_bound_the_stop, service.name))

    try:
        asyncio.run(main())
    except BackgroundTaskFailed as failure:
        log.error("service_failed", service=service.name, error=failure.message)
        raise SystemExit(EXIT_TASK_FAILED) from None


def _bound_the_stop(name: str, failed: bool, timeout: float = STOP_TIMEOUT_S) -> None:
    """From now on the process has `timeout` seconds to exit: past them, it says so, writes
    every thread's stack to stderr (where the stop hangs) and exits at once. The timer is a
    daemon thread, so it holds nothing up when the stop goes as it should; it covers the
    event loop's own shutdown and the interpreter's too."""
    code = EXIT_TASK_FAILED if failed else EXIT_STOP_STUCK

    def expire() -> None:
        log.error(
            "service_stop_stuck",
            service=name,
            timeout_s=timeout,
            consequence=f"every thread's stack follows on stderr; the process exits with {code}",
        )
        faulthandler.dump_traceback(all_threads=True)
        os._exit(code)

    timer = threading.Timer(timeout, expire)
    timer.daemon = True
    timer.name = "strata-stop-deadline"
    timer.start()
