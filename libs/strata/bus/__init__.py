"""Strata's NATS JetStream plumbing: connect, provision, publish, consume, request/reply.

`Bus` bundles a connection with the helpers most code needs; the modules beside it (`connection`,
`streams`, `publish`, `consume`, `rpc`, `server`) can be used on their own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import PubAck

from strata.bus.connection import ConnectOptions, connect
from strata.bus.consume import Delivered, DurableConsumer, EventFeed
from strata.bus.publish import (
    DEFAULT_PUBLISH,
    AckJournal,
    PublishOptions,
    publish_event,
    publish_events,
    publish_telemetry,
)
from strata.bus.rpc import Caller, RpcClient, RpcServer
from strata.bus.streams import (
    RendezvousQuota,
    StreamSpec,
    ensure_stream,
    ensure_streams,
    strata_streams,
)
from strata.config import Settings
from strata.events import subjects
from strata.events.models import Event

__all__ = [
    "AckJournal",
    "Bus",
    "Caller",
    "ConnectOptions",
    "Delivered",
    "DurableConsumer",
    "EventFeed",
    "PublishOptions",
    "RpcClient",
    "RpcServer",
    "StreamSpec",
    "connect",
    "ensure_stream",
    "ensure_streams",
    "strata_streams",
]


class Bus:
    """A NATS connection with JetStream, and Strata's ways of using it."""

    def __init__(
        self,
        nc: NATS,
        *,
        publish_options: PublishOptions = DEFAULT_PUBLISH,
        caller: Caller | None = None,
    ) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self.publish_options = publish_options
        self.rpc = RpcClient(nc, caller=caller)

    @classmethod
    async def connect(
        cls,
        servers: str | Sequence[str] | None = None,
        *,
        settings: Settings | None = None,
        name: str = "strata",
        deadline: float = 30.0,
        caller: Caller | None = None,
    ) -> Bus:
        """Connect to `servers` (or the settings' `STRATA_NATS_URL`), retrying until `deadline`.

        With a `caller` (a worker), requests are sent as that worker and replies come to its own
        inbox prefix. With the settings' `STRATA_ACK_JOURNAL`, acknowledged event ids go to that
        file.
        """
        options = ConnectOptions(
            name=name,
            deadline=deadline,
            user=settings.nats_user if settings else None,
            password=settings.nats_password if settings else None,
            inbox_prefix=(
                subjects.worker_inbox_prefix(caller.job, caller.worker) if caller else None
            ),
        )
        if servers is None:
            servers = settings.nats_servers if settings else "nats://127.0.0.1:4222"
        nc = await connect(servers, options)
        if settings is None or settings.ack_journal is None:
            return cls(nc, caller=caller)
        journal = PublishOptions(journal=AckJournal(settings.ack_journal))
        return cls(nc, publish_options=journal, caller=caller)

    async def close(self) -> None:
        try:
            if not self.nc.is_closed:
                await self.nc.drain()
        finally:
            if self.publish_options.journal is not None:
                self.publish_options.journal.close()

    async def __aenter__(self) -> Bus:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def ensure_streams(
        self, replicas: int = 1, settings: Settings | None = None
    ) -> dict[str, Any]:
        """The streams, and the rendezvous buckets of `settings`' jobs within its quota."""
        if settings is None:
            return await ensure_streams(self.js, replicas)
        return await ensure_streams(
            self.js,
            replicas,
            rendezvous_jobs=settings.rendezvous_job_list,
            quota=RendezvousQuota.of(settings),
        )

    async def publish(
        self,
        event: Event,
        *,
        expected_last_subject_seq: int | None = None,
        expected_subject: str | None = None,
    ) -> PubAck:
        """Publish one event and wait for JetStream's ack (retrying transient failures); with
        `expected_last_subject_seq`, only if the last message on its subject (or on
        `expected_subject`) has that sequence, else `ConflictError`."""
        return await publish_event(
            self.js,
            event,
            expected_last_subject_seq=expected_last_subject_seq,
            expected_subject=expected_subject,
            options=self.publish_options,
        )

    async def publish_many(self, events: Sequence[Event], *, window: int = 256) -> list[PubAck]:
        """Publish with up to `window` acks outstanding; acks in input order."""
        return await publish_events(self.js, events, window=window, options=self.publish_options)

    async def publish_telemetry(self, event: Event) -> None:
        """Heartbeats and samples: no ack awaited."""
        await publish_telemetry(self.nc, event)
