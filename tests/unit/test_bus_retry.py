"""`retry_transient`: a JetStream call is made again through transient failures, never others."""

from __future__ import annotations

import time

import nats.errors
import nats.js.errors
import pytest
from strata.bus.connection import is_transient, retry_transient
from strata.errors import BusError


class Flaky:
    """Fails with the given errors in turn, then returns "done"."""

    def __init__(self, *errors: Exception) -> None:
        self.errors = list(errors)
        self.calls = 0

    async def __call__(self) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "done"


@pytest.mark.parametrize(
    ("error", "transient"),
    [
        (nats.errors.TimeoutError(), True),
        (nats.errors.NoRespondersError(), True),
        (nats.js.errors.ServiceUnavailableError(code=503), True),
        (nats.js.errors.NotFoundError(code=404), False),
        (nats.js.errors.BadRequestError(code=400), False),
        (nats.errors.ConnectionClosedError(), False),
    ],
)
def test_what_counts_as_transient(error: Exception, transient: bool) -> None:
    assert is_transient(error) is transient


async def test_transient_failures_are_retried_until_the_call_succeeds() -> None:
    call = Flaky(nats.errors.TimeoutError(), nats.errors.NoRespondersError())

    assert await retry_transient(call, "reading", deadline=10) == "done"
    assert call.calls == 3


async def test_other_failures_are_raised_at_once() -> None:
    call = Flaky(nats.js.errors.NotFoundError(code=404))

    with pytest.raises(nats.js.errors.NotFoundError):
        await retry_transient(call, "reading", deadline=10)
    assert call.calls == 1


async def test_past_the_deadline_the_error_names_what_was_tried() -> None:
    call = Flaky(*(nats.errors.TimeoutError() for _ in range(1000)))
    started = time.monotonic()

    with pytest.raises(BusError, match=r"reading stream X failed .* TimeoutError"):
        await retry_transient(call, "reading stream X", deadline=0.3)
    assert 0.3 <= time.monotonic() - started < 2.0
    assert call.calls > 1
