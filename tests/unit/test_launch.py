"""The one rule for a worker's rank under a launcher (`strata.launch`): `rank=`, then
`STRATA_RANK`, then the launcher's `RANK`, then an initialised torch.distributed's rank, else the
registry's lowest free one; the same for a worker the program builds and for the implicit one."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
import strata.aio
import torch.distributed as dist
from strata.config import Env, load_settings
from strata.launch import LaunchedAs, launched_as


@pytest.fixture
def no_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", Env.RANK, Env.NATS_USER):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def torchrun(monkeypatch: pytest.MonkeyPatch, no_launcher: None) -> None:
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")


@pytest.fixture
def process_group(no_launcher: None) -> Iterator[None]:
    dist.init_process_group(
        "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=30)
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def worker(**kwargs: object) -> strata.aio.Worker:
    settings = load_settings(job="launch", nats_url="nats://127.0.0.1:4222")
    return strata.aio.Worker(settings=settings, **kwargs)  # type: ignore[arg-type]


def test_outside_any_launcher_the_registry_chooses(no_launcher: None) -> None:
    assert launched_as() is None
    assert worker().requested_rank is None


def test_a_worker_built_under_torchrun_takes_torchs_rank_and_id(torchrun: None) -> None:
    assert launched_as() == LaunchedAs(2, "rank-2")
    built = worker()
    assert (built.requested_rank, built.id) == (2, "rank-2")
    # A worker id of the program's own keeps torch's rank.
    named = worker(worker_id="trainer")
    assert (named.requested_rank, named.id) == (2, "trainer")


def test_rank_given_or_strata_rank_comes_first(
    torchrun: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert worker(rank=0).requested_rank == 0
    monkeypatch.setenv(Env.RANK, "1")
    assert launched_as() is None
    settings = load_settings(job="launch", nats_url="nats://127.0.0.1:4222")
    assert strata.aio.Worker(settings=settings).requested_rank == 1


def test_rank_without_world_size_is_no_launchers(
    monkeypatch: pytest.MonkeyPatch, no_launcher: None
) -> None:
    monkeypatch.setenv("RANK", "2")
    assert launched_as() is None


def test_an_initialised_process_group_gives_its_rank(process_group: None) -> None:
    assert launched_as() == LaunchedAs(0, None)
    built = worker()
    assert built.requested_rank == 0
    assert built.id != "rank-0"
