"""`helm install` with the chart's defaults trains: what the chart renders, run as local processes.

The chart is rendered by helm with its default values (only the demo job made small and the
heartbeats quick, through values). Then, as a cluster would: the NATS StatefulSet's three
replicas start with the rendered configuration and the generated Secrets' passwords; each
service's Deployment runs its container's command and environment; the workers' Indexed Job runs
one process per completion index with its pod's command and environment, restarted with the same
index when it fails (restartPolicy OnFailure); the `helm test` pod checks the installation.
Service DNS names become 127.0.0.1 ports and the checkpoints claim a directory (tests/deploy/
localpods.py); with S3 configured instead, the bucket is on a real S3 server (moto). The ranks'
process groups meet at rank 0's TCPStore, through the DNS name its pod gets from the workers'
headless Service (a 127.0.0.1 port here too). One worker is SIGKILLed midway (rank 1 with the
claim, rank 0, the store's host, with S3): the job must still finish, from a checkpoint.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from strata import procutil

from tests.deploy.chart import NAMESPACE, Render, Rendered
from tests.deploy.localpods import Cluster, Process, answers, get_json, name, wait_until
from tests.s3 import S3Endpoint, moto_server  # noqa: F401

pytestmark = [pytest.mark.nats, pytest.mark.cluster, pytest.mark.slow]

WORKERS = 3
JOB = "default"
SMALL_JOB = (
    f"workers.replicaCount={WORKERS}",
    "workers.demo.epochs=2",
    "workers.demo.samples=1536",
    "workers.demo.shardSize=64",
    "workers.demo.roundBatches=4",
    "workers.demo.barrierTimeout=60",
    "coordinator.heartbeatInterval=1",
    "coordinator.heartbeatTimeout=3",
)
SERVICES = ("registry", "sharding", "barrier", "checkpoint", "gateway")
S3_SERVICE = "minio.storage.svc:9000"
"""The S3-compatible store's Service, as an operator would give storage.s3.endpoint."""
KILL_AFTER_ROUND = 2
RESTART_DELAY_S = 0.5
"""The kubelet waits 10 s before the first restart of a failed container; less here."""


@dataclass
class Index:
    """One completion index of the Indexed Job: its current process and its history."""

    value: int
    processes: list[Process] = field(default_factory=list)
    failures: int = 0
    succeeded: bool = False
    next_start: float = 0.0

    @property
    def current(self) -> Process:
        return self.processes[-1]

    def events(self) -> list[dict[str, Any]]:
        """The demo's JSON progress lines, from every process of this index."""
        found = []
        for process in self.processes:
            for line in process.log.read_text(errors="replace").splitlines():
                if line.startswith('{"event"'):
                    found.append(json.loads(line))
        return found


class IndexedJob:
    """The Job controller and kubelet for the workers' Job, as its spec says."""

    def __init__(self, cluster: Cluster, job: dict[str, Any]) -> None:
        spec = job["spec"]
        assert spec["completionMode"] == "Indexed"
        assert spec["completions"] == spec["parallelism"] == WORKERS
        self.cluster = cluster
        self.backoff_limit = int(spec["backoffLimit"])
        self.pod = spec["template"]["spec"]
        assert self.pod["restartPolicy"] == "OnFailure"
        (self.container,) = self.pod["containers"]
        self.indexes = [Index(i) for i in range(int(spec["completions"]))]

    def start(self, index: Index) -> None:
        pod = f"{name('worker')}-{index.value}"
        process = self.cluster.container_process(
            self.container,
            pod,
            annotations={"batch.kubernetes.io/job-completion-index": str(index.value)},
            label=f"{pod}-run{len(index.processes)}",
        )
        index.processes.append(process.start())
        self.cluster.processes.append(process)

    def reconcile(self) -> None:
        """Restart the failed containers (OnFailure), record the finished ones."""
        total_failures = sum(i.failures for i in self.indexes)
        assert total_failures <= self.backoff_limit, "the Job would have failed: " + "\n".join(
            i.current.tail(2000) for i in self.indexes if i.failures
        )
        now = time.monotonic()
        for index in self.indexes:
            if index.succeeded:
                continue
            if not index.processes:
                self.start(index)
                continue
            code = index.current.poll()
            if code is None:
                continue
            if code == 0:
                index.succeeded = True
            elif index.next_start == 0.0:
                index.failures += 1
                index.next_start = now + RESTART_DELAY_S
            elif now >= index.next_start:
                index.next_start = 0.0
                self.start(index)

    def complete(self) -> bool:
        self.reconcile()
        return all(index.succeeded for index in self.indexes)


@dataclass
class Storage:
    """Where the run's checkpoints went, to look for the committed manifests."""

    claim: Path | None = None
    s3: S3Endpoint | None = None
    bucket: str = ""
    victim: int = 1
    """The rank this variant's run SIGKILLs."""

    def manifests(self) -> list[str]:
        if self.claim is not None:
            return [str(p) for p in self.claim.rglob("MANIFEST.json")]
        assert self.s3 is not None
        listing = self.s3.client().list_objects_v2(Bucket=self.bucket)
        return [o["Key"] for o in listing.get("Contents", []) if o["Key"].endswith("MANIFEST.json")]


@pytest.fixture(params=["pvc", "s3"])
def installed(
    request: pytest.FixtureRequest, render: Render, tmp_path: Path
) -> Iterator[tuple[Cluster, Storage]]:
    """The default values (PVC), or S3 as docs/deployment.md configures it: a bucket on an
    S3-compatible store, credentials in a Secret made outside the chart."""
    # Rank 0 serves the process groups' store on the pg port: a free one, as the pod's own.
    (pg_port,) = procutil.free_ports(1)
    small_job = (*SMALL_JOB, f"workers.demo.pgPort={pg_port}")
    if request.param == "pvc":
        # The registry as two heartbeat partitions (two Deployments); the S3 run keeps one.
        local = Cluster(render(*small_job, "coordinator.services.registry.partitions=2"), tmp_path)
        # The checkpoints claim, mounted by the workers and the checkpoint service alike.
        claim = local.paths["/data/checkpoints"] = tmp_path / "checkpoints-pvc"
        claim.mkdir()
        storage = Storage(claim=claim)
    else:
        endpoint: S3Endpoint = request.getfixturevalue("moto_server")
        bucket = endpoint.new_bucket("chart")
        rendered = render(
            *small_job,
            "storage.backend=s3",
            f"storage.s3.bucket={bucket}",
            f"storage.s3.region={endpoint.region}",
            f"storage.s3.endpoint=http://{S3_SERVICE}",
            "storage.s3.existingSecret=aws-credentials",
        )
        local = Cluster(rendered, tmp_path)
        local.hosts[S3_SERVICE] = endpoint.url.removeprefix("http://")
        local.secrets["aws-credentials"] = {
            "AWS_ACCESS_KEY_ID": endpoint.access_key,
            "AWS_SECRET_ACCESS_KEY": endpoint.secret_key,
        }
        storage = Storage(s3=endpoint, bucket=bucket)
    # Rank 0's pod by its name under the headless Service (subdomain) of the Indexed Job.
    pod = local.rendered.get("Job", name("worker"))["spec"]["template"]["spec"]
    rank0 = f"{name('worker')}-0.{pod['subdomain']}.{NAMESPACE}.svc:{pg_port}"
    local.hosts[rank0] = f"127.0.0.1:{pg_port}"
    storage.victim = 1 if request.param == "pvc" else 0
    try:
        yield local, storage
    finally:
        local.stop()
        _collect_logs(local, tmp_path)


def _collect_logs(cluster: Cluster, tmp_path: Path) -> None:
    # Where a failed run can be read: pytest keeps tmp_path; point at it.
    print(f"logs of {len(cluster.processes)} processes under {tmp_path}")


def _deployment_container(rendered: Rendered, service: str) -> dict[str, Any]:
    deployment = rendered.get("Deployment", name(service))
    assert deployment["spec"]["replicas"] == 1
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return dict(container)


def _start_services(cluster: Cluster) -> dict[str, tuple[Process, int]]:
    """Every service's Deployment: the container's command and env, ports of its own."""
    started: dict[str, tuple[Process, int]] = {}
    deployments = {d["metadata"]["name"] for d in cluster.rendered.of_kind("Deployment")}
    partitions = [f"registry-{n}" for n in range(1, 256) if name(f"registry-{n}") in deployments]
    for service in (*SERVICES, *partitions):
        container = _deployment_container(cluster.rendered, service)
        names = {p["name"]: p["containerPort"] for p in container["ports"]}
        env_ports = {"STRATA_HEALTH_PORT": names["health"]}
        if "http" in names:
            env_ports["STRATA_HTTP_PORT"] = names["http"]
        free = procutil.free_ports(len(env_ports))
        ports = {variable: str(port) for variable, port in zip(env_ports, free, strict=True)}
        process = cluster.container_process(container, f"{name(service)}-0", ports=ports)
        cluster.processes.append(process.start())
        started[service] = (process, int(ports["STRATA_HEALTH_PORT"]))
        if service == "gateway":
            http = int(ports["STRATA_HTTP_PORT"])
            port = cluster.rendered.get("Service", name("gateway"))["spec"]["ports"][0]["port"]
            cluster.hosts[f"{name('gateway')}.{NAMESPACE}.svc:{port}"] = f"127.0.0.1:{http}"
    return started


def _run_pod(cluster: Cluster, pod: dict[str, Any], timeout: float) -> None:
    """A pod of restartPolicy Never: its init containers in turn, then its container."""
    spec = pod["spec"]
    for container in [*spec.get("initContainers", []), *spec["containers"]]:
        label = f"{pod['metadata']['name']}-{container['name']}"
        process = cluster.container_process(container, pod["metadata"]["name"], label=label)
        cluster.processes.append(process.start())
        assert process.proc is not None
        code = process.proc.wait(timeout=timeout)
        assert code == 0, f"{label} exited with {code}:\n{process.tail()}"


def test_the_install_trains_a_job_that_survives_a_killed_worker(
    installed: tuple[Cluster, Storage],
) -> None:
    cluster, storage = installed
    rendered = cluster.rendered
    cluster.start_nats()
    wait_until(cluster.nats_ready, "the three NATS replicas to form a JetStream cluster", 30)

    services = _start_services(cluster)

    def services_ready() -> bool:
        for process, _ in services.values():
            process.check_running()
        return all(answers(f"http://127.0.0.1:{port}/readyz") for _, port in services.values())

    wait_until(services_ready, "every service to be ready (its /readyz)", 60)

    job = IndexedJob(cluster, rendered.get("Job", name("worker")))
    job.reconcile()
    # The pods' environment: each worker is one rank of one job, on the chart's NATS as the
    # job's user, checkpointing to the claim.
    first = job.indexes[1].current.env
    assert first["STRATA_RANK"] == "1"
    assert first["STRATA_JOB"] == JOB
    assert first["STRATA_NATS_USER"] == f"strata-workers-{JOB}"
    assert (
        first["STRATA_NATS_PASSWORD"]
        == cluster.secrets[name("nats-auth")][f"workers-{JOB}-password"]
    )
    if storage.claim is not None:
        assert first["STRATA_CHECKPOINTS"] == str(storage.claim)
    else:
        assert first["STRATA_CHECKPOINTS"] == f"s3://{storage.bucket}/checkpoints"
        assert first["AWS_SECRET_ACCESS_KEY"] == storage.s3.secret_key  # type: ignore[union-attr]
    # Every rank meets the others at rank 0's TCPStore (the name mapped to this machine).
    for index in job.indexes:
        (master,) = [a for a in index.current.argv if a.startswith("--pg-master=")]
        assert master.startswith("--pg-master=127.0.0.1:"), master

    victim = job.indexes[storage.victim]
    killed_at: float | None = None

    def progressed() -> bool:
        nonlocal killed_at
        if killed_at is None:
            rounds = [e for i in job.indexes for e in i.events() if e["event"] == "round"]
            if all(
                any(e["rank"] == i.value and e["round"] >= KILL_AFTER_ROUND for e in rounds)
                for i in job.indexes
            ):
                victim.current.kill()  # SIGKILL: a crash, no leave
                killed_at = time.monotonic()
        return job.complete()

    wait_until(progressed, "the training job to finish", 150)
    assert killed_at is not None, "the job finished before a worker could be killed"

    # The Job's restart policy brought the victim back as a new process of the same index, which
    # resumed from a committed checkpoint with the others.
    assert len(victim.processes) >= 2
    assert victim.failures >= 1
    replacement = Index(victim.value, victim.processes[1:])
    assert any(e["event"] == "resumed" for e in replacement.events()), victim.current.tail()
    for index in job.indexes:
        done = [e for e in index.events() if e["event"] == "done"]
        assert done, f"rank {index.value} did not finish:\n{index.current.tail()}"
        assert done[-1]["rank"] == index.value  # completion index = rank

    # The dashboard's API, through the gateway, with the chart's API token.
    gateway = cluster.hosts[f"{name('gateway')}.{NAMESPACE}.svc:8080"]
    token = cluster.secrets[name("api-token")]["api-token"]
    dashboard = get_json(f"http://{gateway}/api/dashboard?job={JOB}", token)
    ranks = {w["rank"] for w in dashboard["workers"] if w["status"] == "left"}
    assert ranks == set(range(WORKERS)), dashboard["workers"]
    committed = [c for c in dashboard["checkpoints"] if c["status"] == "committed"]
    assert committed, dashboard["checkpoints"]
    assert any(c["status"] == "aborted" for c in dashboard["checkpoints"]) or any(
        w["status"] == "failed" for w in dashboard["workers"]
    ), "the kill left no trace in the dashboard"
    manifests = storage.manifests()
    assert len(manifests) >= len(committed), "committed checkpoints without their manifest"
    assert all(f"/{JOB}/" in m for m in manifests), manifests

    # `helm test`: the hook pod, as rendered.
    (hook,) = [p for p in rendered.of_kind("Pod") if "helm.sh/hook" in p["metadata"]["annotations"]]
    assert hook["metadata"]["annotations"]["helm.sh/hook"] == "test"
    _run_pod(cluster, hook, timeout=60)
