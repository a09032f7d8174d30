"""Connecting to NATS: retry the first connect with backoff, then let the client reconnect forever.

A worker or service that starts before NATS is reachable keeps trying until its deadline rather than
failing at once; once connected, nats-py reconnects on its own and buffers while it does.
`retry_transient` does the same for one JetStream call: no leader yet, a timeout, a reconnect.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import nats
import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import DEFAULT_INBOX_PREFIX
from nats.aio.client import Client as NATS

from strata.errors import BusError, ConfigError
from strata.events import subjects
from strata.logs import Throttle
from strata.metrics import MESSAGES_REJECTED, RPC_DROPPED

log = structlog.get_logger("strata.bus")

_slow_log = Throttle()


def _rpc_service(subject: str) -> str | None:
    """The service a request subject (a partition's too) is for; None for any other subject."""
    try:
        return subjects.parse_rpc_subject(subject).service
    except ValueError:
        return None


def _slow_consumer(client: str | None, exc: nats.errors.SlowConsumerError) -> None:
    """Count a message the client dropped because its subscription held as many as it may (one
    warning per subscription every few seconds: a flood must not become one of log lines)."""
    subject = exc.subject or ""
    service = _rpc_service(subject)
    if service is not None:
        RPC_DROPPED.labels(service, "slow_consumer").inc()
        key: tuple[str | None, str] = (client, f"rpc.{service}")
    else:
        MESSAGES_REJECTED.labels(client or "nats", "slow_consumer").inc()
        key = (client, "")
    held_back = _slow_log(key)
    if held_back is not None:
        log.warning(
            "nats_slow_consumer_dropped",
            client=client,
            subject=subject[:200],
            held_back=held_back,
        )


@dataclass(frozen=True)
class ConnectOptions:
    """How hard to try: the first connect retries with exponential backoff until `deadline`."""

    name: str = "strata"
    user: str | None = None
    password: str | None = None
    deadline: float = 30.0
    initial_backoff: float = 0.1
    max_backoff: float = 2.0
    connect_timeout: float = 2.0
    reconnect_wait: float = 0.25
    ping_interval: float = 10.0
    max_outstanding_pings: int = 3
    inbox_prefix: str | None = None
    """Where replies to this connection's requests come (None: NATS's shared `_INBOX`). A worker's
    is its own, so its credential may be let read its replies and nobody else's."""


T = TypeVar("T")

TRANSIENT_DEADLINE_S = 60.0
"""How long `retry_transient` keeps trying: several leader elections' worth."""
_TRANSIENT_STATUS = {408, 503}


def backoff_delays(initial: float, maximum: float) -> Iterator[float]:
    """Exponential backoff with jitter: each delay in [ceiling/2, ceiling], the ceiling doubling."""
    ceiling = initial
    while True:
        yield random.uniform(ceiling / 2, ceiling)
        ceiling = min(maximum, ceiling * 2)


def is_transient(exc: BaseException) -> bool:
    """A failure that the same call may not meet again: a stream or cluster without a leader for
    the moment, a timeout, a connection that is reconnecting."""
    if isinstance(exc, nats.js.errors.APIError) and not isinstance(
        exc, nats.js.errors.NoStreamResponseError
    ):
        # Some subclasses (KeyWrongLastSequenceError) are built without a status code.
        return (getattr(exc, "code", None) or 0) in _TRANSIENT_STATUS
    return isinstance(
        exc,
        (
            nats.errors.TimeoutError,
            asyncio.TimeoutError,
            nats.errors.NoRespondersError,
            nats.js.errors.NoStreamResponseError,
            nats.errors.ConnectionReconnectingError,
            nats.errors.OutboundBufferLimitError,
            nats.errors.StaleConnectionError,
        ),
    )


async def retry_transient(
    call: Callable[[], Awaitable[T]], what: str, deadline: float = TRANSIENT_DEADLINE_S
) -> T:
    """`call()`, made again with backoff while it fails transiently, for up to `deadline` seconds.

    Any other failure is raised at once; past the deadline, `BusError` names `what` was tried.
    """
    give_up = time.monotonic() + deadline
    delays = backoff_delays(0.05, 1.0)
    attempts = 0
    while True:
        attempts += 1
        try:
            return await call()
        except Exception as exc:
            if not is_transient(exc):
                raise
            remaining = give_up - time.monotonic()
            if remaining <= 0:
                raise BusError(
                    f"{what} failed {attempts} times over {deadline:.0f}s, last with "
                    f"{type(exc).__name__}: {exc}; is the NATS cluster up and has JetStream "
                    "a leader?"
                ) from None
            if attempts == 1:
                log.warning("jetstream_retrying", what=what, error=f"{type(exc).__name__}: {exc}")
            await asyncio.sleep(min(next(delays), remaining))


async def connect(
    servers: str | Sequence[str],
    options: ConnectOptions | None = None,
    client: Callable[[], NATS] = NATS,
) -> NATS:
    """A connected client (made by `client`, a subclass of nats-py's for a special purpose), or
    `BusError` naming the servers once the deadline has passed."""
    opts = options or ConnectOptions()
    urls = [s.strip() for s in servers.split(",")] if isinstance(servers, str) else list(servers)
    if not urls:
        raise ConfigError("no NATS server given: set STRATA_NATS_URL (nats://host:port)")
    deadline = time.monotonic() + opts.deadline
    delays = backoff_delays(opts.initial_backoff, opts.max_backoff)
    attempt = 0

    errors_seen = 0
    last_seen: Exception | None = None
    connected = False

    async def on_error(exc: Exception) -> None:
        nonlocal errors_seen, last_seen
        if isinstance(exc, nats.errors.SlowConsumerError):
            _slow_consumer(opts.name, exc)
            return
        errors_seen += 1
        last_seen = exc
        # Before the first connection every failed attempt ends in one BusError that says it
        # all; a warning per retry would bury it.
        report = log.warning if connected else log.debug
        report("nats_error", client=opts.name, error=f"{type(exc).__name__}: {exc}")

    async def on_disconnect() -> None:
        if nc.is_closed:  # closed on purpose: nothing to tell
            return
        log.info("nats_disconnected", client=opts.name)

    async def on_reconnect() -> None:
        log.info("nats_reconnected", client=opts.name)

    while True:
        attempt += 1
        nc = client()
        try:
            # With reconnects allowed forever, nats-py's first connect also retries forever when
            # nothing listens, so the deadline has to be enforced around it.
            await asyncio.wait_for(
                nc.connect(
                    servers=urls,
                    name=opts.name,
                    user=opts.user,
                    password=opts.password,
                    connect_timeout=max(1, round(opts.connect_timeout)),
                    allow_reconnect=True,
                    max_reconnect_attempts=-1,
                    # nats-py annotates these two as int but takes (and documents) seconds as float.
                    reconnect_time_wait=opts.reconnect_wait,  # type: ignore[arg-type]
                    ping_interval=opts.ping_interval,  # type: ignore[arg-type]
                    max_outstanding_pings=opts.max_outstanding_pings,
                    error_cb=on_error,
                    disconnected_cb=on_disconnect,
                    reconnected_cb=on_reconnect,
                    # Publishes made while reconnecting are buffered up to this size, not lost.
                    pending_size=64 * 1024 * 1024,
                    inbox_prefix=opts.inbox_prefix or DEFAULT_INBOX_PREFIX,
                ),
                timeout=max(0.001, deadline - time.monotonic()),
            )
            connected = True
            return nc
        except nats.errors.NoServersError as exc:
            last_error: Exception = exc
        except (TimeoutError, OSError, nats.errors.Error) as exc:
            if not nc.is_closed:
                await nc.close()
            # A timeout here is the deadline; what nats-py kept retrying says more.
            cause: Exception = last_seen if isinstance(exc, TimeoutError) and last_seen else exc
            if (
                isinstance(cause, nats.errors.AuthorizationError)
                or "authorization" in str(cause).lower()
            ):
                raise BusError(
                    f"NATS at {', '.join(urls)} refused the credentials of {opts.name!r}: "
                    "check STRATA_NATS_USER / STRATA_NATS_PASSWORD"
                ) from None
            last_error = cause
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise BusError(
                f"cannot reach NATS at {', '.join(urls)} after {max(attempt, errors_seen)} "
                f"attempts over "
                f"{opts.deadline:.0f}s ({type(last_error).__name__}: {last_error}); "
                "is nats-server running (strata up starts one) and STRATA_NATS_URL right?"
            )
        await asyncio.sleep(min(next(delays), remaining))
