"""`Projection.publish_all` against a real nats-server: only the last event of a batch waits for
an acknowledgement, the feed confirms the others, and an event the feed never delivers (a
duplicate of one stored earlier) is published again with an ack instead of being waited for."""

from __future__ import annotations

from pathlib import Path

import pytest
from strata.bus import AckJournal, Bus, PublishOptions
from strata.config import load_settings
from strata.events import WorkerRegistered
from strata.events.ids import event_id
from strata.events.models import Event
from strata.services.projection import Projection

from tests.support import new_job

pytestmark = pytest.mark.nats


class Registrations(Projection[list[str]]):
    """Folds the registrations of one job into the list of their worker ids, in stream order."""

    def __init__(self, job: str) -> None:
        super().__init__()
        self.name = f"test-publish-{job}"
        self.job = job

    def initial_state(self) -> list[str]:
        return []

    def evolve(self, state: list[str], event: Event) -> list[str]:
        if isinstance(event, WorkerRegistered) and event.job == self.job:
            state.append(event.worker_id)
        return state


def registered(job: str, index: int) -> WorkerRegistered:
    return WorkerRegistered(
        id=event_id("test-registered", job, index),
        job=job,
        source="registry",
        ts=1,
        worker_id=f"w{index}",
        instance=f"p{index}",
        rank=index,
        world_size=index + 1,
        membership_epoch=index + 1,
        heartbeat_interval=1.0,
        heartbeat_timeout=5.0,
    )


async def test_a_batch_is_stored_in_order_confirmed_by_the_feed_and_journaled(
    nats_url: str, bus: Bus, tmp_path: Path
) -> None:
    job = new_job("publish")
    journal_path = tmp_path / "acked.journal"
    publisher = await Bus.connect(nats_url, deadline=10)
    publisher.publish_options = PublishOptions(journal=AckJournal(journal_path))
    projection = Registrations(job)
    await projection.start(publisher, load_settings(nats_url=nats_url))
    try:
        first = [registered(job, i) for i in range(200)]
        await projection.publish_all(first)
        assert projection.state == [f"w{i}" for i in range(200)]
        assert projection._unconfirmed == set()

        # w5 and w150 were stored before: JetStream drops the copies, so the feed never
        # delivers them; publish_all must find that out instead of waiting for them.
        again = [registered(job, 5), *(registered(job, i) for i in range(200, 260))]
        again.insert(30, registered(job, 150))
        await projection.publish_all(again)
        assert projection.state == [f"w{i}" for i in range(260)]
        assert projection._unconfirmed == set()
    finally:
        await projection.stop()
        await publisher.close()
    journaled = {line.split()[0] for line in journal_path.read_text().splitlines()}
    assert {event.id for event in first + again} <= journaled
