"""The registry's probe of a suspect (`suspects.probe`) against a real nats-server: answered,
no responders, unanswered, and a suspect whose connection the server still holds when the first
probe comes and drops just after (the first probe goes into its buffer; a later one finds the
subscription gone)."""

from __future__ import annotations

import asyncio
import time

import pytest
from nats.aio.msg import Msg
from strata.bus import Bus
from strata.events import subjects
from strata.services.registry.suspects import probe

pytestmark = pytest.mark.nats

JOB, WORKER, INSTANCE = "probe-job", "w1", "i1"
TIMEOUT = 5.0
"""The probe's timeout: far longer than anything it waits for here, so that an outcome decided
before it can only be the probe's doing, even on a loaded machine."""


async def test_a_live_suspect_answers_and_a_gone_one_has_no_responders(nats_url: str) -> None:
    async with (
        await Bus.connect(nats_url, deadline=10) as registry,
        await Bus.connect(nats_url, deadline=10) as suspect,
    ):

        async def answer(msg: Msg) -> None:
            await suspect.nc.publish(msg.reply, b"")

        sub = await suspect.nc.subscribe(subjects.probe_subject(JOB, WORKER, INSTANCE), cb=answer)
        await suspect.nc.flush()
        assert await probe(registry.nc, JOB, WORKER, INSTANCE, TIMEOUT) == "answered"
        await sub.unsubscribe()
        await suspect.nc.flush()
        started = time.monotonic()
        assert await probe(registry.nc, JOB, WORKER, INSTANCE, TIMEOUT) == "no_responders"
        assert time.monotonic() - started < TIMEOUT


async def test_a_silent_suspect_is_unanswered_at_the_timeout(nats_url: str) -> None:
    async with (
        await Bus.connect(nats_url, deadline=10) as registry,
        await Bus.connect(nats_url, deadline=10) as suspect,
    ):
        heard: list[Msg] = []

        async def take(msg: Msg) -> None:
            heard.append(msg)

        await suspect.nc.subscribe(subjects.probe_subject(JOB, WORKER, INSTANCE), cb=take)
        await suspect.nc.flush()
        started = time.monotonic()
        assert await probe(registry.nc, JOB, WORKER, INSTANCE, 1.0) == "unanswered"
        assert time.monotonic() - started >= 1.0
        assert len(heard) >= 2  # sent again within the timeout


async def test_a_suspect_whose_connection_drops_after_the_first_probe_has_no_responders(
    nats_url: str,
) -> None:
    async with await Bus.connect(nats_url, deadline=10) as registry:
        suspect = await Bus.connect(nats_url, deadline=10)
        first = asyncio.Event()

        async def hold(msg: Msg) -> None:
            first.set()  # never answered: the process is dead, the server has not read it yet

        await suspect.nc.subscribe(subjects.probe_subject(JOB, WORKER, INSTANCE), cb=hold)
        await suspect.nc.flush()

        async def drop_after_the_first_probe() -> None:
            await first.wait()
            await suspect.close()

        dropping = asyncio.create_task(drop_after_the_first_probe())
        started = time.monotonic()
        outcome = await probe(registry.nc, JOB, WORKER, INSTANCE, TIMEOUT)
        await dropping
        assert outcome == "no_responders"
        assert time.monotonic() - started < TIMEOUT
