"""The registry process against a real nats-server: 200 in-process workers of which exactly the
silenced ones fail in time; crashes, clean restarts, a frozen registry and a NATS outage that fail
nobody; malformed heartbeats and requests refused with a counted reason; a second process under a
worker id superseding the first at once; requested ranks; jobs that never see each other. The fast
heartbeat decoder is checked against the full model at the end.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import strata
from hypothesis import given
from hypothesis import strategies as st
from nats.aio.msg import Msg
from strata import procutil
from strata.bus import Bus
from strata.bus.server import NatsServer
from strata.config import Env
from strata.errors import StrataError
from strata.events import (
    AnyEvent,
    WorkerFailed,
    WorkerHeartbeat,
    WorkerLeft,
    WorkerRegistered,
    WorkerStateChanged,
    decode_event,
    encode_event,
    pack,
    subjects,
    unpack,
)
from strata.events.models import SUPERSEDED_REASON
from strata.events.requests import MembersResult
from strata.services.registry.heartbeats import fast_beat

from tests.heartbeats import rejected_heartbeats, scrape
from tests.support import (
    ServiceProcess,
    async_wait_until,
    job_events,
    new_job,
    numbered,
    start_workers,
)

pytestmark = pytest.mark.nats

INTERVAL = 0.5
TIMEOUT = 3.0
SCHEDULING_ALLOWANCE = 1.0
"""Slack on the detection bound for a loaded 2-core machine (load 8, or the suite on two
processes): the detector wakes every interval/4 (already inside the bound), then the failure is
published, stored and delivered, and both ends are timestamped by event loops that also run 200
workers' heartbeats. The timeout itself is long enough that this process's loop, stalled by the
load, never misses a live worker's heartbeats by that much."""
DETECTION_BOUND = TIMEOUT + INTERVAL + SCHEDULING_ALLOWANCE
QUIET_WINDOW = 2 * TIMEOUT
"""How long to watch for failures that must not happen (a fixed window, on purpose)."""


def start_registry(nats_url: str, log_dir: Path) -> ServiceProcess:
    process = ServiceProcess(
        "registry", nats_url, log_dir, heartbeat_interval=INTERVAL, heartbeat_timeout=TIMEOUT
    )
    return process.start()


@pytest.fixture(scope="module")
def registry(nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    """One registry on the shared server for the tests that do not restart it."""
    process = start_registry(nats_url, tmp_path_factory.mktemp("registry"))
    yield process
    process.stop()


def failed_ids(events: list[AnyEvent]) -> list[str]:
    return [e.worker_id for e in events if isinstance(e, WorkerFailed)]


def membership(result: MembersResult) -> list[tuple[str, int, str]]:
    return [(m.worker_id, m.rank, m.status) for m in result.members]


def rpc_outcomes(port: int) -> dict[tuple[str, str], float]:
    return {
        (dict(labels)["verb"], dict(labels)["outcome"]): value
        for (name, labels), value in scrape(port).items()
        if name == "strata_rpc_requests_total" and ("service", "registry") in labels
    }


def heartbeat(job: str, worker_id: str, **fields: Any) -> WorkerHeartbeat:
    values: dict[str, Any] = {
        "job": job,
        "source": worker_id,
        "worker_id": worker_id,
        "instance": f"i-{worker_id}",
        "seq": 1,
        "state": "idle",
    }
    return WorkerHeartbeat(**(values | fields))


# -- failure detection at scale -------------------------------------------------------------------


@pytest.mark.slow
async def test_exactly_the_silenced_workers_of_200_fail_within_timeout_plus_an_interval(
    registry: ServiceProcess, nats_url: str, bus: Bus, workers: list[strata.aio.Worker]
) -> None:
    job = new_job("reg")
    failed_at: dict[str, float] = {}
    last_heartbeat: dict[str, float] = {}

    async def on_failed(msg: Msg) -> None:
        event = decode_event(msg.data)
        assert isinstance(event, WorkerFailed)
        failed_at.setdefault(event.worker_id, time.monotonic())

    async def on_heartbeat(msg: Msg) -> None:
        last_heartbeat[subjects.parse_heartbeat_subject(msg.subject)[1]] = time.monotonic()

    await bus.nc.subscribe(subjects.event_subject(job, "worker.failed"), cb=on_failed)
    ids = [f"w{i:03d}" for i in range(200)]
    victims = ["w017", "w101", "w188"]
    for worker_id in victims:
        await bus.nc.subscribe(subjects.heartbeat_subject(job, worker_id), cb=on_heartbeat)
    await bus.nc.flush()

    started = await start_workers(workers, job, nats_url, ids)
    # A worker failed here missed its own heartbeats: this process's event loop stalled (the SDK
    # logs heartbeat_late), which a machine with far more runnable processes than cores causes.
    assert not failed_at, f"failed while starting: {sorted(failed_at)}"
    assert sorted(w.rank for w in started) == list(range(200))
    assert all(w.heartbeat_timeout == TIMEOUT for w in started)

    async def victims_heartbeat() -> bool:
        return set(victims) <= set(last_heartbeat)

    await async_wait_until(victims_heartbeat, 5, "heartbeats of the workers to silence")
    by_id = {w.id: w for w in started}
    for worker_id in victims:
        by_id[worker_id]._suspend_heartbeats(True)

    async def victims_failed() -> bool:
        return set(victims) <= set(failed_at)

    await async_wait_until(victims_failed, 10 * TIMEOUT, "the silenced workers to be failed")
    # End to end, as this process saw them: its last heartbeat on the bus, then its failure.
    for worker_id in victims:
        since_last = failed_at[worker_id] - last_heartbeat[worker_id]
        assert since_last <= DETECTION_BOUND, (worker_id, since_last)

    # Proving that nobody else fails takes watching for a while.
    await asyncio.sleep(QUIET_WINDOW)
    failures = [e for e in await job_events(bus, job) if isinstance(e, WorkerFailed)]
    assert sorted(e.worker_id for e in failures) == victims
    # By the registry's own clock: never before the timeout, and within the bound after it.
    for failure in failures:
        silent = (failure.ts - failure.last_heartbeat_ts) / 1e9
        assert TIMEOUT < silent <= DETECTION_BOUND, (failure.worker_id, silent)
    listed = await started[0].members(include_gone=True)
    assert listed.world_size == 197
    status = {m.worker_id: m.status for m in listed.members}
    assert {w for w, s in status.items() if s == "failed"} == set(victims)
    assert all(status[w] == "idle" for w in ids if w not in victims)


# -- restarts -------------------------------------------------------------------------------------


def state_rebuilt_lines(registry: ServiceProcess) -> list[dict[str, Any]]:
    found = []
    for line in registry.log_file.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("event") == "state_rebuilt":
            found.append(record)
    return found


@pytest.mark.slow
async def test_a_crashed_or_stopped_registry_comes_back_with_the_same_membership(
    own_nats_server: NatsServer, tmp_path: Path, workers: list[strata.aio.Worker]
) -> None:
    url = own_nats_server.url
    registry = await asyncio.to_thread(start_registry, url, tmp_path)
    try:
        job = new_job("restart")
        started = await start_workers(workers, job, url, [f"w{i:02d}" for i in range(20)])
        async with await Bus.connect(url, name="test-registry") as bus:
            before = await started[0].members(include_gone=True)
            assert before.world_size == 20
            ranks = [w.rank for w in started]
            assert sorted(ranks) == list(range(20))

            async def unchanged_after_restart() -> None:
                restarted = time.monotonic()
                # Past twice the timeout after the restart: a missed grace period would show.
                await asyncio.sleep(max(0.0, restarted + QUIET_WINDOW - time.monotonic()))
                listed = await started[0].members(include_gone=True, retry_for=20)
                assert membership(listed) == membership(before)
                assert listed.membership_epoch == before.membership_epoch
                assert all(m.last_heartbeat_ts is not None for m in listed.members)
                assert failed_ids(await job_events(bus, job)) == []
                assert [(w.rank, w.rejoin_count) for w in started] == [(rank, 0) for rank in ranks]

            # Killed while the workers heartbeat; the new process replays the stream.
            await asyncio.to_thread(registry.kill)
            await asyncio.to_thread(registry.start)
            await unchanged_after_restart()

            # A clean stop writes a snapshot, and the next start begins from it.
            await asyncio.to_thread(registry.stop)
            await asyncio.to_thread(registry.start)
            await unchanged_after_restart()
            rebuilt = state_rebuilt_lines(registry)
            assert len(rebuilt) == 3, registry.log_tail()
            assert rebuilt[-1]["snapshot_seq"] > 0
    finally:
        # Left while the registry still answers, or each leave would retry for seconds.
        await asyncio.gather(*(worker.stop() for worker in workers))
        workers.clear()
        await asyncio.to_thread(registry.stop)


@pytest.mark.slow
async def test_neither_a_stalled_registry_nor_a_nats_outage_fails_live_workers(
    own_nats_server: NatsServer, tmp_path: Path, workers: list[strata.aio.Worker]
) -> None:
    url = own_nats_server.url
    registry = await asyncio.to_thread(start_registry, url, tmp_path)
    assert registry.proc is not None
    try:
        job = new_job("stall")
        started = await start_workers(workers, job, url, [f"w{i:02d}" for i in range(10)])
        # Frozen for twice the timeout (as a process starved of CPU would be) while the workers
        # keep heartbeating: their heartbeats wait in the registry's socket meanwhile.
        registry.proc.send_signal(signal.SIGSTOP)
        await asyncio.sleep(2 * TIMEOUT)
        registry.proc.send_signal(signal.SIGCONT)
        # NATS away for twice the timeout: nobody can be heard, so nobody may be blamed.
        await asyncio.to_thread(own_nats_server.stop)
        await asyncio.sleep(2 * TIMEOUT)
        await asyncio.to_thread(own_nats_server.start)
        # Proving that nobody fails takes watching for a while.
        await asyncio.sleep(QUIET_WINDOW)
        async with await Bus.connect(url, name="test-registry") as bus:
            assert failed_ids(await job_events(bus, job)) == []
        listed = await started[0].members(retry_for=10)
        assert listed.world_size == 10
        assert all(w.rejoin_count == 0 for w in started)
    finally:
        if registry.proc.poll() is None:
            registry.proc.send_signal(signal.SIGCONT)
        await asyncio.gather(*(worker.stop() for worker in workers))
        workers.clear()
        await asyncio.to_thread(registry.stop)


# -- malformed input ------------------------------------------------------------------------------


async def test_malformed_heartbeats_and_requests_are_refused_and_counted(
    registry: ServiceProcess, nats_url: str, bus: Bus, workers: list[strata.aio.Worker]
) -> None:
    job = new_job("bad")
    port = registry.health_port
    rejected_before, rpc_before = rejected_heartbeats(port), rpc_outcomes(port)

    to_self = subjects.heartbeat_subject(job, "w-a")
    other = heartbeat(job, "w-b")
    not_a_heartbeat = WorkerStateChanged(job=job, source="w-a", worker_id="w-a", state="training")
    out_of_bounds = pack(heartbeat(job, "w-a").model_dump() | {"seq": -1})
    sent = {
        "malformed": [(to_self, b"\xc1 not msgpack"), (to_self, b"")],
        "not_a_heartbeat": [(to_self, encode_event(not_a_heartbeat))],
        "subject_mismatch": [(to_self, encode_event(other))],
        "not_registered": [(subjects.heartbeat_subject(job, "w-b"), encode_event(other))],
        "invalid_field": [(to_self, out_of_bounds)],
    }
    for messages in sent.values():
        for subject, payload in messages:
            await bus.nc.publish(subject, payload)
    await bus.nc.flush()

    async def all_counted() -> bool:
        now = rejected_heartbeats(port)
        return all(
            now.get(code, 0) - rejected_before.get(code, 0) >= len(messages)
            for code, messages in sent.items()
        )

    await async_wait_until(all_counted, 5, "the registry to count every rejected heartbeat")
    counted = rejected_heartbeats(port)
    for code, messages in sent.items():
        assert counted.get(code, 0) - rejected_before.get(code, 0) == len(messages), code

    register = subjects.rpc_subject("registry", "register")
    requests: list[tuple[str, bytes, str, str]] = [
        (register, b"\x93\x01", "malformed", "register"),
        (register, pack([job, "instance"]), "invalid_request", "register"),
        (register, pack({"job": "bad job!", "instance": "i"}), "invalid_request", "register"),
        (register, pack({"job": job, "instance": "i", "rank": -1}), "invalid_request", "register"),
        (subjects.rpc_subject("registry", "frobnicate"), pack({}), "unknown_verb", "?"),
    ]
    for subject, payload, code, _ in requests:
        reply = unpack((await bus.nc.request(subject, payload, timeout=5)).data)
        assert reply["ok"] is False, reply
        assert reply["error"]["code"] == code, reply
        assert reply["error"]["message"]
    outcomes = rpc_outcomes(port)
    expected: dict[tuple[str, str], int] = {}
    for _, _, code, verb in requests:
        expected[(verb, code)] = expected.get((verb, code), 0) + 1
    for key, count in expected.items():
        assert outcomes.get(key, 0) - rpc_before.get(key, 0) == count, key

    # Still serving: a worker registers, and its heartbeats count.
    (worker,) = await start_workers(workers, job, nats_url, ["w-a"])
    assert (worker.rank, worker.world_size) == (0, 1)

    async def heartbeats_applied() -> bool:
        listed = await worker.members()
        return listed.members[0].last_heartbeat_ts is not None

    await async_wait_until(heartbeats_applied, 5, "the new worker's heartbeats")


# -- restarts under the same worker id, and requested ranks ---------------------------------------

RESTARTED_CHILD = """
import sys, time
import strata
worker = strata.Worker(job=sys.argv[1], nats_url=sys.argv[2], worker_id=sys.argv[3]).start()
print("registered", worker.instance, worker.rank, flush=True)
deadline = time.monotonic() + 60
while not worker.superseded and time.monotonic() < deadline:
    time.sleep(0.02)
print("superseded" if worker.superseded else "never-superseded", flush=True)
time.sleep(float(sys.argv[4]))  # keeps running, as a process that missed the news would
print("rejoins", worker.rejoin_count, flush=True)
worker.stop()
print("stopped", flush=True)
"""


def start_restarted_child(
    job: str, nats_url: str, worker_id: str, log_file: Path
) -> subprocess.Popen[str]:
    """A worker process of its own that reports its registration, then being superseded."""
    with log_file.open("w") as log:
        return subprocess.Popen(
            [sys.executable, "-c", RESTARTED_CHILD, job, nats_url, worker_id, str(QUIET_WINDOW)],
            env={**os.environ, Env.LOG_FORMAT: "json"},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            preexec_fn=procutil.child_preexec,
        )


def child_says(child: subprocess.Popen[str], first_word: str) -> list[str]:
    """The words of the child's next line, which must begin with `first_word`."""
    assert child.stdout is not None
    line = child.stdout.readline()
    assert line.split()[:1] == [first_word], f"{line!r}; the child exited with {child.poll()}"
    return line.split()


@pytest.mark.slow
async def test_a_second_process_with_the_same_worker_id_supersedes_the_first_at_once(
    registry: ServiceProcess,
    nats_url: str,
    bus: Bus,
    workers: list[strata.aio.Worker],
    tmp_path: Path,
) -> None:
    job = new_job("restart")
    others = await start_workers(workers, job, nats_url, ["other-0", "other-1"])
    log_file = tmp_path / "first.log"
    first = start_restarted_child(job, nats_url, "trainer", log_file)
    second = strata.aio.Worker(job, nats_url, worker_id="trainer", hostname="node-restarted")
    workers.append(second)
    try:
        _, first_instance, first_rank = await asyncio.to_thread(child_says, first, "registered")
        assert int(first_rank) == 2
        epoch_before = (await others[0].members()).membership_epoch
        # A restart faster than the heartbeat timeout, as torchrun's are: the first process
        # still heartbeats, so nothing but the new registration can end its registration.
        await second.start()
        assert (second.rank, second.world_size) == (2, 3)
        assert second.rejoined
        assert second.membership_epoch == epoch_before + 2
        assert (await asyncio.to_thread(child_says, first, "superseded")) == ["superseded"]
        # The old process then neither registers again nor leaves in the new one's name.
        assert (await asyncio.to_thread(child_says, first, "rejoins")) == ["rejoins", "0"]
        assert (await asyncio.to_thread(child_says, first, "stopped")) == ["stopped"]
        assert await asyncio.to_thread(first.wait, 30) == 0

        trainer = [
            e
            for e in await job_events(bus, job)
            if isinstance(e, WorkerRegistered | WorkerFailed | WorkerLeft)
            and e.worker_id == "trainer"
        ]
        assert [type(e) for e in trainer] == [WorkerRegistered, WorkerFailed, WorkerRegistered]
        registered_first, failed, registered_second = trainer
        assert isinstance(registered_first, WorkerRegistered)
        assert isinstance(failed, WorkerFailed)
        assert isinstance(registered_second, WorkerRegistered)
        assert registered_first.instance == first_instance
        assert failed.reason == f"{SUPERSEDED_REASON}, on node-restarted"
        assert (failed.rank, registered_second.rank) == (2, 2)
        assert registered_second.instance == second.instance
        assert failed.membership_epoch == epoch_before + 1
        assert registered_second.membership_epoch == epoch_before + 2
        listed = await second.members(include_gone=True)
        # The two others started together: which of them got rank 0 is a race.
        assert sorted((m.worker_id, m.rank, m.status, m.instance) for m in listed.members) == [
            ("other-0", others[0].rank, "idle", others[0].instance),
            ("other-1", others[1].rank, "idle", others[1].instance),
            ("trainer", 2, "idle", second.instance),
        ]
        records = [json.loads(line) for line in log_file.read_text().splitlines() if line]
        told = [r for r in records if r.get("event") == "worker_superseded"]
        assert [r["level"] for r in told] == ["error"], records
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()


async def test_requested_ranks_are_given_exactly_and_a_taken_one_is_refused_naming_its_holder(
    registry: ServiceProcess,
    nats_url: str,
    workers: list[strata.aio.Worker],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    job = new_job("ranks")
    asked = {"r5": 5, "r0": 0, "r2": 2}
    for worker_id, rank in asked.items():
        worker = strata.aio.Worker(job, nats_url, worker_id=worker_id, rank=rank, hostname="n-a")
        workers.append(worker)
        await worker.start()
        assert (worker.rank, worker.requested_rank) == (rank, rank)
    (lowest,) = await start_workers(workers, job, nats_url, ["any"])
    assert (lowest.rank, lowest.requested_rank, lowest.world_size) == (1, None, 4)

    taken = strata.aio.Worker(job, nats_url, worker_id="intruder", rank=5)
    with pytest.raises(strata.ConflictError) as refused:
        await taken.start()
    assert not isinstance(refused.value, strata.WorkerSuperseded)
    assert refused.value.code == "conflict"
    message = refused.value.message
    assert "rank 5" in message
    assert "'r5'" in message
    assert "n-a" in message
    assert "ask for a free rank" in message
    assert not taken.started
    listed = await lowest.members()
    assert [(m.worker_id, m.rank) for m in listed.members] == [
        ("r0", 0),
        ("any", 1),
        ("r2", 2),
        ("r5", 5),
    ]

    # From the environment when rank= is not given (e.g. STRATA_RANK=$RANK in a launcher).
    monkeypatch.setenv(Env.RANK, "7")
    from_env = strata.aio.Worker(job, nats_url, worker_id="from-env")
    workers.append(from_env)
    await from_env.start()
    assert (from_env.rank, from_env.requested_rank) == (7, 7)
    explicit = strata.aio.Worker(job, nats_url, worker_id="explicit", rank=3)
    workers.append(explicit)
    assert (await explicit.start()).rank == 3
    with pytest.raises(strata.ValidationError, match="rank"):
        strata.aio.Worker(job, nats_url, rank=10_000)
    monkeypatch.setenv(Env.RANK, "-1")
    with pytest.raises(strata.ConfigError, match="STRATA_RANK"):
        strata.aio.Worker(job, nats_url)


# -- jobs are isolated ----------------------------------------------------------------------------


@pytest.mark.slow
async def test_jobs_with_the_same_worker_ids_are_isolated(
    registry: ServiceProcess, nats_url: str, bus: Bus, workers: list[strata.aio.Worker]
) -> None:
    job_a, job_b = new_job("iso-a"), new_job("iso-b")
    ids = ["alpha", "beta", "gamma"]
    in_a = {w: (await start_workers(workers, job_a, nats_url, [w]))[0] for w in ids}
    in_b = {w: (await start_workers(workers, job_b, nats_url, [w]))[0] for w in reversed(ids)}
    assert [in_a[w].rank for w in ids] == [0, 1, 2]
    assert [in_b[w].rank for w in ids] == [2, 1, 0]
    b_before = await in_b["alpha"].members(include_gone=True)
    assert b_before.membership_epoch == 3

    in_a["alpha"]._suspend_heartbeats(True)

    async def alpha_failed_in_a() -> bool:
        listed = await in_a["beta"].members(include_gone=True)
        return any(m.worker_id == "alpha" and m.status == "failed" for m in listed.members)

    await async_wait_until(alpha_failed_in_a, 5 * TIMEOUT, "alpha to be failed in job A")
    # A new worker in A takes the freed rank 0; B must see none of it.
    (delta,) = await start_workers(workers, job_a, nats_url, ["delta"])
    assert delta.rank == 0

    # Proving that B is untouched takes watching for a while.
    await asyncio.sleep(QUIET_WINDOW)
    b_after = await in_b["alpha"].members(include_gone=True)
    assert membership(b_after) == membership(b_before)
    assert b_after.membership_epoch == b_before.membership_epoch
    assert failed_ids(await job_events(bus, job_b)) == []
    assert failed_ids(await job_events(bus, job_a)) == ["alpha"]
    a_after = await in_a["beta"].members()
    assert [(m.worker_id, m.rank) for m in a_after.members] == [
        ("delta", 0),
        ("beta", 1),
        ("gamma", 2),
    ]


# -- the fast heartbeat decoder -------------------------------------------------------------------

_IDS = st.sampled_from(["w-1", "a" * 128, "a" * 129, "w 1", "w-1\n", "", "-w", "w.1_x"])
_INTS = st.sampled_from([0, 1, -1, 2**31 - 1, 2**31, 2**50, 2**50 + 1, 2**62, 2**62 + 1])
_FLOATS = st.sampled_from([0.0, -0.0, 12.5, 100.0, 100.5, 100_000.0, 1e6, math.inf, math.nan])
_ODD = st.sampled_from([None, True, False, 3, 3.5, "3", b"w-1", [1], {"a": 1}])
_VALUES = st.one_of(_IDS, _INTS, _FLOATS, _ODD, st.sampled_from(["idle", "failed", "Idle"]))


@given(
    changes=st.dictionaries(
        st.sampled_from([*WorkerHeartbeat.model_fields, "extra"]),
        st.one_of(_VALUES, st.just("<drop>")),
        max_size=3,
    ),
    cpu=st.one_of(st.none(), _FLOATS),
)
def test_the_fast_decoder_never_accepts_what_the_model_refuses(
    changes: dict[str, Any], cpu: float | None
) -> None:
    data = heartbeat("job-1", "w-1").model_dump() | {"cpu_percent": cpu}
    for key, value in changes.items():
        if value == "<drop>":
            data.pop(key, None)
        else:
            data[key] = value
    payload = msgpack.packb(data, use_bin_type=True)
    beat = fast_beat(payload)
    try:
        event: AnyEvent | None = decode_event(payload)
    except StrataError:
        event = None
    if beat is None:
        return
    assert isinstance(event, WorkerHeartbeat), (data, event)
    assert beat == (
        event.job,
        event.worker_id,
        event.instance,
        event.seq,
        event.state,
        event.step,
        event.epoch,
    )


def test_the_fast_decoder_takes_what_the_sdk_sends() -> None:
    sent = heartbeat("job-1", "w.1", cpu_percent=97.5, rss_bytes=2**31, state="training")
    assert fast_beat(encode_event(sent)) == ("job-1", "w.1", "i-w.1", 1, "training", 0, 0)


async def test_a_job_start_reaches_each_worker_as_a_few_world_notices_not_an_event_per_worker(
    registry: ServiceProcess, nats_url: str, bus: Bus, workers: list[strata.aio.Worker]
) -> None:
    """Every worker used to receive every other worker's membership events: O(N^2) messages at a
    job's start. Now each hears the registry's coalesced world notices, a number that does not
    grow with N, and still ends with the right world."""
    job = new_job("world")
    notices: list[tuple[int, int]] = []
    membership_events = 0

    async def on_notice(msg: Msg) -> None:
        raw = msgpack.unpackb(msg.data)
        notices.append((raw["membership_epoch"], raw["world_size"]))

    async def on_event(msg: Msg) -> None:
        nonlocal membership_events
        membership_events += 1

    await bus.nc.subscribe(subjects.world_subject(job), cb=on_notice)
    await bus.nc.subscribe(subjects.event_subject(job, "worker.registered"), cb=on_event)
    await bus.nc.flush()
    count = 120
    started = await start_workers(workers, job, nats_url, numbered(count), group=count)

    async def everyone_sees_the_whole_world() -> bool:
        return all(w.world_size == count for w in started)

    await async_wait_until(everyone_sees_the_whole_world, 10, "every worker to see 120 workers")
    assert membership_events == count
    assert notices, "no world notice was published"
    assert notices[-1][1] == count
    # A burst of 120 registrations, gathered into notices 50 ms apart (and a repeat every 2 s).
    assert len(notices) <= count // 4, f"{len(notices)} notices for {count} registrations"
    assert [epoch for epoch, _ in notices] == sorted(epoch for epoch, _ in notices)
