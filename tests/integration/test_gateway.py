"""The gateway's API against a running stack: real services, a gateway process, a simulated job.

Workers drive registry, sharding, barrier (and checkpoint) service processes through the SDK;
the gateway process folds what they publish. The dashboard, pagination, history, push stream and
replay are read over HTTP, and the property that matters most is checked end to end: a job's
history exported and rebuilt offline (`strata export`, `strata replay --state`) equals the
gateway's live dashboard, live rates aside.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import strata
from pydantic import TypeAdapter
from strata import procutil
from strata.aio import DatasetRegistry as AsyncDatasetRegistry
from strata.bus import Bus
from strata.cli.main import main as cli
from strata.config import Env, load_settings
from strata.history import job_history
from strata.services.gateway.app import API_TOKEN_ENV
from strata.services.gateway.live import LiveModel
from strata.services.gateway.service import Gateway
from strata.services.readmodel import JobState, render_dashboard
from strata.services.readmodel.views import Dashboard

from tests import support
from tests.golden.scenario import Scenario, checkpoint_service_available
from tests.support import ServiceProcess

pytestmark = pytest.mark.nats

LIVE_RATES = ("events_per_s", "requests_per_s", "heartbeats_per_s")
Document = dict[str, Any]


@dataclass
class Stack:
    url: str
    nats_url: str
    checkpoints: bool


@pytest.fixture(scope="module")
def stack(nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    log_dir = tmp_path_factory.mktemp("gateway")
    checkpoints = checkpoint_service_available()
    names = ["registry", "sharding", "barrier"] + (["checkpoint"] if checkpoints else [])
    port = procutil.free_port()
    processes = [ServiceProcess(name, nats_url, log_dir) for name in names]
    processes.append(ServiceProcess("gateway", nats_url, log_dir, env={Env.HTTP_PORT: str(port)}))
    # Started side by side: one after the other, five Python processes take most of a minute
    # on a busy machine.
    with ThreadPoolExecutor(len(processes)) as pool:
        starting = [pool.submit(process.start) for process in processes]
        try:
            for future in starting:
                future.result()
            yield Stack(f"http://127.0.0.1:{port}", nats_url, checkpoints)
        finally:
            for stopping in [pool.submit(process.stop) for process in processes]:
                stopping.result()


@pytest.fixture
async def http(stack: Stack) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=stack.url, timeout=10.0) as client:
        yield client


async def start_workers(
    made: list[strata.aio.Worker], job: str, nats_url: str, count: int
) -> list[strata.aio.Worker]:
    new = [
        strata.aio.Worker(job, nats_url, worker_id=f"w{i:02d}", hostname=f"host-{i % 2}")
        for i in range(count)
    ]
    made.extend(new)
    await asyncio.gather(*(worker.start() for worker in new))
    return new


async def get(http: httpx.AsyncClient, path: str, **params: Any) -> Any:
    answer = await http.get(path, params=params)
    assert answer.status_code == 200, answer.text
    return answer.json()


async def dashboard_when(
    http: httpx.AsyncClient,
    job: str,
    condition: Callable[[Document], bool],
    what: str,
    timeout: float = 10.0,
) -> Document:
    found: Document = {}

    async def ready() -> bool:
        nonlocal found
        answer = await http.get("/api/dashboard", params={"job": job})
        found = answer.json() if answer.status_code == 200 else {}
        return bool(found) and condition(found)

    await support.async_wait_until(ready, timeout, what)
    return found


def by_id(document: Document) -> dict[str, Document]:
    return {worker["id"]: worker for worker in document["workers"]}


def without_live_rates(document: Document) -> Document:
    return {**document, "metrics": {**document["metrics"], **dict.fromkeys(LIVE_RATES)}}


# -- the dashboard and history --------------------------------------------------------------------


async def test_the_dashboard_follows_a_running_job(
    stack: Stack, http: httpx.AsyncClient, workers: list[strata.aio.Worker]
) -> None:
    job = support.new_job("gw")
    team = await start_workers(workers, job, stack.nats_url, 3)
    await AsyncDatasetRegistry(team[0]).register_dataset(
        "ds", total_samples=600, shard_size=10, seed=5
    )

    async def train(worker: strata.aio.Worker) -> None:
        registry = AsyncDatasetRegistry(worker)
        shards = (await registry.assignment("ds", epoch=0)).shards
        await worker.set_state("training", step=20, epoch=1)
        await registry.report_progress("ds", 0, completed=[shards[0].shard_id])
        await worker.barrier("step-20", timeout=30)

    await asyncio.gather(*(train(w) for w in team))

    def settled(doc: Document) -> bool:
        rows = doc["workers"]
        return (
            [(w["status"], w["step"], w["epoch"]) for w in rows] == [("training", 20, 1)] * 3
            and bool(doc["barriers"])
            and doc["barriers"][0]["status"] == "released"
            and doc["barriers"][0]["arrived"] == 3  # arrivals are recorded after the release
            and doc["datasets"][0]["done_shards"] == 3
            and all(doc["metrics"][rate] for rate in LIVE_RATES)
        )

    doc = await dashboard_when(http, job, settled, "the job to train, with live rates")
    TypeAdapter(Dashboard).validate_python(doc)
    assert doc["job"] == job
    assert [w["rank"] for w in doc["workers"]] == [0, 1, 2]
    assert {w["id"] for w in doc["workers"]} == {"w00", "w01", "w02"}
    assert {w["hostname"] for w in doc["workers"]} == {"host-0", "host-1"}
    assert all(isinstance(w["last_heartbeat"], int) for w in doc["workers"])
    assert [w["shards"] for w in doc["workers"]] == [20, 20, 20]
    (dataset,) = doc["datasets"]
    assert (dataset["num_shards"], dataset["epoch"], dataset["plan_version"]) == (60, 0, 0)
    assert dataset["loads"] == {"w00": 20, "w01": 20, "w02": 20}
    (barrier,) = doc["barriers"]
    assert (barrier["name"], barrier["arrived"], barrier["expected"]) == ("step-20", 3, 3)
    assert barrier["latency_ms"] is not None
    metrics = doc["metrics"]
    assert metrics["shard_distribution"] == {"max_over_mean": 1.0, "min": 20, "max": 20}
    assert metrics["barrier_p99_ms"] == barrier["latency_ms"]
    assert doc["recent_events"][-1]["seq"] == doc["seq"]
    assert doc["ts"] == doc["recent_events"][-1]["ts"]

    listed = {row["job"]: row for row in (await get(http, "/api/jobs"))["jobs"]}
    assert listed[job]["workers"] == listed[job]["live"] == 3
    assert listed[job]["last_event_ts"] >= doc["ts"]
    assert listed[job]["events"] >= len(doc["recent_events"])

    # History, a page at a time, and filtered by type on the server or here.
    page = await get(http, f"/api/jobs/{job}/events", limit=5)
    assert [item["seq"] for item in page["items"]] == sorted(i["seq"] for i in page["items"])
    assert page["last_seq"] == page["items"][-1]["seq"]
    assert page["items"][0]["event"]["type"] == "worker.registered"
    assert page["items"][0]["event"]["job"] == job
    following = await get(http, f"/api/jobs/{job}/events", after_seq=page["last_seq"], limit=5)
    assert following["items"][0]["seq"] > page["last_seq"]
    barriers = await get(http, f"/api/jobs/{job}/events", type="barrier.")
    # The barrier service records arrivals once it has released (or when the barrier is quiet).
    types = [i["type"] for i in barriers["items"]]
    assert types[0] == "barrier.opened"
    assert sorted(types[1:]) == ["barrier.arrived"] * 3 + ["barrier.released"]
    for prefix in ("worker.registered", "worker.reg"):
        registered = await get(http, f"/api/jobs/{job}/events", type=prefix)
        assert {i["event"]["worker_id"] for i in registered["items"]} == {"w00", "w01", "w02"}
        assert len(registered["items"]) == 3
    beyond = await get(http, f"/api/jobs/{job}/events", after_seq=10**9)
    assert beyond == {"items": [], "last_seq": 10**9}


async def test_workers_are_paged_and_filtered_by_status(
    stack: Stack, http: httpx.AsyncClient, workers: list[strata.aio.Worker]
) -> None:
    job = support.new_job("gw")
    team = await start_workers(workers, job, stack.nats_url, 24)
    await asyncio.gather(*(w.set_state("training", step=1) for w in team[:6]))
    await dashboard_when(
        http,
        job,
        lambda d: sum(w["status"] == "training" for w in d["workers"]) == 6,
        "six of 24 workers to train",
    )
    path = f"/api/jobs/{job}/workers"
    pages = [await get(http, path, offset=offset, limit=10) for offset in (0, 10, 20)]
    assert [page["total"] for page in pages] == [24, 24, 24]
    assert [len(page["items"]) for page in pages] == [10, 10, 4]
    assert [w["rank"] for page in pages for w in page["items"]] == list(range(24))
    training = await get(http, path, status="training", limit=100)
    assert training["total"] == 6
    assert {w["id"] for w in training["items"]} == {w.id for w in team[:6]}
    assert (await get(http, path, status="training,idle"))["total"] == 24
    assert (await http.get(path, params={"status": "sleeping"})).status_code == 422
    assert (await http.get(path, params={"limit": 0})).status_code == 422
    assert (await http.get("/api/jobs/no-such-job/workers")).status_code == 404
    assert (await http.get("/api/dashboard", params={"job": "no-such-job"})).status_code == 404
    assert (await http.get("/api/dashboard", params={"job": "bad job!"})).status_code == 422


# -- live pushes ----------------------------------------------------------------------------------


async def pushes(response: httpx.Response) -> AsyncIterator[tuple[float, Document]]:
    """(arrival time, dashboard) of each `event: dashboard` of a Server-Sent Events body."""
    kind, data = "", ""
    async for line in response.aiter_lines():
        if line.startswith("event: "):
            kind = line[len("event: ") :]
        elif line.startswith("data: "):
            data = line[len("data: ") :]
        elif not line and kind:
            if kind == "dashboard":
                yield time.monotonic(), json.loads(data)
            kind, data = "", ""


async def next_push(
    stream: AsyncIterator[tuple[float, Document]],
    condition: Callable[[Document], bool],
    timeout: float,
) -> tuple[float, Document]:
    async def wait() -> tuple[float, Document]:
        async for arrived, document in stream:
            if condition(document):
                return arrived, document
        raise AssertionError("the push stream ended")

    return await asyncio.wait_for(wait(), timeout)


async def test_the_push_stream_delivers_a_change_within_a_second(
    stack: Stack, http: httpx.AsyncClient, workers: list[strata.aio.Worker]
) -> None:
    job = support.new_job("gw")
    first, _ = await start_workers(workers, job, stack.nats_url, 2)
    async with http.stream("GET", "/api/stream", params={"job": job}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        stream = pushes(response)
        await next_push(stream, lambda d: len(d["workers"]) == 2, timeout=10)

        changed_at = time.monotonic()
        await first.set_state("checkpointing", step=7)
        arrived, document = await next_push(
            stream, lambda d: by_id(d)["w00"]["status"] == "checkpointing", timeout=5
        )
        # Within a second on a quiet machine; the margin here holds on a loaded one.
        assert arrived - changed_at < 3.0
        assert by_id(document)["w00"]["step"] == 7

        # Heartbeats change the dashboard ten times a second here (two workers, five each);
        # pushes are coalesced to at most four a second. Counted over a few seconds rather than
        # gap by gap: on a loaded machine pushes can reach the client bunched.
        times = [arrived]
        while times[-1] - arrived < 4.0:
            times.append((await next_push(stream, lambda d: True, timeout=5))[0])
        span = times[-1] - times[0]
        assert len(times) - 1 <= 4 * span + 2


# -- failures and replay --------------------------------------------------------------------------


async def test_a_failed_worker_shows_as_failed_and_a_replay_before_shows_it_alive(
    stack: Stack, http: httpx.AsyncClient, workers: list[strata.aio.Worker]
) -> None:
    job = support.new_job("gw")
    team = await start_workers(workers, job, stack.nats_url, 3)
    await asyncio.gather(*(w.set_state("training", step=3) for w in team))
    await dashboard_when(
        http,
        job,
        lambda d: all(w["status"] == "training" and w["step"] == 3 for w in d["workers"]),
        "three training workers",
    )
    team[2]._suspend_heartbeats(True)
    doc = await dashboard_when(
        http, job, lambda d: by_id(d)["w02"]["status"] == "failed", "w02 to be failed"
    )
    failed = next(e for e in doc["recent_events"] if e["type"] == "worker.failed")
    assert "w02" in failed["summary"]

    before = await get(http, "/api/replay", job=job, seq=failed["seq"] - 1, telemetry="true")
    TypeAdapter(Dashboard).validate_python(before)
    assert by_id(before)["w02"]["status"] == "training"
    assert by_id(before)["w02"]["last_heartbeat"] is not None
    assert before["seq"] < failed["seq"]
    assert all(before["metrics"][rate] is None for rate in LIVE_RATES)
    at_time = await get(http, "/api/replay", job=job, at=failed["ts"] - 1)
    assert by_id(at_time)["w02"]["status"] == "training"
    after = await get(http, "/api/replay", job=job, seq=failed["seq"])
    assert by_id(after)["w02"]["status"] == "failed"
    assert by_id(after)["w00"]["status"] == "training"

    assert (await http.get("/api/replay", params={"job": job})).status_code == 422
    both: dict[str, str | int] = {"job": job, "seq": 1, "at": 1}
    assert (await http.get("/api/replay", params=both)).status_code == 422
    nothing: dict[str, str | int] = {"job": "no-such-job", "seq": 5}
    missing = await http.get("/api/replay", params=nothing)
    assert missing.status_code == 404
    assert missing.json()["code"] == "not_found"
    # Heartbeats only when asked for: the statuses come from events alone.
    lean = await get(http, "/api/replay", job=job, seq=failed["seq"] - 1)
    assert by_id(lean)["w02"]["status"] == "training"
    assert all(w["last_heartbeat"] is None for w in lean["workers"])


@pytest.mark.slow
async def test_replaying_the_whole_stream_gives_exactly_the_live_dashboard(
    stack: Stack, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    job = support.new_job("gw")
    root = tmp_path / "checkpoints" if stack.checkpoints else None
    await Scenario(job, stack.nats_url, checkpoint_root=root).run()
    live: Document = {}
    async with await Bus.connect(stack.nats_url, name="gateway-test") as bus:

        async def live_equals_replay() -> bool:
            nonlocal live
            rebuilt = JobState(job)
            async for record in job_history(bus.js, job, telemetry=True):
                rebuilt.apply(record)
            live = await get(http, "/api/dashboard", job=job)
            return without_live_rates(live) == render_dashboard(rebuilt)

        # The job has ended; the services may still be reacting to its last events.
        await support.async_wait_until(live_equals_replay, 15, "the gateway to settle")

        # A gateway started now (a restart) reads only the last heartbeat of each worker, and
        # shows the same.
        restarted = await LiveModel().start(bus)
        try:

            async def restarted_agrees() -> bool:
                state = restarted.job(job)
                return state is not None and render_dashboard(state) == without_live_rates(live)

            await support.async_wait_until(restarted_agrees, 15, "a restarted gateway to agree")
        finally:
            await restarted.stop()

    assert {w["status"] for w in live["workers"]} == {"left", "failed"}
    assert any(b["status"] == "broken" for b in live["barriers"])
    if stack.checkpoints:
        assert live["checkpoints"][0]["status"] == "committed"

    # The same through the command line: export, then rebuild with no server at all.
    exported = tmp_path / "job.jsonl"
    args = ["export", "--job", job, "--nats-url", stack.nats_url, "--output", str(exported)]
    assert await asyncio.to_thread(cli, args) == 0
    offline = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "strata", "replay", "--file", str(exported), "--state"],
        capture_output=True,
        text=True,
        check=True,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), Env.NATS_URL: "nats://127.0.0.1:1"},
    )
    assert json.loads(offline.stdout) == without_live_rates(live)
    replayed = await get(http, "/api/replay", job=job, seq=live["seq"], telemetry="true")
    assert replayed == without_live_rates(live)

    # And straight from NATS: the state, and the timeline of one kind of event.
    async def strata(*args: str) -> str:
        command = [sys.executable, "-m", "strata", "replay", "--job", job, *args]
        done = await asyncio.to_thread(
            subprocess.run,
            [*command, "--nats-url", stack.nats_url],
            capture_output=True,
            text=True,
            check=True,
        )
        return done.stdout

    assert json.loads(await strata("--state", "--heartbeats")) == without_live_rates(live)
    (line,) = (await strata("--type", "worker.failed")).splitlines()
    assert "worker.failed" in line
    assert "no heartbeat for" in line


# -- token, probes, documentation -----------------------------------------------------------------


@contextlib.asynccontextmanager
async def own_gateway(
    stack: Stack, api_token: str | None = None, **settings: Any
) -> AsyncIterator[Gateway]:
    """A gateway of the test's own, in this process, with its own settings."""
    bus = await Bus.connect(stack.nats_url, name="gateway-own-test")
    gateway = Gateway(host="127.0.0.1", api_token=api_token)
    try:
        await gateway.start(bus, load_settings(nats_url=stack.nats_url, http_port=0, **settings))
        yield gateway
    finally:
        await gateway.stop()
        await bus.close()


async def test_an_api_token_guards_the_api_but_not_the_probes(stack: Stack) -> None:
    async with (
        own_gateway(stack, api_token="s3cret") as gateway,
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{gateway.port}") as http,
    ):
        for probe in ("/healthz", "/metrics"):
            assert (await http.get(probe)).status_code == 200
        refused = await http.get("/api/jobs")
        assert refused.status_code == 401
        assert refused.headers["www-authenticate"] == "Bearer"
        assert refused.json()["code"] == "unauthorized"
        assert API_TOKEN_ENV in refused.json()["detail"]
        wrong = {"Authorization": "Bearer nope"}
        assert (await http.get("/api/jobs", headers=wrong)).status_code == 401
        right = {"Authorization": "Bearer s3cret"}
        assert (await http.get("/api/jobs", headers=right)).status_code == 200
        # The push stream takes the header too (the dashboard reads it with fetch) ...
        stream = {"job": "any-job"}
        async with http.stream("GET", "/api/stream", params=stream, headers=right) as response:
            assert response.status_code == 200
            assert await anext(response.aiter_lines()) == ": connected"
        # ... and never a token in the URL, where logs and browser history would keep it.
        for path, params in (("/api/jobs", {}), ("/api/stream", stream)):
            in_url = await http.get(path, params={**params, "access_token": "s3cret"})
            assert in_url.status_code == 401
            assert "Authorization: Bearer" in in_url.json()["detail"]
            assert "URL" in in_url.json()["detail"]


# -- bounded replays -----------------------------------------------------------------------------


async def _job_with_events(stack: Stack, workers: list[strata.aio.Worker]) -> tuple[str, int]:
    """A job of three workers that changed state a few times; its id and its last event's seq."""
    job = support.new_job("gw")
    team = await start_workers(workers, job, stack.nats_url, 3)
    for step, status in enumerate(("loading", "training", "checkpointing")):
        await asyncio.gather(*(w.set_state(status, step=step) for w in team))
    seqs: list[int] = []

    async def stored() -> bool:
        nonlocal seqs
        async with await Bus.connect(stack.nats_url, name="gateway-test") as bus:
            records = [r async for r in job_history(bus.js, job, telemetry=False)]
        seqs = [r.seq for r in records]
        return sum(r.event.type == "worker.state_changed" for r in records) >= 9

    await support.async_wait_until(stored, 10, "the state changes to be stored")
    return job, seqs[-1]


async def test_a_replay_folding_too_much_is_refused_with_how_to_ask_for_less(
    stack: Stack, workers: list[strata.aio.Worker]
) -> None:
    job, last_seq = await _job_with_events(stack, workers)
    async with (
        own_gateway(stack, replay_max_events=5) as gateway,
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{gateway.port}") as http,
    ):
        refused = await http.get("/api/replay", params={"job": job, "seq": last_seq})
        assert refused.status_code == 422
        body = refused.json()
        assert body["code"] == "too_large"
        assert "more than 5 events" in body["detail"]
        assert "earlier point" in body["detail"]
        with_beats = {"job": job, "seq": last_seq, "telemetry": "true"}
        assert "telemetry=false" in (await http.get("/api/replay", params=with_beats)).text
        # Within the bound, the same job replays.
        async with await Bus.connect(stack.nats_url, name="gateway-test") as bus:
            fifth = [r async for r in job_history(bus.js, job, telemetry=False)][4].seq
        early = await http.get("/api/replay", params={"job": job, "seq": fifth})
        assert early.status_code == 200, early.text
        assert early.json()["seq"] == fifth


async def test_a_replay_past_its_deadline_is_refused(
    stack: Stack, workers: list[strata.aio.Worker]
) -> None:
    job, last_seq = await _job_with_events(stack, workers)
    # A microsecond: over at the first read from JetStream.
    async with (
        own_gateway(stack, replay_timeout=1e-6) as gateway,
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{gateway.port}") as http,
    ):
        late = await http.get("/api/replay", params={"job": job, "seq": last_seq})
        assert late.status_code == 504
        assert late.json()["code"] == "deadline_exceeded"
        assert "took more than" in late.json()["detail"]
        # The slot is free again: a refused replay does not hold it.
        assert gateway.app is not None
        assert gateway.app.state.replays.running == 0


async def test_replays_beyond_the_concurrency_bound_are_refused_until_one_ends(
    stack: Stack, workers: list[strata.aio.Worker]
) -> None:
    job, last_seq = await _job_with_events(stack, workers)
    params = {"job": job, "seq": last_seq}
    async with (
        own_gateway(stack, replay_concurrency=1) as gateway,
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{gateway.port}") as http,
    ):
        assert gateway.app is not None
        slots = gateway.app.state.replays
        # A replay in progress holds the only slot (held here: a real one ends too soon to race).
        with slots.hold():
            busy = await http.get("/api/replay", params=params)
            assert busy.status_code == 429
            assert busy.json()["code"] == "busy"
            assert busy.headers["retry-after"] == "1"
            assert "STRATA_REPLAY_CONCURRENCY" in busy.json()["detail"]
        assert (await http.get("/api/replay", params=params)).status_code == 200
        assert slots.running == 0


async def test_strata_replay_from_nats_is_bounded_too(
    stack: Stack, workers: list[strata.aio.Worker]
) -> None:
    job, _ = await _job_with_events(stack, workers)
    command = [sys.executable, "-m", "strata", "replay", "--job", job, "--state"]
    command += ["--nats-url", stack.nats_url]
    done = await asyncio.to_thread(
        subprocess.run, [*command, "--max-events", "5"], capture_output=True, text=True
    )
    assert done.returncode == 1
    assert "too_large" in done.stderr
    assert "--until-seq" in done.stderr
    done = await asyncio.to_thread(
        subprocess.run, [*command, "--timeout", "0.000001"], capture_output=True, text=True
    )
    assert done.returncode == 1
    assert "deadline_exceeded" in done.stderr
    whole = await asyncio.to_thread(subprocess.run, command, capture_output=True, text=True)
    assert whole.returncode == 0, whole.stderr
    assert json.loads(whole.stdout)["job"] == job


async def test_probes_metrics_and_the_openapi_document(
    stack: Stack, http: httpx.AsyncClient
) -> None:
    assert (await get(http, "/healthz")) == {"status": "ok"}
    assert (await get(http, "/readyz")) == {"ready": True, "detail": "ok"}
    metrics = (await http.get("/metrics")).text
    assert 'strata_gateway_folded_total{kind="event"}' in metrics
    assert "strata_gateway_stream_clients" in metrics
    openapi = await get(http, "/openapi.json")
    for path in (
        "/api/jobs",
        "/api/dashboard",
        "/api/jobs/{job}/workers",
        "/api/jobs/{job}/events",
        "/api/replay",
        "/api/stream",
    ):
        assert path in openapi["paths"], path
    schema = openapi["components"]["schemas"]
    assert set(schema["Dashboard"]["properties"]) == set(Dashboard.__required_keys__)
    assert "HTTPBearer" in openapi["components"]["securitySchemes"]
    assert (await http.get("/docs")).status_code == 200
