"""The torchrun rendezvous backend and its store against a real nats-server: the fencing-token
rules torch's `RendezvousBackend` asks for, TCPStore's semantics of each store operation, a store
used through `PrefixStore` as torchrun uses it, and the endpoint and id rules."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch.distributed as dist
from strata._loop import LoopRunner
from strata.config import Env, load_settings
from strata.errors import ConfigError
from strata.events import subjects
from strata.torch.rendezvous import (
    JetStreamRendezvousBackend,
    create_backend,
    create_rdzv_handler,
    handler,
    nats_servers,
)
from strata.torch.store import KVStore, RendezvousBucket
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

from tests.rendezvous import declared_entry_point
from tests.support import new_job

pytestmark = pytest.mark.nats


@pytest.fixture
def runner() -> Iterator[LoopRunner]:
    loop = LoopRunner("test-rendezvous")
    yield loop
    loop.close()


@pytest.fixture
def bucket(nats_url: str, runner: LoopRunner) -> Iterator[RendezvousBucket]:
    opened = runner.run(RendezvousBucket.open([nats_url], load_settings(), new_job("bucket")))
    yield opened
    runner.run(opened.close())


@pytest.fixture
def store(bucket: RendezvousBucket, runner: LoopRunner) -> KVStore:
    return KVStore(bucket, runner, new_job("store"), timeout=timedelta(seconds=5))


def test_state_is_created_once_then_written_only_with_the_current_token(
    bucket: RendezvousBucket, runner: LoopRunner
) -> None:
    backend = JetStreamRendezvousBackend(bucket, runner, new_job("rdzv"))
    assert backend.name == "strata"
    assert backend.get_state() is None

    state, token, written = backend.set_state(b"first")  # type: ignore[misc]
    assert (state, written) == (b"first", True)
    # A second "create" loses to the first and is told what is there.
    assert backend.set_state(b"other") == (b"first", token, False)

    newer = backend.set_state(b"second", token)
    assert newer is not None
    assert newer[0] == b"second"
    assert newer[2] is True
    # The old token is stale now: the write is refused and the current state returned.
    assert backend.set_state(b"stale", token) == (b"second", newer[1], False)
    assert backend.set_state(b"foreign", b"not-a-revision") == (b"second", newer[1], False)
    assert backend.get_state() == (b"second", newer[1])


def test_racing_writers_with_one_token_exactly_one_wins(
    bucket: RendezvousBucket, runner: LoopRunner
) -> None:
    backend = JetStreamRendezvousBackend(bucket, runner, new_job("rdzv"))
    _, token, _ = backend.set_state(b"start")  # type: ignore[misc]
    results: list[bool] = []

    def write(i: int) -> None:
        outcome = backend.set_state(f"writer {i}".encode(), token)
        assert outcome is not None
        results.append(outcome[2])

    threads = [threading.Thread(target=write, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results) == [False] * 7 + [True]


def test_store_operations_follow_tcpstore(store: KVStore) -> None:
    store.set("key", "value")
    assert store.get("key") == b"value"
    assert store.check(["key"])
    assert not store.check(["key", "missing"])
    assert store.add("counter", 3) == 3
    assert store.add("counter", -1) == 2
    assert store.get("counter") == b"2"
    # compare_set: a missing key is set only when nothing is expected.
    assert store.compare_set("cas", "expected", "x") == b"expected"
    assert not store.check(["cas"])
    assert store.compare_set("cas", "", "first") == b"first"
    assert store.compare_set("cas", "wrong", "second") == b"first"
    assert store.compare_set("cas", "first", "second") == b"second"
    assert store.num_keys() == 3
    assert store.delete_key("cas") is True
    assert store.delete_key("cas") is False
    assert store.num_keys() == 2
    # Any string is a key: torch's keys hold `/` and more.
    store.set("torch.rendezvous.x/0/MASTER ADDR:*>", b"\x00\xff")
    assert store.get("torch.rendezvous.x/0/MASTER ADDR:*>") == b"\x00\xff"


def test_get_and_wait_block_until_the_key_is_set_or_time_out(store: KVStore) -> None:
    threading.Timer(0.3, store.set, args=("late", b"here")).start()
    started = time.monotonic()
    assert store.get("late") == b"here"
    assert time.monotonic() - started < 4.0
    with pytest.raises(dist.DistStoreError, match="timed out"):
        store.wait(["never"], timedelta(seconds=0.3))


def test_through_a_prefix_store_as_torchrun_uses_it(store: KVStore) -> None:
    prefixed = dist.PrefixStore("torch.rendezvous.job.0", store)
    prefixed.multi_set(["a", "b"], ["1", "2"])
    assert prefixed.multi_get(["a", "b"]) == [b"1", b"2"]
    assert prefixed.add("n", 1) == 1
    # The barrier of torchrun's agents sets a timeout on the PrefixStore: it reaches this store.
    prefixed.set_timeout(timedelta(seconds=0.3))
    started = time.monotonic()
    with pytest.raises(dist.DistStoreError):
        prefixed.wait(["missing"])
    assert time.monotonic() - started < 3.0


def test_concurrent_adds_count_every_one(store: KVStore) -> None:
    def add() -> None:
        for _ in range(5):
            store.add("shared", 1)

    threads = [threading.Thread(target=add) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert store.get("shared") == b"20"


def test_the_handler_is_torchs_dynamic_rendezvous_on_this_backend(
    nats_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = new_job("rdzv")
    # What the agent passes on to its workers, kept out of this process's environment: set
    # first so that monkeypatch restores the variable's absence after the test (a delenv of an
    # absent variable records nothing to undo, and the job would leak into later tests).
    monkeypatch.setenv(Env.JOB, "unset")
    monkeypatch.delenv(Env.JOB)
    monkeypatch.setenv(Env.NATS_URL, nats_url)
    params = RendezvousParameters(
        backend="strata", endpoint=nats_url, run_id=job, min_nodes=1, max_nodes=1
    )
    # What create_rdzv_handler does, with the backend at hand to close.
    backend, store = create_backend(params)
    try:
        rdzv = create_handler(store, backend, params)
        assert rdzv.get_backend() == "strata"
        info = rdzv.next_rendezvous()
        assert (info.rank, info.world_size) == (0, 1)
        info.store.set("seen", b"yes")
        assert info.store.get("seen") == b"yes"
        rdzv.shutdown()
        assert rdzv.is_closed()
        assert os.environ[Env.JOB] == job
    finally:
        backend.close()


def test_the_entry_point_gives_torch_the_handler_factory() -> None:
    module, function = declared_entry_point().split(":")
    assert (module, function) == ("strata.torch.rendezvous", "handler")
    assert handler() is create_rdzv_handler


def test_endpoints_name_nats_servers() -> None:
    settings = load_settings(nats_url="nats://10.0.0.9:4222")
    assert nats_servers("", settings) == ["nats://10.0.0.9:4222"]
    assert nats_servers("10.0.0.5:4333", settings) == ["nats://10.0.0.5:4333"]
    assert nats_servers("nats-0", settings) == ["nats://nats-0:4222"]
    assert nats_servers("nats://a:1, tls://b:2", settings) == ["nats://a:1", "tls://b:2"]
    for bad in ("http://a:1", "a:port", "a:70000", ",", ":4222"):
        with pytest.raises(ConfigError):
            nats_servers(bad, settings)


def test_a_run_id_must_be_a_job_id(nats_url: str) -> None:
    params = RendezvousParameters(
        backend="strata", endpoint=nats_url, run_id="no spaces/here", min_nodes=1, max_nodes=1
    )
    with pytest.raises(ConfigError, match="rdzv-id"):
        create_backend(params)


def test_one_jobs_keys_never_meet_anothers() -> None:
    assert subjects.rendezvous_state_key("a.b") != subjects.rendezvous_state_key("a_b")
    assert not subjects.rendezvous_store_key("a", "state").startswith(
        subjects.rendezvous_state_key("a.store")
    )
    assert subjects.rendezvous_store_key("a", "") == "a.store.k"
