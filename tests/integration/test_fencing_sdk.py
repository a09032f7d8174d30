"""The worker SDK's lease against real registry and sharding services.

A worker's registration is a lease (instance, lease epoch). Heartbeats confirmed by NATS keep it;
silence past the heartbeat timeout expires it; the registry's failure ends it, and the worker
comes back as a new instance with a new lease, under which the sharding service accepts it
while refusing the old one.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import strata
from strata.bus.server import NatsServer
from strata.errors import LeaseRequired, StaleLease
from strata.events.requests import GetShardsRequest, MembersResult

from tests import support
from tests.support import wait_until

pytestmark = [pytest.mark.nats]

HEARTBEAT_INTERVAL = 0.2
HEARTBEAT_TIMEOUT = 1.0


@pytest.fixture(scope="module")
def services(nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    log_dir: Path = tmp_path_factory.mktemp("fencing-services")
    with support.running_services(nats_url, log_dir, ("registry", "sharding")):
        yield


def status_of(result: MembersResult, worker_id: str) -> str | None:
    return next((m.status for m in result.members if m.worker_id == worker_id), None)


def test_confirmed_heartbeats_keep_the_lease_and_silence_expires_it(
    services: None, nats_url: str
) -> None:
    with strata.Worker(job=support.new_job("lease"), nats_url=nats_url) as worker:
        lease = worker.lease
        assert (lease.worker_id, lease.instance) == (worker.id, worker.instance)
        assert lease.epoch == worker.registration.lease_epoch
        # Several heartbeat timeouts of confirmed heartbeats: the lease never lapses.
        for _ in range(5):
            wait_until(
                lambda: worker.aio.lease_age < HEARTBEAT_TIMEOUT / 2,
                5 * HEARTBEAT_TIMEOUT,
                "a heartbeat to be confirmed",
            )
            assert not worker.lease_expired

        worker.aio._suspend_heartbeats(True)
        wait_until(lambda: worker.lease_expired, 10 * HEARTBEAT_TIMEOUT, "the lease to expire")
        assert worker.aio.lease_age > HEARTBEAT_TIMEOUT
        worker.aio._suspend_heartbeats(False)


def test_a_failed_worker_comes_back_as_a_new_instance_and_its_old_lease_is_refused(
    services: None, nats_url: str
) -> None:
    job = support.new_job("lease")
    with strata.Worker(job=job, nats_url=nats_url, worker_id="trainer") as worker:
        datasets = strata.DatasetRegistry(worker)
        datasets.register_dataset("ds", total_samples=400, shard_size=10, seed=3)
        first = datasets.assignment("ds", epoch=0)
        old_lease, old_instance = worker.lease, worker.instance

        worker.aio._suspend_heartbeats(True)
        wait_until(
            lambda: status_of(worker.members(include_gone=True), "trainer") == "failed",
            10 * HEARTBEAT_TIMEOUT,
            "the registry to fail the silent worker",
        )
        assert worker.lease_expired
        worker.aio._suspend_heartbeats(False)
        wait_until(lambda: worker.rejoin_count == 1, 10, "the worker to register again")

        assert worker.id == "trainer"
        assert worker.instance != old_instance
        assert worker.lease.instance == worker.instance
        assert worker.lease.epoch > old_lease.epoch
        wait_until(lambda: not worker.lease_expired, 10, "the new lease to be confirmed")

        with pytest.raises(StaleLease, match="registered again since") as refused:
            datasets.report_progress("ds", 0, completed=[first.shards[0].shard_id], lease=old_lease)
        assert refused.value.code == "stale_lease"
        with pytest.raises(StaleLease):
            datasets.assignment("ds", epoch=0, lease=old_lease)
        again = datasets.assignment("ds", epoch=0)
        mine = [s.shard_id for s in again.shards if not s.done]
        assert datasets.report_progress("ds", 0, completed=mine[:1]).done_shards == 1


def test_a_request_without_a_lease_is_refused_with_a_message_to_upgrade(
    services: None, nats_url: str
) -> None:
    with strata.Worker(job=support.new_job("lease"), nats_url=nats_url) as worker:
        strata.DatasetRegistry(worker).register_dataset("ds", total_samples=40, shard_size=10)
        old_client = GetShardsRequest(job=worker.job, dataset_id="ds", worker_id=worker.id, epoch=0)
        with pytest.raises(LeaseRequired, match="upgrade strata on the workers"):
            worker.runner.run(worker.aio.bus.rpc.call("sharding", "get_shards", old_client))


def test_a_gap_the_registry_did_not_act_on_puts_the_lease_in_doubt_until_beats_settle_it(
    own_nats_server: NatsServer, tmp_path: Path
) -> None:
    """Heartbeats stop for longer than the timeout while the registry itself is frozen, so it
    fails nobody. The first heartbeat NATS confirms after the gap does not renew the lease (the
    registry may have failed the worker in the gap); a heartbeat timeout of confirmed heartbeats
    with no notice to register again does."""
    nats_url = own_nats_server.url  # its own server: no other registry hears this worker
    registry = support.ServiceProcess("registry", nats_url, tmp_path).start()
    try:
        with strata.Worker(job=support.new_job("lease"), nats_url=nats_url) as worker:
            wait_until(lambda: not worker.lease_expired, 5, "the lease to be confirmed")
            assert registry.proc is not None
            os.kill(registry.proc.pid, signal.SIGSTOP)
            try:
                worker.aio._suspend_heartbeats(True)
                wait_until(lambda: worker.lease_expired, 10, "the lease to expire")
                worker.aio._suspend_heartbeats(False)
                wait_until(lambda: worker.aio.lease_in_doubt, 10, "the lease to be in doubt")
                assert worker.lease_expired
                wait_until(
                    lambda: not worker.lease_expired,
                    10 * HEARTBEAT_TIMEOUT,
                    "confirmed heartbeats to settle the doubt",
                )
                assert worker.rejoin_count == 0
                assert worker.lease.instance == worker.instance
            finally:
                os.kill(registry.proc.pid, signal.SIGCONT)
    finally:
        registry.stop()
