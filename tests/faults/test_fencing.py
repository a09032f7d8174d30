"""Fencing under faults: a worker paused or cut off past its heartbeat timeout trains nothing twice.

Three worker processes read one epoch of a dataset through the public SDK, each keeping a
ledger of every batch it drew, trained and had counted (`fencing_worker`). One of them is
paused (SIGSTOP, 3.2 s with a 3 s heartbeat timeout) or has its NATS connection held by a proxy
(4 s) in the middle of a shard, until the registry has failed it. Then:

- every sample of the epoch is counted exactly once across the job;
- the old instance's late report is refused (`stale_lease`), not accepted silently;
- the old instance draws no sample once its lease may have expired;
- the worker comes back as a new instance and reads on from the plan.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from strata import procutil
from strata.bus import Bus
from strata.bus.server import NatsServer
from strata.config import Env
from strata.events.requests import MembersRequest, MembersResult

from tests.faults.netproxy import Proxy
from tests.support import new_job, running_services, wait_until

pytestmark = [pytest.mark.nats, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
HEARTBEAT_INTERVAL = 1.0
HEARTBEAT_TIMEOUT = 3.0
PAUSE_S = 3.2
HOLD_S = 4.0
WORKERS = ("w0", "w1", "w2")
VICTIM = "w0"
SAMPLES = 2400
SHARD_SIZE = 48
BATCH = 8
STEP_S = 0.04
COUNTED_BEFORE_FAULT = 12
"""Batches the victim has had counted before the fault: it is well inside its shards."""
JOB_DEADLINE_S = 240.0
FAILED_DEADLINE_S = 30.0
SLACK_S = 1.0
"""Between the sampler's check of the lease and the worker noting the time of the draw."""


@dataclass
class Ledger:
    records: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def read(cls, paths: list[Path]) -> Ledger:
        records = []
        for path in paths:
            if path.exists():
                records += [json.loads(line) for line in path.read_text().splitlines() if line]
        return cls(records)

    def of(self, kind: str, worker: str | None = None) -> list[dict[str, Any]]:
        return [r for r in self.records if r["kind"] == kind and worker in (None, r["worker"])]

    def counted(self, epoch: int = 0) -> Counter[int]:
        return Counter(i for r in self.of("counted") if r["epoch"] == epoch for i in r["samples"])

    def instances(self, worker: str) -> list[str]:
        seen = dict.fromkeys(i for r in self.of("drawn", worker) for i in r["instances"])
        return list(seen)

    def draws(self, worker: str, instance: str) -> list[float]:
        """When each sample `worker` drew under `instance` was drawn (monotonic clock)."""
        return [
            at
            for r in self.of("drawn", worker)
            for i, at in zip(r["instances"], r["at"], strict=True)
            if i == instance
        ]


def _is_failed(nats_url: str, job: str, worker: str) -> bool:
    async def ask() -> bool:
        bus = await Bus.connect(nats_url, deadline=10)
        try:
            result: MembersResult = await bus.rpc.call(
                "registry",
                "members",
                MembersRequest(job=job, include_gone=True),
                result=MembersResult,
                timeout=5,
            )
        finally:
            await bus.close()
        return any(m.worker_id == worker and m.status == "failed" for m in result.members)

    return asyncio.run(ask())


@contextmanager
def training_job(
    tmp_path: Path, nats_url: str, victim_url: str
) -> Iterator[tuple[str, dict[str, subprocess.Popen[bytes]], list[Path]]]:
    """Registry and sharding services, and a worker process per id (the victim on `victim_url`)."""
    job = new_job("fence")
    logs = tmp_path / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    env = {
        Env.HEARTBEAT_INTERVAL: str(HEARTBEAT_INTERVAL),
        Env.HEARTBEAT_TIMEOUT: str(HEARTBEAT_TIMEOUT),
    }
    ledgers = [tmp_path / f"ledger-{worker}.jsonl" for worker in WORKERS]
    procs: dict[str, subprocess.Popen[bytes]] = {}
    with running_services(nats_url, logs, ("registry", "sharding"), env=env):
        try:
            for worker, ledger in zip(WORKERS, ledgers, strict=True):
                with (logs / f"worker-{worker}.log").open("ab") as log:
                    procs[worker] = subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            "tests.faults.fencing_worker",
                            *("--nats-url", victim_url if worker == VICTIM else nats_url),
                            *("--job", job, "--worker-id", worker, "--ledger", str(ledger)),
                            *("--samples", str(SAMPLES), "--shard-size", str(SHARD_SIZE)),
                            *("--batch-size", str(BATCH), "--step-s", str(STEP_S)),
                        ],
                        cwd=ROOT,
                        env={**os.environ, Env.LOG_FORMAT: "json"},
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
            yield job, procs, ledgers
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    os.kill(proc.pid, signal.SIGCONT)
                procutil.terminate(proc, timeout=10)


def _wait_for_batches(ledgers: list[Path]) -> None:
    wait_until(
        lambda: len(Ledger.read(ledgers).of("counted", VICTIM)) >= COUNTED_BEFORE_FAULT,
        60,
        f"{VICTIM} to have {COUNTED_BEFORE_FAULT} batches counted",
    )


def _finish(procs: dict[str, subprocess.Popen[bytes]], tmp_path: Path) -> None:
    deadline = time.monotonic() + JOB_DEADLINE_S
    for worker, proc in procs.items():
        try:
            code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            code = None
        if code != 0:
            tail = (tmp_path / "logs" / f"worker-{worker}.log").read_text(errors="replace")
            pytest.fail(f"worker {worker} ended with {code}:\n{tail[-4000:]}")


def _check_exactly_once_and_fenced(ledger: Ledger, last_old_draw_bound: float) -> None:
    counted = ledger.counted()
    twice = sorted(i for i, n in counted.items() if n > 1)
    missing = sorted(set(range(SAMPLES)) - set(counted))
    assert (twice[:20], missing[:20]) == ([], []), (len(twice), len(missing))

    instances = ledger.instances(VICTIM)
    assert len(instances) >= 2, f"{VICTIM} never came back as a new instance: {instances}"
    old = instances[0]
    refused = [r for r in ledger.of("refused", VICTIM) if r["instance"] == old]
    assert refused, "the old instance's late report was not refused"
    assert all("not counted" in r["error"] for r in refused), [r["error"] for r in refused]
    late = [at for at in ledger.draws(VICTIM, old) if at > last_old_draw_bound]
    assert late == [], f"the old instance drew {len(late)} samples after its lease ended"
    # Nothing refused was counted by its reader: every such sample is someone else's.
    refused_samples = {i for r in refused for i in r["samples"]}
    counted_by_victim_old = {
        i for r in ledger.of("counted", VICTIM) if r["instance"] == old for i in r["samples"]
    }
    assert not refused_samples & counted_by_victim_old


def test_a_worker_paused_past_its_timeout_trains_nothing_twice(
    tmp_path: Path, own_nats_server: NatsServer
) -> None:
    url = own_nats_server.url
    with training_job(tmp_path, url, url) as (job, procs, ledgers):
        _wait_for_batches(ledgers)
        victim = procs[VICTIM]
        os.kill(victim.pid, signal.SIGSTOP)
        # The fault's length, not a wait for a condition: the process is frozen this long.
        time.sleep(PAUSE_S)
        wait_until(
            lambda: _is_failed(url, job, VICTIM), FAILED_DEADLINE_S, f"{VICTIM} to be failed"
        )
        resumed_at = time.monotonic()
        os.kill(victim.pid, signal.SIGCONT)
        _finish(procs, tmp_path)

    _check_exactly_once_and_fenced(Ledger.read(ledgers), resumed_at)


def test_a_worker_whose_connection_is_held_past_its_timeout_trains_nothing_twice(
    tmp_path: Path, own_nats_server: NatsServer
) -> None:
    url = own_nats_server.url
    host, port = "127.0.0.1", own_nats_server.port
    with (
        Proxy(port, host) as proxy,
        training_job(tmp_path, url, proxy.url) as (job, procs, ledgers),
    ):
        _wait_for_batches(ledgers)
        held_at = time.monotonic()
        proxy.cut()
        # The fault's length: the connection carries nothing either way for this long.
        time.sleep(HOLD_S)
        wait_until(
            lambda: _is_failed(url, job, VICTIM), FAILED_DEADLINE_S, f"{VICTIM} to be failed"
        )
        proxy.heal()
        _finish(procs, tmp_path)

    # Its last heartbeat confirmed before the hold, its lease expired at most a heartbeat
    # timeout into it: no sample drawn under it after that.
    _check_exactly_once_and_fenced(Ledger.read(ledgers), held_at + HEARTBEAT_TIMEOUT + SLACK_S)
