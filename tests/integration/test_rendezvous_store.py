"""The torchrun rendezvous backend and its store against a real nats-server: the fencing-token
rules torch's `RendezvousBackend` asks for, TCPStore's semantics of each store operation, a store
used through `PrefixStore` as torchrun uses it, the endpoint and id rules, and when a finished
run's rendezvous may be used again."""

from __future__ import annotations

import asyncio
import os
import pickle
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import strata.torch.store as store_module
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
    reusable,
)
from strata.torch.store import KVStore, RendezvousBucket
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    _NodeDesc,
    _RendezvousState,
    create_handler,
)

from tests.rendezvous import declared_entry_point, entry_point_path, rendezvous_state, torchrun_env
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
    return KVStore(bucket, runner, bucket.job, timeout=timedelta(seconds=5))


def test_state_is_created_once_then_written_only_with_the_current_token(
    bucket: RendezvousBucket, runner: LoopRunner
) -> None:
    backend = JetStreamRendezvousBackend(bucket, runner, bucket.job)
    assert backend.name == "strata"
    assert backend.get_state() is None

    state, token, written = backend.set_state(rendezvous_state(1))  # type: ignore[misc]
    assert (state, written) == (rendezvous_state(1), True)
    # A second "create" loses to the first and is told what is there.
    assert backend.set_state(rendezvous_state(2)) == (rendezvous_state(1), token, False)

    newer = backend.set_state(rendezvous_state(3), token)
    assert newer is not None
    assert newer[0] == rendezvous_state(3)
    assert newer[2] is True
    # The old token is stale now: the write is refused and the current state returned.
    assert backend.set_state(rendezvous_state(4), token) == (rendezvous_state(3), newer[1], False)
    assert backend.set_state(rendezvous_state(5), b"not-a-revision") == (
        rendezvous_state(3),
        newer[1],
        False,
    )
    assert backend.get_state() == (rendezvous_state(3), newer[1])


def test_racing_writers_with_one_token_exactly_one_wins(
    bucket: RendezvousBucket, runner: LoopRunner
) -> None:
    backend = JetStreamRendezvousBackend(bucket, runner, bucket.job)
    _, token, _ = backend.set_state(rendezvous_state(0))  # type: ignore[misc]
    results: list[bool] = []

    def write(i: int) -> None:
        outcome = backend.set_state(rendezvous_state(10 + i), token)
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


async def test_a_put_heard_before_the_stream_can_read_it_back_is_read_again_at_once(
    nats_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server delivers a put to a waiting subscription as it routes it, and the stream
    stores it a moment later: a read right after the put was heard can miss it (here, that
    read is made to). The wait must read again within milliseconds, not at its next recheck,
    made a minute long here (it was the only way back: a second's stall in a group's set-up)."""
    monkeypatch.setattr(store_module, "RECHECK_S", 60.0)
    job = new_job("heard")
    waiter = await RendezvousBucket.open([nats_url], load_settings(), job)
    writer = await RendezvousBucket.open([nats_url], load_settings(), job)
    key = subjects.rendezvous_store_key(job, "k")
    reads = hidden = 0
    hide = False
    listening = asyncio.Event()
    real_read = waiter.read

    async def read(key: str) -> tuple[bytes, int] | None:
        nonlocal reads, hidden, hide
        reads += 1
        if hide:
            hide, hidden = False, hidden + 1
            return None
        value = await real_read(key)
        if reads == 2:
            # Read once before it listened to the key's subject, once after: it waits now.
            listening.set()
        return value

    monkeypatch.setattr(waiter, "read", read)
    waiting = asyncio.create_task(waiter.wait_for([key], timeout=120))
    try:
        async with asyncio.timeout(30):
            await listening.wait()
        hide = True
        await writer.put(key, b"value")
        async with asyncio.timeout(30):
            assert await waiting == {key: b"value"}
        assert hidden == 1
    finally:
        waiting.cancel()
        await waiter.close()
        await writer.close()


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


def _closed_state(round_: int, beats: dict[_NodeDesc, datetime]) -> bytes:
    state = _RendezvousState()
    state.round, state.closed, state.complete = round_, True, True
    state.participants = dict.fromkeys(beats, 0)
    state.last_heartbeats = dict(beats)
    return pickle.dumps(state)


def test_a_finished_run_reads_as_a_new_rendezvous_one_new_agent_takes_over(
    bucket: RendezvousBucket, runner: LoopRunner
) -> None:
    job = bucket.job
    # Every agent of the finished run closed the rendezvous and left it.
    first, second = (JetStreamRendezvousBackend(bucket, runner, job) for _ in range(2))
    written = first.set_state(_closed_state(3, {}))
    assert written is not None
    seen = [backend.get_state() for backend in (first, second)]
    for value, token in seen:  # type: ignore[misc]
        state = pickle.loads(value)
        # Open, empty, and at the next round, so its store keys are not the old run's.
        assert (state.closed, state.round, state.participants) == (False, 4, {})
        assert token == written[1]
    # Two new agents write over it with the same token: one wins, the other reads its state.
    joined = _RendezvousState()
    joined.round = 4
    joined.participants = {_NodeDesc("node-a", 1, 0): 0}
    won = first.set_state(pickle.dumps(joined), seen[0][1])  # type: ignore[index]
    lost = second.set_state(pickle.dumps(_RendezvousState()), seen[1][1])  # type: ignore[index]
    assert won is not None
    assert won[2] is True
    assert lost is not None
    assert lost[2] is False
    assert pickle.loads(lost[0]).participants == joined.participants


def test_a_closed_run_with_a_live_agent_stays_closed_until_it_leaves(
    bucket: RendezvousBucket, runner: LoopRunner
) -> None:
    job = bucket.job
    expiry = timedelta(seconds=15)
    backend = JetStreamRendezvousBackend(bucket, runner, job, keep_alive_expiry=expiry)
    straggler, dead = _NodeDesc("node-a", 1, 0), _NodeDesc("node-b", 2, 0)
    now = datetime.now(UTC)
    backend.set_state(_closed_state(2, {straggler: now, dead: now - 2 * expiry}))
    # An agent of the run still keeps it alive: a newcomer sees it closed, as torch expects.
    value, _ = backend.get_state()  # type: ignore[misc]
    assert pickle.loads(value).closed
    # Once that agent has left too (torchrun's shutdown, after closing), it is a new rendezvous;
    # the agent killed before it could leave counts as gone once its keep-alive is stale.
    backend.leave(straggler)
    value, _ = backend.get_state()  # type: ignore[misc]
    assert (pickle.loads(value).closed, pickle.loads(value).round) == (False, 3)
    assert reusable(_closed_state(0, {dead: now}), now, expiry) is None
    assert reusable(_closed_state(0, {dead: now - 2 * expiry}), now, expiry) is not None
    # A rendezvous still open is never replaced, however old its keep-alives.
    running = _RendezvousState()
    running.last_heartbeats = {dead: now - 2 * expiry}
    assert reusable(pickle.dumps(running), now, expiry) is None


def test_torch_loading_the_entry_point_imports_no_nats_nor_the_sdk(tmp_path: Path) -> None:
    # torch imports every `torchrun.handlers` entry point in every agent, whatever its backend.
    probe = (
        "import sys, torch.distributed.elastic.rendezvous as r\n"
        "assert 'strata' in r.rendezvous_handler_registry._registry\n"
        "print(sorted(m for m in ('nats', 'pydantic', 'structlog', 'strata.aio', 'strata.config')"
        " if m in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        env=torchrun_env(entry_point_path(tmp_path)),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
