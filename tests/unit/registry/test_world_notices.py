"""How often the registry may announce one job's world: spaced by the job's size, so the
fan-out of a long start stays bounded whatever the number of workers."""

from __future__ import annotations

from strata.services.registry.notices import (
    WORLD_COALESCE_S,
    WORLD_SPACING_PER_WORKER,
    world_spacing,
)


def test_small_jobs_are_told_once_per_burst_and_large_ones_at_a_bounded_message_rate() -> None:
    assert world_spacing(0) == world_spacing(10) == WORLD_COALESCE_S
    for workers in (1_000, 2_000, 10_000):
        spacing = world_spacing(workers)
        assert spacing >= WORLD_COALESCE_S
        # One notice reaches every worker: never more than this many messages a second.
        assert workers / spacing <= 1 / WORLD_SPACING_PER_WORKER + 1e-6
    assert world_spacing(10_000) == 1.0
