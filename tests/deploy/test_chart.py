"""The Helm chart rendered offline: valid for Kubernetes 1.29-1.33, secure, wired as documented.

Each scenario is one way people install Strata (the seeds' S3 and PVC set-ups, an existing NATS,
autoscaled workers). Every render is checked against the Kubernetes schemas in strict mode, then
its objects are read back to check what the schemas cannot: probes, limits, mounts, permissions.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import kubernetes_validate.utils
import nats.errors
import pytest
import yaml
from nats.aio.msg import Msg
from nats.js.kv import KeyValue
from strata import procutil, security
from strata.bus import Bus, ConnectOptions, EventFeed
from strata.bus import connect as connect_nats
from strata.bus.server import NatsServer, nats_server_binary, rpc_mapping_config
from strata.config import load_settings
from strata.events import EVENT_TYPES, WorkerLeft, subjects
from strata.events.rpc import RPC_SERVICES

from tests import natsprobe
from tests.deploy import natsconf
from tests.deploy.chart import CHART, NAMESPACE, RELEASE, Render, Rendered, helm_template
from tests.deploy.localpods import Process

KUBERNETES_VERSIONS = ("1.29.0", "1.30.0", "1.31.0", "1.32.0", "1.33.0")
STRATA_SERVICES = ("registry", "sharding", "barrier", "checkpoint", "gateway")
STANDARD_LABELS = (
    "app.kubernetes.io/name",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/version",
    "app.kubernetes.io/component",
    "app.kubernetes.io/part-of",
    "app.kubernetes.io/managed-by",
)
EXTERNAL_NATS = "nats://nats.messaging.svc:4222"
CRD_API_VERSIONS = ("monitoring.coreos.com/v1",)

SCENARIOS: dict[str, tuple[str, ...]] = {
    "defaults": (),
    "s3-secret": (
        "storage.backend=s3",
        "storage.s3.bucket=my-ml-checkpoints",
        "storage.s3.region=us-east-1",
        "storage.s3.existingSecret=aws-credentials",
    ),
    "s3-irsa": (
        "storage.backend=s3",
        "storage.s3.bucket=my-ml-checkpoints",
        "storage.s3.region=us-east-1",
        r"serviceAccount.annotations.eks\.amazonaws\.com/role-arn=arn:aws:iam::123456789012:role/strata",
    ),
    "local-pvc": (
        "storage.backend=local",
        "persistence.enabled=true",
        "persistence.storageClass=fast-nvme",
        "persistence.accessMode=ReadWriteMany",
        "persistence.size=500Gi",
    ),
    "external-nats": (
        f"externalNats.url={EXTERNAL_NATS}",
        "externalNats.streamReplicas=3",
        "nats.auth.existingSecret=strata-nats-credentials",
    ),
    "autoscaling": (
        "workers.kind=Deployment",
        "workers.autoscaling.enabled=true",
        "workers.autoscaling.minReplicas=4",
        "workers.autoscaling.maxReplicas=100",
        "workers.autoscaling.targetCPUUtilizationPercentage=80",
    ),
    "prometheus-and-outside-training": (
        r"networkPolicy.metricsFrom[0].namespaceSelector.matchLabels.kubernetes\.io/metadata\.name=monitoring",
        r"networkPolicy.metricsFrom[0].podSelector.matchLabels.app\.kubernetes\.io/name=prometheus",
        "networkPolicy.extraClients[0].podSelector.matchLabels.app=llm-pretrain",
        "nats.auth.extraWorkerJobs={llm-pretrain}",
        "coordinator.apiToken.existingSecret=strata-api-token-from-vault",
        "coordinator.replay.maxEvents=1000000",
        "coordinator.replay.timeoutSeconds=45",
    ),
    "ingress": (
        "ingress.enabled=true",
        "ingress.className=nginx",
        "ingress.host=strata.example.com",
        "ingress.tls[0].secretName=strata-tls",
        "ingress.tls[0].hosts[0]=strata.example.com",
    ),
    "ingress-sub-path": (
        "ingress.enabled=true",
        "ingress.path=/strata(/|$)(.*)",
        "ingress.pathType=ImplementationSpecific",
        r"ingress.annotations.nginx\.ingress\.kubernetes\.io/rewrite-target=/$2",
    ),
    "service-monitor": (
        "metrics.serviceMonitor.enabled=true",
        "metrics.serviceMonitor.labels.release=kube-prometheus-stack",
    ),
    "pod-monitor": ("metrics.podMonitor.enabled=true",),
    "registry-partitions": (
        "coordinator.services.registry.partitions=3",
        "metrics.serviceMonitor.enabled=true",
    ),
    "gpu-workers": ("workers.gpu=1", "workers.restartPolicy=Never", "workers.backoffLimit=20"),
    "single-node-dev": (
        "nats.replicas=1",
        "nats.auth.enabled=false",
        "persistence.enabled=false",
        "workers.gpu=0",
        "workers.healthPort=8081",
    ),
}


def _name(part: str) -> str:
    return f"{RELEASE}-{part}"


def _containers(workload: dict[str, Any]) -> list[dict[str, Any]]:
    spec = workload["spec"]["template"]["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


def _env(container: dict[str, Any]) -> dict[str, Any]:
    """name -> value, or the valueFrom mapping when the value comes from elsewhere."""
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def _strata_containers(rendered: Rendered) -> list[dict[str, Any]]:
    return [
        c
        for w in rendered.workloads()
        if w["metadata"]["labels"]["app.kubernetes.io/component"] != "nats"
        for c in _containers(w)
    ]


def _secret_text(rendered: Rendered, name: str, key: str) -> str:
    return base64.b64decode(rendered.get("Secret", name)["data"][key]).decode()


def _nats_auth(rendered: Rendered) -> dict[str, tuple[str, natsconf.Permissions]]:
    config = rendered.get("ConfigMap", _name("nats-config"))["data"]
    assert natsconf.parse(config["nats.conf"])["include"] == ["auth.conf"]
    return natsconf.users(natsconf.parse(config["auth.conf"]))


# -- the chart as a whole -------------------------------------------------------------------------


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_lint_strict(helm: Path, scenario: str) -> None:
    command = [str(helm), "lint", "--strict", str(CHART)]
    for setting in SCENARIOS[scenario]:
        command += ["--set", setting]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.fixture(scope="module")
def _schemas_read_once() -> Iterator[None]:
    # kubernetes-validate reads and parses its schema files again for every object; the same
    # few files serve every render here.
    with pytest.MonkeyPatch.context() as patch:
        cached = functools.lru_cache(maxsize=None)(kubernetes_validate.utils.schema_contents)
        patch.setattr(kubernetes_validate.utils, "schema_contents", cached)
        yield


@pytest.mark.usefixtures("_schemas_read_once")
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_renders_valid_objects_for_kubernetes_1_29_to_1_33(render: Render, scenario: str) -> None:
    rendered = render(*SCENARIOS[scenario])
    assert rendered.objects
    # The Prometheus Operator's kinds are CRDs, not in the Kubernetes schemas: skipped by name,
    # and only those (an unknown kind otherwise fails validation).
    crds = [o for o in rendered.objects if o["apiVersion"] in CRD_API_VERSIONS]
    assert all(o["kind"] in ("ServiceMonitor", "PodMonitor") for o in crds)
    failures = []
    for version in KUBERNETES_VERSIONS:
        for obj in rendered.objects:
            if obj in crds:
                continue
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                path = ".".join(str(p) for p in exc.path)
                failures.append(f"{version} {obj['kind']}/{obj['metadata']['name']} {path}: {exc}")
    assert not failures, "\n".join(failures)


def test_strict_validation_rejects_an_unknown_field(render: Render) -> None:
    # Guards the test above: strict mode must refuse what a typo in a template would produce.
    deployment = render().get("Deployment", _name("gateway"))
    broken = {**deployment, "spec": {**deployment["spec"], "replica": 2}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[0], strict=True)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_object_has_the_standard_labels(render: Render, scenario: str) -> None:
    for obj in render(*SCENARIOS[scenario]).objects:
        labels = obj["metadata"].get("labels", {})
        missing = [label for label in STANDARD_LABELS if label not in labels]
        assert not missing, f"{obj['kind']}/{obj['metadata']['name']} lacks {missing}"
        assert labels["app.kubernetes.io/part-of"] == "strata"
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
        assert obj["metadata"]["namespace"] == NAMESPACE


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_services_select_pods_and_named_ports_that_exist(render: Render, scenario: str) -> None:
    rendered = render(*SCENARIOS[scenario])
    for workload in rendered.workloads():
        if workload["kind"] == "Job":
            continue  # the Job controller makes its selector (a uid) itself
        pod_labels = workload["spec"]["template"]["metadata"]["labels"]
        selector = workload["spec"]["selector"]["matchLabels"]
        assert selector.items() <= pod_labels.items(), workload["metadata"]["name"]
    for service in rendered.of_kind("Service"):
        selector = service["spec"]["selector"]
        targets = [
            w
            for w in rendered.workloads()
            if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(targets) == 1, f"Service {service['metadata']['name']} selects {len(targets)}"
        ports = {p["name"] for c in _containers(targets[0]) for p in c.get("ports", [])}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports, (service["metadata"]["name"], port)


# -- pods: probes, limits, security ---------------------------------------------------------------


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_container_is_probed_limited_and_unprivileged(render: Render, scenario: str) -> None:
    rendered = render(*SCENARIOS[scenario])
    workers_probed = "workers.healthPort=8081" in SCENARIOS[scenario]
    for workload in rendered.workloads():
        component = workload["metadata"]["labels"]["app.kubernetes.io/component"]
        pod = workload["spec"]["template"]["spec"]
        assert pod["automountServiceAccountToken"] is False
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        for container in _containers(workload):
            where = f"{workload['metadata']['name']}/{container['name']}"
            # The SDK serves no probe endpoint: worker probes exist only once one is configured.
            if component != "worker" or workers_probed:
                assert container["livenessProbe"]["httpGet"]["path"].startswith("/healthz"), where
                ready = container["readinessProbe"]["httpGet"]["path"]
                assert ready in ("/readyz", "/healthz?js-server-only=true"), where
            resources = container["resources"]
            for kind in ("cpu", "memory"):
                assert kind in resources["requests"], where
                assert kind in resources["limits"], where
            context = container["securityContext"]
            assert context["runAsNonRoot"] is True, where
            assert context["runAsUser"] == 10001, where
            assert context["readOnlyRootFilesystem"] is True, where
            assert context["allowPrivilegeEscalation"] is False, where
            assert context["capabilities"]["drop"] == ["ALL"], where
            assert context["seccompProfile"]["type"] == "RuntimeDefault", where


def test_strata_containers_get_a_writable_tmp(render: Render) -> None:
    # readOnlyRootFilesystem: Python, boto and torch caches need somewhere to go.
    rendered = render()
    for workload in rendered.workloads():
        if workload["metadata"]["labels"]["app.kubernetes.io/component"] == "nats":
            continue
        volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
        for container in _containers(workload):
            mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
            assert "emptyDir" in volumes[mounts["/tmp"]], workload["metadata"]["name"]


def test_probes_point_at_the_health_port_that_the_service_is_told_to_use(render: Render) -> None:
    rendered = render()
    for name in STRATA_SERVICES:
        (container,) = _containers(rendered.get("Deployment", _name(name)))
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert container["livenessProbe"]["httpGet"]["port"] == "health"
        assert container["readinessProbe"]["httpGet"]["port"] == "health"
        assert _env(container)["STRATA_HEALTH_PORT"] == str(ports["health"])


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_environment_given_to_each_container_is_valid_strata_settings(
    render: Render, scenario: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for container in _strata_containers(render(*SCENARIOS[scenario])):
        for name in list(os.environ):
            if name.startswith("STRATA_") or name in ("STORAGE_BACKEND", "CHECKPOINT_BUCKET"):
                monkeypatch.delenv(name)
        for name, value in _env(container).items():
            if isinstance(value, dict) and "fieldRef" in value:
                value = "0"  # the completion index, a rank
            monkeypatch.setenv(name, value if isinstance(value, str) else "from-a-secret")
        settings = load_settings()  # raises ConfigError naming any variable it cannot use
        assert settings.log_format == "json"
        if container["name"] in ("checkpoint", "worker"):
            assert settings.storage_backend == ("s3" if "s3" in scenario else "local")


def test_one_image_runs_every_service(render: Render) -> None:
    rendered = render()
    images = set()
    for name in STRATA_SERVICES:
        (container,) = _containers(rendered.get("Deployment", _name(name)))
        images.add(container["image"])
        assert container["args"] == ["serve", name]
        assert "command" not in container  # the image's entrypoint is `strata`
    assert len(images) == 1


def test_gateway_and_dashboard_services(render: Render) -> None:
    rendered = render()
    (gateway,) = _containers(rendered.get("Deployment", _name("gateway")))
    http = next(p for p in gateway["ports"] if p["name"] == "http")
    assert http["containerPort"] == 8080
    assert _env(gateway)["STRATA_HTTP_PORT"] == "8080"
    (api_port,) = rendered.get("Service", _name("gateway"))["spec"]["ports"]
    assert (api_port["port"], api_port["targetPort"]) == (8080, "http")
    (dashboard_port,) = rendered.get("Service", _name("dashboard"))["spec"]["ports"]
    assert (dashboard_port["port"], dashboard_port["targetPort"]) == (3000, "http")


# -- workers --------------------------------------------------------------------------------------


def test_workers_get_their_job_shared_memory_and_gpus_only_when_asked(render: Render) -> None:
    (worker,) = _containers(render().get("Job", _name("worker")))
    assert "nvidia.com/gpu" not in worker["resources"]["limits"]
    assert _env(worker)["STRATA_JOB"] == "default"
    assert {"/dev/shm", "/tmp"} <= {m["mountPath"] for m in worker["volumeMounts"]}
    (gpu,) = _containers(render(*SCENARIOS["gpu-workers"]).get("Job", _name("worker")))
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_workers_are_an_indexed_job_whose_completion_index_is_the_rank(render: Render) -> None:
    rendered = render()
    job = rendered.get("Job", _name("worker"))
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == 4
    assert spec["template"]["spec"]["restartPolicy"] == "OnFailure"
    (worker,) = _containers(job)
    env = _env(worker)
    assert env["STRATA_RANK"] == {
        "fieldRef": {
            "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"
        }
    }
    assert env["STRATA_WORLD_SIZE"] == "4"
    assert env["STRATA_CHECKPOINTS"] == "/data/checkpoints"
    assert not [
        d for d in rendered.of_kind("Deployment") if d["metadata"]["name"] == _name("worker")
    ]
    never = render(*SCENARIOS["gpu-workers"]).get("Job", _name("worker"))["spec"]
    assert never["template"]["spec"]["restartPolicy"] == "Never"
    assert never["backoffLimit"] == 20


def test_the_default_workers_run_the_demo_job_of_the_example_image(render: Render) -> None:
    (demo,) = _containers(render().get("Job", _name("worker")))
    assert demo["image"] == "strata:0.1.0-example"
    assert demo["command"] == ["python", "-m", "strata.demo.worker"]
    # Every setting reaches the program from the pod's environment, expanded by Kubernetes.
    referenced = set(re.findall(r"\$\((\w+)\)", " ".join(demo["args"])))
    assert referenced == {
        "STRATA_JOB",
        "STRATA_NATS_URL",
        "STRATA_CHECKPOINTS",
        "STRATA_WORLD_SIZE",
    }
    assert referenced <= set(_env(demo))
    from strata.demo import worker as demo_worker

    parser_flags = {a.split("=")[0] for a in demo["args"]}
    source = Path(demo_worker.__file__).read_text()
    for flag in parser_flags:
        assert f'"{flag}"' in source, f"strata.demo.worker takes no {flag}"
    tagged = render(
        "coordinator.image.repository=registry.example.com/strata", "coordinator.image.tag=1.2"
    )
    (worker,) = _containers(tagged.get("Job", _name("worker")))
    assert worker["image"] == "registry.example.com/strata:1.2-example"


def test_a_training_command_replaces_the_demo_entirely(render: Render) -> None:
    rendered = render("workers.command={python,train.py}", "workers.image.repository=acme/train")
    (worker,) = _containers(rendered.get("Job", _name("worker")))
    assert worker["command"] == ["python", "train.py"]
    assert "args" not in worker
    assert worker["image"] == "acme/train:0.1.0"


def test_autoscaling_replaces_a_fixed_replica_count(render: Render) -> None:
    rendered = render(*SCENARIOS["autoscaling"])
    (hpa,) = rendered.of_kind("HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": _name("worker"),
    }
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (4, 100)
    (metric,) = hpa["spec"]["metrics"]
    assert metric["resource"]["name"] == "cpu"
    assert metric["resource"]["target"] == {"type": "Utilization", "averageUtilization": 80}
    # A fixed count would fight the autoscaler at every upgrade.
    assert "replicas" not in rendered.get("Deployment", _name("worker"))["spec"]
    assert (
        render("workers.kind=Deployment").get("Deployment", _name("worker"))["spec"]["replicas"]
        == 4
    )
    assert not render().of_kind("HorizontalPodAutoscaler")


def test_the_jobs_ranks_meet_at_rank_0s_pod_through_a_headless_service(render: Render) -> None:
    rendered = render("storage.backend=s3", "storage.s3.bucket=ckpt", "workers.demo.pgPort=29600")
    pod = rendered.get("Job", _name("worker"))["spec"]["template"]["spec"]
    service = rendered.get("Service", pod["subdomain"])
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["ports"] == [
        {"name": "pg", "port": 29600, "targetPort": "pg", "protocol": "TCP"}
    ]
    (container,) = pod["containers"]
    assert {"name": "pg", "containerPort": 29600, "protocol": "TCP"} in container["ports"]
    # Pod i of an Indexed Job is <job>-i under its subdomain; rank 0 hosts the store.
    (master,) = [a for a in container["args"] if a.startswith("--pg-master=")]
    assert master == (
        f"--pg-master={_name('worker')}-0.{service['metadata']['name']}.{NAMESPACE}.svc:29600"
    )
    # Elastic workers have no rank-0 pod to name: no Service, the FileStore as before.
    elastic = render("workers.kind=Deployment")
    (container,) = _containers(elastic.get("Deployment", _name("worker")))
    assert not any(a.startswith("--pg-master") for a in container["args"])
    assert not [s for s in elastic.of_kind("Service") if s["metadata"]["name"] == pod["subdomain"]]


# -- storage --------------------------------------------------------------------------------------


def _mounts_checkpoints(workload: dict[str, Any], claim: str | None) -> bool:
    (container,) = _containers(workload)
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    if "/data/checkpoints" not in mounts:
        return False
    volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
    volume = volumes[mounts["/data/checkpoints"]]
    if claim is None:
        return "emptyDir" in volume
    return bool(volume.get("persistentVolumeClaim", {}).get("claimName") == claim)


def test_local_storage_shares_one_claim_between_workers_and_the_checkpoint_service(
    render: Render,
) -> None:
    rendered = render(*SCENARIOS["local-pvc"])
    claim = rendered.get("PersistentVolumeClaim", _name("checkpoints"))
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert claim["spec"]["storageClassName"] == "fast-nvme"
    assert claim["spec"]["resources"]["requests"]["storage"] == "500Gi"
    for kind, name in (("Deployment", "checkpoint"), ("Job", "worker")):
        workload = rendered.get(kind, _name(name))
        assert _mounts_checkpoints(workload, _name("checkpoints")), name
        (container,) = _containers(workload)
        assert _env(container)["STORAGE_BACKEND"] == "local"
    for name in ("registry", "sharding", "barrier", "gateway"):
        assert not _mounts_checkpoints(rendered.get("Deployment", _name(name)), None)


def test_local_storage_without_persistence_is_scratch_space(render: Render) -> None:
    rendered = render(*SCENARIOS["single-node-dev"])
    assert not rendered.of_kind("PersistentVolumeClaim")
    assert _mounts_checkpoints(rendered.get("Deployment", _name("checkpoint")), None)


@pytest.mark.parametrize("scenario", ["s3-secret", "s3-irsa"])
def test_s3_storage_needs_no_volume_and_gets_its_settings(render: Render, scenario: str) -> None:
    rendered = render(*SCENARIOS[scenario])
    assert not rendered.of_kind("PersistentVolumeClaim")
    for kind, name in (("Deployment", "checkpoint"), ("Job", "worker")):
        workload = rendered.get(kind, _name(name))
        (container,) = _containers(workload)
        env = _env(container)
        assert env["STORAGE_BACKEND"] == "s3"
        if name == "worker":
            assert env["STRATA_CHECKPOINTS"] == "s3://my-ml-checkpoints/checkpoints"
        assert env["CHECKPOINT_BUCKET"] == "my-ml-checkpoints"
        assert env["AWS_REGION"] == "us-east-1"
        assert "/data/checkpoints" not in {m["mountPath"] for m in container["volumeMounts"]}
        if scenario == "s3-secret":
            for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
                assert env[key]["secretKeyRef"] == {"name": "aws-credentials", "key": key}
        else:
            assert "AWS_ACCESS_KEY_ID" not in env
            pod = workload["spec"]["template"]["spec"]
            assert pod["serviceAccountName"] == RELEASE
    # Storage settings and credentials reach only the pods that handle checkpoints.
    for name in ("registry", "sharding", "barrier", "gateway"):
        (container,) = _containers(rendered.get("Deployment", _name(name)))
        env = _env(container)
        assert not {"STORAGE_BACKEND", "CHECKPOINT_BUCKET", "AWS_SECRET_ACCESS_KEY"} & set(env)
    if scenario == "s3-irsa":
        account = rendered.get("ServiceAccount", RELEASE)
        assert account["metadata"]["annotations"] == {
            "eks.amazonaws.com/role-arn": "arn:aws:iam::123456789012:role/strata"
        }


def test_workers_can_get_credentials_of_their_own_job_prefix(render: Render) -> None:
    # The checkpoint service keeps the store's credentials; the workers get the job's own.
    rendered = render(*SCENARIOS["s3-secret"], "workers.storageSecret=job-prefix-credentials")
    expected = {"checkpoint": "aws-credentials", "worker": "job-prefix-credentials"}
    for kind, name in (("Deployment", "checkpoint"), ("Job", "worker")):
        (container,) = _containers(rendered.get(kind, _name(name)))
        env = _env(container)
        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            assert env[key]["secretKeyRef"] == {"name": expected[name], "key": key}


# -- NATS -----------------------------------------------------------------------------------------


def test_nats_is_a_three_node_jetstream_cluster_by_default(render: Render) -> None:
    rendered = render()
    nats = rendered.get("StatefulSet", _name("nats"))
    assert nats["spec"]["replicas"] == 3
    assert nats["spec"]["podManagementPolicy"] == "Parallel"
    (claim,) = nats["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    headless = rendered.get("Service", nats["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is True

    pdb = rendered.get("PodDisruptionBudget", _name("nats"))
    assert pdb["spec"]["maxUnavailable"] == 1
    pod_labels = nats["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()

    config = natsconf.parse(rendered.get("ConfigMap", _name("nats-config"))["data"]["nats.conf"])
    assert config["jetstream"]["store_dir"] == "/data/jetstream"
    assert config["cluster"]["include"] == ["routes.conf"]
    routes = natsconf.parse(_secret_text(rendered, _name("nats-routes"), "routes.conf"))["routes"]
    assert [re.sub(r"//[^@]+@", "//", route) for route in routes] == [
        f"nats://{_name('nats')}-{i}.{_name('nats-headless')}.{NAMESPACE}.svc.cluster.local:6222"
        for i in range(3)
    ]

    for container in _strata_containers(rendered):
        env = _env(container)
        assert env["STRATA_STREAM_REPLICAS"] == "3", container["name"]
        assert env["STRATA_NATS_URL"] == f"nats://{_name('nats')}.{NAMESPACE}.svc:4222"


def test_a_single_nats_node_keeps_one_copy_of_each_stream(render: Render) -> None:
    rendered = render(*SCENARIOS["single-node-dev"])
    config = natsconf.parse(rendered.get("ConfigMap", _name("nats-config"))["data"]["nats.conf"])
    assert "cluster" not in config
    assert "include" not in config  # no authorization with nats.auth.enabled=false
    for container in _strata_containers(rendered):
        env = _env(container)
        assert env["STRATA_STREAM_REPLICAS"] == "1"
        assert "STRATA_NATS_USER" not in env


def test_external_nats_replaces_the_statefulset(render: Render) -> None:
    rendered = render(*SCENARIOS["external-nats"])
    assert not rendered.of_kind("StatefulSet")
    assert _name("nats") not in {
        p["metadata"]["name"] for p in rendered.of_kind("PodDisruptionBudget")
    }
    # Only the users' configuration, for the external server to include.
    assert [c["metadata"]["name"] for c in rendered.of_kind("ConfigMap")] == [_name("nats-auth")]
    # The NATS credentials are the existing Secret's; the chart makes only the API token.
    assert [s["metadata"]["name"] for s in rendered.of_kind("Secret")] == [_name("api-token")]
    # No NATS of the chart's to guard: only the services' metrics port.
    assert [p["metadata"]["name"] for p in rendered.of_kind("NetworkPolicy")] == [_name("services")]
    assert all("nats" not in s["metadata"]["name"] for s in rendered.of_kind("Service"))
    for container in _strata_containers(rendered):
        env = _env(container)
        assert env["STRATA_NATS_URL"] == EXTERNAL_NATS
        assert env["STRATA_STREAM_REPLICAS"] == "3"
        assert env["STRATA_NATS_PASSWORD"]["secretKeyRef"]["name"] == "strata-nats-credentials"


def test_every_client_has_a_nats_user_whose_password_the_server_reads(render: Render) -> None:
    rendered = render()
    auth = _nats_auth(rendered)
    secret = rendered.get("Secret", _name("nats-auth"))
    (server,) = _containers(rendered.get("StatefulSet", _name("nats")))
    server_env = _env(server)
    for container in _strata_containers(rendered):
        env = _env(container)
        user = env["STRATA_NATS_USER"]
        password_ref = env["STRATA_NATS_PASSWORD"]["secretKeyRef"]
        assert password_ref["name"] == secret["metadata"]["name"]
        assert password_ref["key"] in secret["data"]
        # The server's copy of the same password: the variable that user's entry names.
        variable = auth[user][0].removeprefix("$")
        assert server_env[variable]["secretKeyRef"] == password_ref, user
    roles = {c["name"]: _env(c)["STRATA_NATS_USER"] for c in _strata_containers(rendered)}
    assert roles["gateway"] == "strata-gateway"
    assert roles["worker"] == "strata-workers-default"
    assert {roles[s] for s in ("registry", "sharding", "barrier", "checkpoint")} == {
        "strata-services"
    }


def test_services_and_gateway_permissions_are_those_of_strata_security(render: Render) -> None:
    # One truth: `strata up --secure` and the chart must give each role the same rights.
    auth = _nats_auth(render())
    for user, role in (("strata-services", "services"), ("strata-gateway", "gateway")):
        expected = security.permissions(role, user)
        rendered = auth[user][1]
        assert set(rendered.publish_allow) == set(expected.publish_allow), role
        assert set(rendered.publish_deny) == set(expected.publish_deny), role
        assert set(rendered.subscribe_allow) == set(expected.subscribe_allow), role


def _event_types() -> list[str]:
    return sorted(EVENT_TYPES)


# Routed to the telemetry stream (strata.hb / strata.metric), not to strata.evt.
TELEMETRY_TYPES = ("worker.heartbeat", "metric.sampled")


def test_worker_permissions_are_those_of_strata_security(render: Render) -> None:
    # The shared user of a job is `strata up --secure`'s per-worker rules with the worker a `*`.
    rendered = render("nats.auth.workerUsers[0].job=llm", "nats.auth.workerUsers[0].worker=w-7")
    auth = _nats_auth(rendered)
    for user, expected in (
        ("strata-workers-default", security.worker_permissions("default", "*")),
        ("w-7@llm", security.permissions("worker", "w-7@llm")),
    ):
        permissions = auth[user][1]
        assert set(permissions.publish_allow) == set(expected.publish_allow), user
        assert set(permissions.publish_deny) == set(expected.publish_deny), user
        assert set(permissions.subscribe_allow) == set(expected.subscribe_allow), user


@pytest.mark.parametrize("partitions", [1, 7, 256])
def test_a_jobs_request_partition_is_the_one_strata_computes(
    render: Render, partitions: int
) -> None:
    # The chart computes FNV-1a in its templates; a job's users may send into that partition only.
    jobs = ["llm-pretrain-v2", "Z9", "a", "resnet_50", "job-0042", "x_y-z", "default"]
    rendered = render(
        "nats.auth.extraWorkerJobs={" + ",".join(jobs) + "}",
        f"coordinator.admission.partitions={partitions}",
    )
    auth = _nats_auth(rendered)
    for job in jobs:
        expected = security.worker_permissions(job, "*", partitions)
        assert set(auth[security.job_user(job)][1].publish_allow) == set(expected.publish_allow)
    config = rendered.get("ConfigMap", _name("nats-config"))["data"]["nats.conf"]
    assert (
        natsconf.parse(config)["mappings"]
        == natsconf.parse(rpc_mapping_config(partitions))["mappings"]
    )
    (registry,) = _containers(rendered.get("Deployment", _name("registry")))
    assert _settings_from(_env(registry)).rpc_partitions == partitions


def test_workers_publish_nothing_on_the_event_stream_and_only_in_their_job(render: Render) -> None:
    job = "default"
    worker = _nats_auth(render())["strata-workers-default"][1]
    for event_type in _event_types():
        if event_type in TELEMETRY_TYPES:
            continue
        for in_job in (job, "other-job"):
            subject = subjects.event_subject(in_job, event_type)
            assert not worker.may_publish(subject), subject
    assert worker.may_publish(subjects.heartbeat_subject(job, "w-1"))
    assert worker.may_publish(subjects.metric_subject(job, "w-1", "loss"))
    for service in RPC_SERVICES:
        assert worker.may_publish(subjects.rpc_subject(service, "ping", job, "w-1"))
    forbidden = [
        subjects.heartbeat_subject("other-job", "w-1"),
        subjects.metric_subject("other-job", "w-1", "loss"),
        subjects.rpc_subject("registry", "register", "other-job", "w-1"),
        # An operator's request (no caller) is the services' alone.
        subjects.rpc_subject("registry", "register"),
        subjects.control_subject(job, "w-1"),
        f"$KV.{subjects.SNAPSHOT_BUCKET}.registry",
        f"$JS.API.STREAM.DELETE.{subjects.EVENTS_STREAM}",
        f"$JS.API.STREAM.PURGE.{subjects.EVENTS_STREAM}",
        f"$JS.API.CONSUMER.CREATE.{subjects.EVENTS_STREAM}",
    ]
    for subject in forbidden:
        assert not worker.may_publish(subject), subject


def test_workers_may_subscribe_to_what_the_sdk_listens_to_in_their_job_only(
    render: Render,
) -> None:
    from strata.aio._barrier import FINAL

    job = "default"
    worker = _nats_auth(render())["strata-workers-default"][1]
    needed = [subjects.event_subject(job, e) for e in FINAL]
    needed += [
        subjects.world_subject(job),
        subjects.event_subject(job, "shard.plan_changed"),
        subjects.control_subject(job, "w-1"),
        subjects.worker_inboxes(job, "w-1"),
    ]
    for subject in needed:
        assert worker.may_subscribe(subject), subject
    for subject in (
        subjects.event_subject("other-job", "worker.registered"),
        # Membership reaches workers as world notices, not as the events.
        subjects.event_subject(job, "worker.registered"),
        subjects.world_subject("other-job"),
        subjects.event_subject(job, "checkpoint.committed"),
        subjects.control_subject("other-job", "w-1"),
        subjects.heartbeat_subject(job, "w-1"),
        subjects.worker_inboxes("other-job", "w-1"),
        "_INBOX.>",
        f"$KV.{subjects.SNAPSHOT_BUCKET}.registry",
    ):
        assert not worker.may_subscribe(subject), subject


def test_a_per_worker_user_may_act_as_its_worker_only(render: Render) -> None:
    rendered = render("nats.auth.workerUsers[0].job=llm", "nats.auth.workerUsers[0].worker=w-7")
    mine = _nats_auth(rendered)["w-7@llm"][1]
    assert mine.may_publish(subjects.heartbeat_subject("llm", "w-7"))
    assert mine.may_publish(subjects.rpc_subject("checkpoint", "ack", "llm", "w-7"))
    assert mine.may_subscribe(subjects.control_subject("llm", "w-7"))
    assert mine.may_subscribe(subjects.worker_inboxes("llm", "w-7"))
    for subject in (
        subjects.heartbeat_subject("llm", "w-8"),
        subjects.rpc_subject("checkpoint", "ack", "llm", "w-8"),
    ):
        assert not mine.may_publish(subject), subject
    # Its heartbeats go to the one bucket its id hashes to (the registry partition that owns
    # it): not another worker's heartbeat on any bucket, nor its own on another.
    own = subjects.heartbeat_subject("llm", "w-7")
    for bucket in range(subjects.HEARTBEAT_BUCKETS):
        for worker in ("w-7", "w-8"):
            forged = f"{subjects.HEARTBEATS}.{bucket:02x}.llm.{worker}"
            assert mine.may_publish(forged) == (forged == own), forged
    for subject in (subjects.control_subject("llm", "w-8"), subjects.worker_inboxes("llm", "w-8")):
        assert not mine.may_subscribe(subject), subject
    secret = rendered.get("Secret", _name("nats-auth"))
    assert "worker-llm-w-7-password" in secret["data"]


def test_the_gateway_publishes_nothing_on_strata_subjects(render: Render) -> None:
    gateway = _nats_auth(render())["strata-gateway"][1]
    assert "strata.>" in gateway.publish_deny
    samples = [subjects.event_subject("j", t) for t in _event_types()]
    samples += [
        subjects.heartbeat_subject("j", "w"),
        subjects.metric_subject("j", "w", "loss"),
        subjects.control_subject("j", "w"),
        *(subjects.rpc_subject(s, "ping") for s in RPC_SERVICES),
        *(subjects.rpc_subject(s, "ping", "j", "w") for s in RPC_SERVICES),
        f"$KV.{subjects.SNAPSHOT_BUCKET}.registry",
        f"$JS.API.STREAM.CREATE.{subjects.EVENTS_STREAM}",
        f"$JS.API.STREAM.DELETE.{subjects.EVENTS_STREAM}",
    ]
    for subject in samples:
        assert not gateway.may_publish(subject), subject
    # What reading does need.
    for subject in (
        f"$JS.API.CONSUMER.CREATE.{subjects.EVENTS_STREAM}",
        f"$JS.API.STREAM.INFO.{subjects.EVENTS_STREAM}",
    ):
        assert gateway.may_publish(subject), subject
    assert gateway.may_subscribe(subjects.event_subject("j", "worker.registered"))


def test_extra_worker_jobs_get_users_of_their_own(render: Render) -> None:
    rendered = render("nats.auth.extraWorkerJobs={llm-pretrain,resnet}")
    auth = _nats_auth(rendered)
    assert {
        "strata-workers-default",
        "strata-workers-llm-pretrain",
        "strata-workers-resnet",
    } <= set(auth)
    resnet = auth["strata-workers-resnet"][1]
    assert resnet.may_publish(subjects.heartbeat_subject("resnet", "w-1"))
    assert not resnet.may_publish(subjects.heartbeat_subject("default", "w-1"))
    secret = rendered.get("Secret", _name("nats-auth"))
    assert {"workers-resnet-password", "workers-llm-pretrain-password"} <= set(secret["data"])


def test_the_nats_configuration_is_accepted_by_nats_server(render: Render, tmp_path: Path) -> None:
    rendered = render()
    for key, text in rendered.get("ConfigMap", _name("nats-config"))["data"].items():
        (tmp_path / key).write_text(text)
    # The route Secret is projected into the same directory.
    routes = _secret_text(rendered, _name("nats-routes"), "routes.conf")
    (tmp_path / "routes.conf").write_text(routes)
    (server,) = _containers(rendered.get("StatefulSet", _name("nats")))
    env = {"PATH": "/usr/bin:/bin", "POD_NAME": f"{_name('nats')}-0"}
    env |= {name: "secret" for name in _env(server) if name.endswith("_PASSWORD")}
    done = subprocess.run(
        [str(nats_server_binary()), "-t", "-c", str(tmp_path / "nats.conf")],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_nats_routes_need_the_route_password_from_the_chart_secret(render: Render) -> None:
    rendered = render()
    config = natsconf.parse(rendered.get("ConfigMap", _name("nats-config"))["data"]["nats.conf"])
    authorization = config["cluster"]["authorization"]
    assert authorization["user"] == "strata-route"
    assert authorization["password"] == "$STRATA_ROUTE_PASSWORD"
    password = _secret_text(rendered, _name("nats-routes"), "route-password")
    assert len(password) >= 32
    routes = natsconf.parse(_secret_text(rendered, _name("nats-routes"), "routes.conf"))["routes"]
    assert len(routes) == 3
    assert all(route.startswith(f"nats://strata-route:{password}@") for route in routes)

    nats = rendered.get("StatefulSet", _name("nats"))
    (server,) = _containers(nats)
    assert _env(server)["STRATA_ROUTE_PASSWORD"]["secretKeyRef"] == {
        "name": _name("nats-routes"),
        "key": "route-password",
    }
    volumes = {v["name"]: v for v in nats["spec"]["template"]["spec"]["volumes"]}
    config_mount = next(m for m in server["volumeMounts"] if m["mountPath"] == "/etc/nats")
    sources = volumes[config_mount["name"]]["projected"]["sources"]
    assert {"configMap": {"name": _name("nats-config")}} in sources
    (secret,) = [source["secret"] for source in sources if "secret" in source]
    assert secret["name"] == _name("nats-routes")
    assert secret["items"] == [{"key": "routes.conf", "path": "routes.conf"}]
    assert volumes[config_mount["name"]]["projected"]["defaultMode"] == 0o440
    # The Strata pods never see the route password.
    for container in _strata_containers(rendered):
        refs = [v for v in _env(container).values() if isinstance(v, dict)]
        names = [ref["secretKeyRef"]["name"] for ref in refs if "secretKeyRef" in ref]
        assert _name("nats-routes") not in names


def test_a_route_secret_made_outside_the_chart_replaces_the_generated_one(render: Render) -> None:
    rendered = render("nats.routeAuth.existingSecret=nats-routes-from-vault")
    assert _name("nats-routes") not in {s["metadata"]["name"] for s in rendered.of_kind("Secret")}
    nats = rendered.get("StatefulSet", _name("nats"))
    (server,) = _containers(nats)
    assert _env(server)["STRATA_ROUTE_PASSWORD"]["secretKeyRef"]["name"] == "nats-routes-from-vault"
    (config,) = [v for v in nats["spec"]["template"]["spec"]["volumes"] if v["name"] == "config"]
    names = [src["secret"]["name"] for src in config["projected"]["sources"] if "secret" in src]
    assert names == ["nats-routes-from-vault"]


def test_route_authentication_can_be_turned_off_and_a_single_node_has_no_routes(
    render: Render,
) -> None:
    plain = render("nats.routeAuth.enabled=false")
    config = natsconf.parse(plain.get("ConfigMap", _name("nats-config"))["data"]["nats.conf"])
    assert "authorization" not in config["cluster"]
    assert len(config["cluster"]["routes"]) == 3
    assert _name("nats-routes") not in {s["metadata"]["name"] for s in plain.of_kind("Secret")}
    single = render(*SCENARIOS["single-node-dev"])
    assert _name("nats-routes") not in {s["metadata"]["name"] for s in single.of_kind("Secret")}


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels and matchExpressions) applied to `labels`."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator, values = expression["key"], expression["operator"], expression.get("values")
        present = key in labels
        if operator == "In" and not (present and labels[key] in values):
            return False
        if operator == "NotIn" and present and labels[key] in values:
            return False
        if operator == "Exists" and not present:
            return False
        if operator == "DoesNotExist" and present:
            return False
    return True


def _pod_labels(workload: dict[str, Any]) -> dict[str, str]:
    labels: dict[str, str] = workload["spec"]["template"]["metadata"]["labels"]
    return labels


def test_a_network_policy_lets_only_strata_pods_reach_nats(render: Render) -> None:
    rendered = render()
    policy = rendered.get("NetworkPolicy", _name("nats"))
    nats = rendered.get("StatefulSet", _name("nats"))
    assert _selects(policy["spec"]["podSelector"], _pod_labels(nats))
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    rules = {rule["ports"][0]["port"]: rule for rule in policy["spec"]["ingress"]}
    (server,) = _containers(nats)
    assert set(rules) <= {port["name"] for port in server["ports"]}
    # Monitoring is closed unless someone is named to scrape it (probes come from the node).
    assert set(rules) == {"client", "cluster"}

    def allowed(rule: dict[str, Any], labels: dict[str, str]) -> bool:
        return any(_selects(peer["podSelector"], labels) for peer in rule["from"])

    strata_pods = [w for w in rendered.workloads() if w is not nats]
    assert {w["metadata"]["labels"]["app.kubernetes.io/component"] for w in strata_pods} == {
        *STRATA_SERVICES,
        "worker",
    }
    for workload in strata_pods:
        assert allowed(rules["client"], _pod_labels(workload)), workload["metadata"]["name"]
        assert not allowed(rules["cluster"], _pod_labels(workload)), workload["metadata"]["name"]
    assert allowed(rules["cluster"], _pod_labels(nats))
    assert not allowed(rules["client"], _pod_labels(nats))
    # Peers carry no namespaceSelector: only pods of the release's own namespace.
    assert all("namespaceSelector" not in peer for rule in rules.values() for peer in rule["from"])
    # Another release's pods, or anything else in the namespace, are not Strata's.
    stranger = {**_pod_labels(strata_pods[0]), "app.kubernetes.io/instance": "other"}
    assert not allowed(rules["client"], stranger)
    assert not allowed(rules["client"], {"app": "debug-shell"})


def test_prometheus_and_outside_training_are_let_in_when_named(render: Render) -> None:
    rendered = render(*SCENARIOS["prometheus-and-outside-training"])
    policy = rendered.get("NetworkPolicy", _name("nats"))
    rules = {rule["ports"][0]["port"]: rule for rule in policy["spec"]["ingress"]}
    assert rules["monitor"]["from"] == [
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
        }
    ]
    assert {"podSelector": {"matchLabels": {"app": "llm-pretrain"}}} in rules["client"]["from"]


def test_the_network_policy_can_be_turned_off(render: Render) -> None:
    assert not render("networkPolicy.enabled=false").of_kind("NetworkPolicy")


def test_the_gateway_asks_for_an_api_token_from_a_secret(render: Render) -> None:
    rendered = render()
    (gateway,) = _containers(rendered.get("Deployment", _name("gateway")))
    reference = _env(gateway)["STRATA_API_TOKEN"]["secretKeyRef"]
    assert reference == {"name": _name("api-token"), "key": "api-token"}
    assert len(_secret_text(rendered, reference["name"], reference["key"])) >= 32
    for workload in rendered.workloads():
        if workload["metadata"]["name"] == _name("gateway"):
            continue
        for container in _containers(workload):
            assert "STRATA_API_TOKEN" not in _env(container), workload["metadata"]["name"]

    existing = render(*SCENARIOS["prometheus-and-outside-training"])
    (gateway,) = _containers(existing.get("Deployment", _name("gateway")))
    assert (
        _env(gateway)["STRATA_API_TOKEN"]["secretKeyRef"]["name"] == "strata-api-token-from-vault"
    )
    assert _name("api-token") not in {s["metadata"]["name"] for s in existing.of_kind("Secret")}

    open_gateway = render("coordinator.apiToken.enabled=false")
    (gateway,) = _containers(open_gateway.get("Deployment", _name("gateway")))
    assert "STRATA_API_TOKEN" not in _env(gateway)


def test_the_services_get_the_rendezvous_quota_of_every_job(render: Render) -> None:
    rendered = render(
        "nats.auth.extraWorkerJobs={other}",
        "nats.auth.workerUsers[0].job=solo",
        "nats.auth.workerUsers[0].worker=w-1",
        "nats.rendezvous.maxBytes=134217728",
    )
    (registry,) = _containers(rendered.get("Deployment", _name("registry")))
    env = _env(registry)
    assert env["STRATA_RENDEZVOUS_JOBS"] == "default,other,solo"
    assert (
        env["STRATA_RENDEZVOUS_MAX_BYTES"],
        env["STRATA_RENDEZVOUS_MAX_KEYS"],
        env["STRATA_RENDEZVOUS_MAX_VALUE_BYTES"],
    ) == ("134217728", "100000", "1048576")
    settings = load_settings(
        **{
            k.removeprefix("STRATA_").lower(): v
            for k, v in env.items()
            if k.startswith("STRATA_RENDEZVOUS")
        }
    )
    assert settings.rendezvous_max_bytes == 128 * 1024**2
    (gateway,) = _containers(rendered.get("Deployment", _name("gateway")))
    assert "STRATA_RENDEZVOUS_JOBS" not in _env(gateway)


ADMISSION_ENV = {
    "STRATA_RPC_ADMISSION": "rpc_admission",
    "STRATA_RPC_JOB_RATE": "rpc_job_rate",
    "STRATA_RPC_JOB_BURST": "rpc_job_burst",
    "STRATA_RPC_WORKER_RATE": "rpc_worker_rate",
    "STRATA_RPC_WORKER_BURST": "rpc_worker_burst",
    "STRATA_RPC_JOB_PENDING": "rpc_job_pending",
    "STRATA_RPC_MAX_PENDING": "rpc_max_pending",
    "STRATA_RPC_JOB_INFLIGHT": "rpc_job_inflight",
    "STRATA_RPC_SUB_PENDING_MSGS": "rpc_sub_pending_msgs",
    "STRATA_RPC_SUB_PENDING_MB": "rpc_sub_pending_mb",
    "STRATA_RPC_PARTITIONS": "rpc_partitions",
}
QUOTA_ENV = {
    "STRATA_MAX_DATASETS_PER_JOB": "max_datasets_per_job",
    "STRATA_MAX_SHARDS_PER_DATASET": "max_shards_per_dataset",
}


def _settings_from(env: dict[str, Any]) -> Any:
    """The settings a service reads from the STRATA_ variables the chart gives its container."""
    return load_settings(
        **{
            name.removeprefix("STRATA_").lower(): value
            for name, value in env.items()
            if name in ADMISSION_ENV or name in QUOTA_ENV
        }
    )


def test_every_service_gets_the_admission_limits_and_the_chart_defaults_are_the_code_defaults(
    render: Render,
) -> None:
    """The chart's defaults are the services' own (sized for a 1,000-worker job): a service run
    by the chart and one run by `strata up` refuse the same requests."""
    rendered = render()
    defaults = load_settings()
    for service in ("registry", "sharding", "barrier", "checkpoint"):
        (container,) = _containers(rendered.get("Deployment", _name(service)))
        env = _env(container)
        assert set(ADMISSION_ENV) <= set(env), service
        assert (set(QUOTA_ENV) <= set(env)) == (service == "sharding"), service
        settings = _settings_from(env)
        for field in (*ADMISSION_ENV.values(), *QUOTA_ENV.values()):
            assert getattr(settings, field) == getattr(defaults, field), (service, field)
        assert settings.admission_limits() == defaults.admission_limits()
    (gateway,) = _containers(rendered.get("Deployment", _name("gateway")))
    assert not set(ADMISSION_ENV) & set(_env(gateway))


def test_the_admission_limits_and_quotas_are_values(render: Render) -> None:
    rendered = render(
        "coordinator.admission.jobRate=750",
        "coordinator.admission.jobBurst=1500",
        "coordinator.admission.workerRate=50",
        "coordinator.admission.workerBurst=80",
        "coordinator.admission.jobPending=100",
        "coordinator.admission.maxPending=1000",
        "coordinator.admission.jobInflight=2048",
        "coordinator.admission.subscriptionPendingMessages=4096",
        "coordinator.admission.subscriptionPendingMB=8",
        "coordinator.quotas.datasetsPerJob=4",
        "coordinator.quotas.shardsPerDataset=20000",
    )
    (sharding,) = _containers(rendered.get("Deployment", _name("sharding")))
    settings = _settings_from(_env(sharding))
    limits = settings.admission_limits()
    assert limits is not None
    assert (limits.job_rate, limits.job_burst, limits.worker_rate, limits.worker_burst) == (
        750.0,
        1500,
        50.0,
        80,
    )
    assert (limits.job_pending, limits.max_pending, limits.job_inflight) == (100, 1000, 2048)
    assert (settings.rpc_sub_pending_msgs, settings.rpc_sub_pending_mb) == (4096, 8)
    assert (settings.max_datasets_per_job, settings.max_shards_per_dataset) == (4, 20_000)

    off = render("coordinator.admission.enabled=false")
    (barrier,) = _containers(off.get("Deployment", _name("barrier")))
    assert _settings_from(_env(barrier)).admission_limits() is None


def test_the_services_metrics_port_admits_only_what_scrapes_it(render: Render) -> None:
    """The services' /metrics name jobs: by default nothing but the node's probes reaches
    their pods; `networkPolicy.metricsFrom` lets Prometheus in, on the health port only."""
    policy = render().get("NetworkPolicy", _name("services"))
    selected = policy["spec"]["podSelector"]["matchExpressions"][0]["values"]
    assert set(selected) == {"registry", "sharding", "barrier", "checkpoint"}
    assert policy["spec"]["ingress"] == []
    scraped = render(
        "networkPolicy.metricsFrom[0].namespaceSelector.matchLabels.team=monitoring"
    ).get("NetworkPolicy", _name("services"))
    (rule,) = scraped["spec"]["ingress"]
    assert rule["ports"] == [{"port": "health", "protocol": "TCP"}]
    assert rule["from"] == [{"namespaceSelector": {"matchLabels": {"team": "monitoring"}}}]
    assert not render("networkPolicy.enabled=false").of_kind("NetworkPolicy")


def test_the_gateway_gets_its_edge_and_memory_bounds(render: Render) -> None:
    (gateway,) = _containers(render().get("Deployment", _name("gateway")))
    env = _env(gateway)
    assert (
        env["STRATA_GATEWAY_HEADER_TIMEOUT"],
        env["STRATA_GATEWAY_MAX_CONNECTIONS"],
        env["STRATA_GATEWAY_METRICS_MB"],
    ) == ("10", "2048", "256")
    settings = load_settings(
        gateway_header_timeout=env["STRATA_GATEWAY_HEADER_TIMEOUT"],
        gateway_max_connections=env["STRATA_GATEWAY_MAX_CONNECTIONS"],
        gateway_metrics_mb=env["STRATA_GATEWAY_METRICS_MB"],
    )
    assert settings.gateway_max_connections == 2048
    (registry,) = _containers(render().get("Deployment", _name("registry")))
    assert "STRATA_GATEWAY_MAX_CONNECTIONS" not in _env(registry)


def test_the_gateway_gets_the_replay_bounds(render: Render) -> None:
    (gateway,) = _containers(render().get("Deployment", _name("gateway")))
    env = _env(gateway)
    assert (
        env["STRATA_REPLAY_MAX_EVENTS"],
        env["STRATA_REPLAY_TIMEOUT"],
        env["STRATA_REPLAY_CONCURRENCY"],
    ) == ("250000", "30", "2")
    rendered = render(*SCENARIOS["prometheus-and-outside-training"])
    (gateway,) = _containers(rendered.get("Deployment", _name("gateway")))
    assert _env(gateway)["STRATA_REPLAY_MAX_EVENTS"] == "1000000"  # an integer, not 1e+06
    assert _env(gateway)["STRATA_REPLAY_TIMEOUT"] == "45"


# -- values.schema.json and other refusals --------------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "complaint"),
    [
        (("storage.backend=gcs",), "storage.backend"),
        (("workers.replicaCount=-1",), "workers.replicaCount"),
        (("storage.backend=s3",), "bucket"),
        (("nats.replicas=2",), "nats.replicas"),
        (("coordinator.logFormat=xml",), "coordinator.logFormat"),
        (("coordinator.heartbeatInterval=soon",), "coordinator.heartbeatInterval"),
        (("persistence.accessMode=ReadManyWriteSome",), "persistence.accessMode"),
        (("externalNats.url=http://nats:4222", "nats.auth.existingSecret=x"), "externalNats.url"),
        (("externalNats.url=nats://nats:4222",), "existingSecret"),
        (("storage.backed=s3",), "storage"),
        (("workers.job=has.dots",), "workers.job"),
        (("coordinator.replay.concurrency=0",), "coordinator.replay.concurrency"),
        (("networkPolicy.metricsFrom[0].pods=all",), "networkPolicy.metricsFrom"),
        (("nats.routeAuth.enabled=maybe",), "nats.routeAuth.enabled"),
        (("coordinator.services.registry.partitions=0",), "partitions"),
        (("coordinator.services.registry.partitions=257",), "partitions"),
        (("coordinator.admission.jobRate=0",), "coordinator.admission.jobRate"),
        (("coordinator.admission.workerBurst=-5",), "coordinator.admission.workerBurst"),
        (("coordinator.admission.enabled=maybe",), "coordinator.admission.enabled"),
        (("coordinator.admission.jobPending=lots",), "coordinator.admission.jobPending"),
        (("coordinator.quotas.shardsPerDataset=2000000",), "coordinator.quotas.shardsPerDataset"),
        (("coordinator.quotas.datasetsPerJob=0",), "coordinator.quotas.datasetsPerJob"),
    ],
)
def test_schema_rejects_wrong_values(helm: Path, settings: tuple[str, ...], complaint: str) -> None:
    done = helm_template(helm, settings)
    assert done.returncode != 0, f"{settings} rendered"
    assert "values don't meet the specifications of the schema" in done.stderr, done.stderr
    assert complaint in done.stderr, done.stderr


@pytest.mark.parametrize(
    ("settings", "complaint"),
    [
        (("coordinator.heartbeatTimeout=1",), "heartbeatTimeout"),
        (
            (
                "workers.autoscaling.enabled=true",
                "workers.autoscaling.minReplicas=10",
                "workers.autoscaling.maxReplicas=5",
            ),
            "minReplicas",
        ),
    ],
)
def test_inconsistent_values_are_refused(
    helm: Path, settings: tuple[str, ...], complaint: str
) -> None:
    done = helm_template(helm, settings)
    assert done.returncode != 0
    assert complaint in done.stderr, done.stderr


def test_notes_tell_how_to_open_the_dashboard(helm: Path, tmp_path: Path) -> None:
    # helm renders NOTES.txt only on install; in a copy of the chart it becomes a ConfigMap's data.
    chart = tmp_path / "strata"
    shutil.copytree(CHART, chart)
    notes = (chart / "templates" / "NOTES.txt").read_text()
    (chart / "templates" / "_notes.tpl").write_text(
        '{{- define "test.notes" -}}\n' + notes + "{{- end }}\n"
    )
    (chart / "templates" / "notes.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes\ndata:\n  notes: |\n"
        '{{ include "test.notes" . | indent 4 }}\n'
    )
    done = helm_template(helm, chart=chart, extra=["--show-only", "templates/notes.yaml"])
    assert done.returncode == 0, done.stderr
    text = yaml.safe_load(done.stdout)["data"]["notes"]
    assert f"kubectl -n {NAMESPACE} port-forward svc/{_name('dashboard')} 3000:3000" in text
    assert "http://localhost:3000/" in text
    assert f"kubectl -n {NAMESPACE} exec deploy/{_name('registry')} -- strata status" in text
    assert f"kubectl -n {NAMESPACE} get job {_name('worker')}" in text
    assert f"helm test {RELEASE} -n {NAMESPACE}" in text


# -- the rendered permissions on a real nats-server -----------------------------------------------


@pytest.mark.nats
async def test_a_jobs_users_use_its_rendezvous_keys_only_on_a_real_nats_server(
    render: Render, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torchrun's agents of a job log in as the job's shared user (or a per-worker user of it):
    they write and read their job's keys of the rendezvous bucket, and not another job's."""
    rendered = render(
        "nats.auth.extraWorkerJobs={other}",
        "nats.auth.workerUsers[0].job=default",
        "nats.auth.workerUsers[0].worker=w-1",
    )
    auth_conf = rendered.get("ConfigMap", _name("nats-config"))["data"]["auth.conf"]
    users = natsconf.users(natsconf.parse(auth_conf))
    for user, (reference, _) in users.items():
        monkeypatch.setenv(reference.removeprefix("$"), f"password-of-{user}")
    store = tmp_path / "nats"
    store.mkdir()
    (store / "auth.conf").write_text(auth_conf)
    bucket = subjects.RENDEZVOUS_BUCKET
    victim_stream = subjects.rendezvous_stream_name("default")

    def key_subject(job: str) -> str:
        return subjects.kv_subject(bucket, subjects.rendezvous_state_key(job))

    with NatsServer(store_dir=store, extra_config='include "auth.conf"') as server:
        options = ConnectOptions(
            name="services", user="strata-services", password="password-of-strata-services"
        )
        services = Bus(await connect_nats(server.url, options))
        clients = {
            user: await natsprobe.connect(
                server.url,
                user,
                f"password-of-{user}",
                inbox_prefix=subjects.worker_inbox_prefix(job, worker),
            )
            for user, job, worker in (
                ("strata-workers-default", "default", "torchrun-agent"),
                ("w-1@default", "default", "w-1"),
                ("strata-workers-other", "other", "torchrun-agent"),
            )
        }
        try:
            # The services make each job's bucket, from the settings the chart gives them.
            (registry,) = _containers(rendered.get("Deployment", _name("registry")))
            rendezvous_jobs = _env(registry)["STRATA_RENDEZVOUS_JOBS"]
            assert rendezvous_jobs == "default,other"
            await services.ensure_streams(1, load_settings(rendezvous_jobs=rendezvous_jobs))
            for user, job in (
                ("strata-workers-default", "default"),
                ("w-1@default", "default"),
                ("strata-workers-other", "other"),
            ):
                nc = clients[user].nc
                await nc.jetstream().publish(key_subject(job), user.encode())
                read = subjects.rendezvous_read(job, subjects.rendezvous_state_key(job))
                assert (await nc.request(read, b"", 5)).data == user.encode(), user
            attacker = clients["strata-workers-other"]
            forbidden = [
                key_subject("default"),
                subjects.rendezvous_read("default", subjects.rendezvous_state_key("default")),
                f"$JS.API.CONSUMER.CREATE.{victim_stream}",
                f"$JS.API.STREAM.INFO.{victim_stream}",
                f"$JS.API.STREAM.PURGE.{victim_stream}",
                f"$JS.API.STREAM.DELETE.{victim_stream}",
            ]
            for subject in forbidden:
                await attacker.nc.publish(subject, b"{}")
            refused = await natsprobe.refused_subscriptions(
                attacker, [subjects.rendezvous_subjects("default")]
            )
            await natsprobe.settled(attacker)
            assert {f.lower() for f in forbidden} <= attacker.refused["publish"]
            assert refused == {subjects.rendezvous_subjects("default")}
            kv = KeyValue(
                name=bucket,
                stream=victim_stream,
                pre=subjects.kv_subject(bucket, ""),
                js=services.js,
                direct=True,
            )
            assert (await kv.get(subjects.rendezvous_state_key("default"))).value == b"w-1@default"
        finally:
            for client in clients.values():
                await client.close()
            await services.close()


@pytest.mark.nats
async def test_the_rendered_roles_on_a_real_nats_server(
    render: Render, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chart's shared job user and a per-worker user, logged in to nats-server with the
    configuration the chart renders: what each may publish and subscribe to."""
    job = "default"
    rendered = render("nats.auth.workerUsers[0].job=default", "nats.auth.workerUsers[0].worker=w-1")
    auth_conf = rendered.get("ConfigMap", _name("nats-config"))["data"]["auth.conf"]
    users = natsconf.users(natsconf.parse(auth_conf))
    for user, (reference, _) in users.items():
        monkeypatch.setenv(reference.removeprefix("$"), f"password-of-{user}")
    store = tmp_path / "nats"
    store.mkdir()
    (store / "auth.conf").write_text(auth_conf)

    with NatsServer(store_dir=store, extra_config='include "auth.conf"') as server:

        async def connect(user: str) -> Bus:
            options = ConnectOptions(
                name=user, user=user, password=f"password-of-{user}", deadline=10
            )
            return Bus(await connect_nats(server.url, options))

        async def worker(user: str) -> natsprobe.Client:
            return await natsprobe.connect(
                server.url,
                user,
                f"password-of-{user}",
                inbox_prefix=subjects.worker_inbox_prefix(job, "w-1"),
            )

        services = await connect("strata-services")
        gateway = await connect("strata-gateway")
        shared = await worker("strata-workers-default")
        own = await worker("w-1@default")
        try:
            assert set((await services.ensure_streams(1)).values()) == {"created"}
            # Every service's runtime provisions the streams; for the gateway, reading is enough.
            assert set((await gateway.ensure_streams(1)).values()) == {"unchanged"}
            async with EventFeed(gateway.js, subjects.EVENTS_STREAM, "strata.evt.>") as feed:
                event = WorkerLeft(
                    job=job, source="registry", worker_id="w-1", rank=0, membership_epoch=1
                )
                stored = await services.publish(event)
                received = await asyncio.wait_for(anext(aiter(feed)), 10)
                assert (received.seq, received.event.id) == (stored.seq, event.id)

            # A request as the worker reaches the services and its reply the worker's own inbox.
            async def pong(msg: Msg) -> None:
                await msg.respond(b"pong")

            await services.nc.subscribe(subjects.service_rpcs("registry"), cb=pong)
            await services.nc.subscribe(subjects.partition_rpcs("registry", "*"), cb=pong)
            await services.nc.request(subjects.rpc_subject("registry", "ping"), b"", 5)
            for client in (shared, own):
                ping = subjects.rpc_subject("registry", "ping", job, "w-1")
                assert (await client.nc.request(ping, b"", 5)).data == b"pong"

            allowed = [
                subjects.heartbeat_subject(job, "w-1"),
                subjects.metric_subject(job, "w-1", "loss"),
                subjects.rpc_subject("barrier", "arrive", job, "w-1"),
            ]
            forbidden = [
                subjects.event_subject(job, "checkpoint.shard_saved"),
                subjects.event_subject(job, "checkpoint.committed"),
                subjects.event_subject(job, "worker.failed"),
                subjects.event_subject(job, "barrier.released"),
                subjects.heartbeat_subject("other-job", "w-1"),
                subjects.rpc_subject("registry", "register", "other-job", "w-1"),
                subjects.rpc_subject("registry", "register"),
                subjects.control_subject(job, "w-2"),
            ]
            marker = subjects.metric_subject(job, "w-1", "marker")
            sent = allowed + forbidden
            assert await natsprobe.reached(services.nc, shared, sent, marker) == set(allowed)
            # A per-worker user is also confined to its own worker.
            others = [
                subjects.heartbeat_subject(job, "w-2"),
                subjects.rpc_subject("checkpoint", "ack", job, "w-2"),
            ]
            got = await natsprobe.reached(services.nc, own, sent + others, marker)
            assert got == set(allowed)

            refused_to_both = [
                subjects.event_subject("other-job", "worker.registered"),
                subjects.world_subject("other-job"),
                subjects.event_subject(job, "checkpoint.committed"),
                subjects.control_subject("other-job", "w-1"),
                subjects.worker_inboxes("other-job", "w-1"),
                "_INBOX.>",
            ]
            of_other_worker = [
                subjects.control_subject(job, "w-2"),
                subjects.worker_inboxes(job, "w-2"),
            ]
            refused = await natsprobe.refused_subscriptions(shared, refused_to_both)
            assert refused == set(refused_to_both)
            # What a shared user leaves open: the other workers of its own job.
            assert not await natsprobe.refused_subscriptions(shared, of_other_worker)
            wanted = refused_to_both + of_other_worker
            assert await natsprobe.refused_subscriptions(own, wanted) == set(wanted)
            listened = [
                subjects.world_subject(job),
                subjects.event_subject(job, "barrier.released"),
                subjects.control_subject(job, "w-1"),
            ]
            assert not await natsprobe.refused_subscriptions(own, listened)
        finally:
            for client in (own, shared):
                await client.close()
            for bus in (gateway, services):
                await bus.close()


# -- what operators expect: PDBs, Ingress, monitoring, helm test, an external NATS ---------------


def test_every_service_has_a_disruption_budget(render: Render) -> None:
    rendered = render()
    budgets = {p["metadata"]["name"]: p for p in rendered.of_kind("PodDisruptionBudget")}
    for name in STRATA_SERVICES:
        budget = budgets[_name(name)]
        assert budget["spec"]["maxUnavailable"] == 1
        pod_labels = rendered.get("Deployment", _name(name))["spec"]["template"]["metadata"]
        assert budget["spec"]["selector"]["matchLabels"].items() <= pod_labels["labels"].items()
    off = render("coordinator.podDisruptionBudget.enabled=false")
    assert [p["metadata"]["name"] for p in off.of_kind("PodDisruptionBudget")] == [_name("nats")]


def test_the_ingress_routes_a_host_or_a_sub_path_to_the_dashboard(render: Render) -> None:
    assert not render().of_kind("Ingress")
    (ingress,) = render(*SCENARIOS["ingress"]).of_kind("Ingress")
    assert ingress["spec"]["ingressClassName"] == "nginx"
    assert ingress["spec"]["tls"] == [{"secretName": "strata-tls", "hosts": ["strata.example.com"]}]
    (rule,) = ingress["spec"]["rules"]
    assert rule["host"] == "strata.example.com"
    (path,) = rule["http"]["paths"]
    assert (path["path"], path["pathType"]) == ("/", "Prefix")
    assert path["backend"]["service"] == {"name": _name("dashboard"), "port": {"name": "http"}}

    (sub,) = render(*SCENARIOS["ingress-sub-path"]).of_kind("Ingress")
    assert "host" not in sub["spec"]["rules"][0]
    (path,) = sub["spec"]["rules"][0]["http"]["paths"]
    assert (path["path"], path["pathType"]) == ("/strata(/|$)(.*)", "ImplementationSpecific")
    assert sub["metadata"]["annotations"] == {"nginx.ingress.kubernetes.io/rewrite-target": "/$2"}


def test_monitors_scrape_every_services_metrics_on_its_health_port(render: Render) -> None:
    rendered = render(*SCENARIOS["service-monitor"])
    (monitor,) = rendered.of_kind("ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    (endpoint,) = monitor["spec"]["endpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("metrics", "/metrics")
    selected = [
        s
        for s in rendered.of_kind("Service")
        if monitor["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()
    ]
    assert sorted(s["spec"]["selector"]["app.kubernetes.io/component"] for s in selected) == sorted(
        STRATA_SERVICES
    )
    for service in selected:
        (port,) = service["spec"]["ports"]
        assert (port["name"], port["targetPort"], port["port"]) == ("metrics", "health", 8081)

    (pods,) = render(*SCENARIOS["pod-monitor"]).of_kind("PodMonitor")
    (endpoint,) = pods["spec"]["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("health", "/metrics")
    (expression,) = pods["spec"]["selector"]["matchExpressions"]
    assert sorted(expression["values"]) == sorted(STRATA_SERVICES)
    assert not render().of_kind("ServiceMonitor")
    assert not render().of_kind("PodMonitor")


def test_helm_test_checks_the_gateway_and_nats_from_inside_the_cluster(render: Render) -> None:
    rendered = render()
    (hook,) = rendered.of_kind("Pod")
    assert hook["metadata"]["annotations"]["helm.sh/hook"] == "test"
    spec = hook["spec"]
    assert spec["restartPolicy"] == "Never"
    (probe,) = spec["initContainers"]
    assert probe["command"][-1] == f"http://{_name('gateway')}.{NAMESPACE}.svc:8080"
    (status,) = spec["containers"]
    assert status["args"] == ["status"]
    assert _env(status)["STRATA_NATS_USER"] == "strata-services"
    # The NetworkPolicy lets the test pod reach NATS.
    assert (
        "test"
        in render().get("NetworkPolicy", _name("nats"))["spec"]["ingress"][0]["from"][0][
            "podSelector"
        ]["matchExpressions"][0]["values"]
    )
    assert not render("tests.enabled=false").of_kind("Pod")


def test_an_external_nats_gets_the_same_users_and_values_for_the_official_chart(
    render: Render,
) -> None:
    rendered = render(*SCENARIOS["external-nats"])
    data = rendered.get("ConfigMap", _name("nats-auth"))["data"]
    internal = render().get("ConfigMap", _name("nats-config"))["data"]["auth.conf"]
    assert data["auth.conf"] == internal
    values = yaml.safe_load(data["nats-chart-values.yaml"])
    assert values["config"]["merge"]["zzz$include"] == "../strata-nats-auth/auth.conf"
    users = natsconf.users(natsconf.parse(data["auth.conf"]))
    for _user, (password, _) in users.items():
        variable = values["container"]["env"][password.removeprefix("$")]
        assert variable["valueFrom"]["secretKeyRef"]["name"] == "strata-nats-credentials"
    (mount,) = [p["value"] for p in values["container"]["patch"]]
    (volume,) = [p["value"] for p in values["podTemplate"]["patch"]]
    assert mount["name"] == volume["name"]
    assert volume["configMap"]["name"] == _name("nats-auth")
    # The include, relative to the official chart's /etc/nats-config/nats.conf, is this file.
    assert (Path("/etc/nats-config") / values["config"]["merge"]["zzz$include"]).resolve() == Path(
        mount["mountPath"]
    ) / "auth.conf"


@pytest.mark.parametrize(
    ("settings", "complaint"),
    [
        (("workers.autoscaling.enabled=true",), "workers.kind=Deployment"),
        (("metrics.serviceMonitor.enabled=true", "metrics.podMonitor.enabled=true"), "one of"),
        (("workers.kind=StatefulSet",), "workers.kind"),
        (("ingress.path=strata",), "ingress.path"),
        (("workers.args={--epochs=3}",), "workers.args needs workers.command"),
    ],
)
def test_options_that_cannot_work_are_refused(
    helm: Path, settings: tuple[str, ...], complaint: str
) -> None:
    done = helm_template(helm, settings)
    assert done.returncode != 0, f"{settings} rendered"
    assert complaint in done.stderr, done.stderr


@pytest.mark.usefixtures("_schemas_read_once")
def test_the_seeds_values_file_installs_as_written(helm: Path) -> None:
    done = helm_template(helm, extra=["-f", str(Path(__file__).parent / "seed-values.yaml")])
    assert done.returncode == 0, done.stderr
    rendered = Rendered([o for o in yaml.safe_load_all(done.stdout) if o])
    for obj in rendered.objects:
        kubernetes_validate.validate(obj, KUBERNETES_VERSIONS[-1], strict=True)
    job = rendered.get("Job", _name("worker"))
    assert job["spec"]["completions"] == 4
    (worker,) = _containers(job)
    assert worker["image"] == "syrilj/strata-worker:latest"  # one string: repository:tag
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert {"name": "COORDINATOR_URL", "value": "strata-coordinator:50051"} in worker["env"]
    assert _env(worker)["STRATA_CHECKPOINTS"] == "s3://my-ml-checkpoints/checkpoints"
    for name in STRATA_SERVICES:
        deployment = rendered.get("Deployment", _name(name))
        assert deployment["spec"]["replicas"] == 1  # coordinator.replicaCount
        (container,) = _containers(deployment)
        assert container["resources"]["limits"] == {"cpu": 2, "memory": "4Gi"}
    assert not rendered.of_kind("PersistentVolumeClaim")  # S3: no checkpoints volume


def test_registry_partitions_are_deployments_of_their_own_each_told_its_partition(
    render: Render,
) -> None:
    rendered = render("coordinator.services.registry.partitions=3")
    partitions = {}
    for name in ("registry", "registry-1", "registry-2"):
        deployment = rendered.get("Deployment", _name(name))
        (container,) = _containers(deployment)
        assert container["args"] == ["serve", "registry"]
        env = _env(container)
        partitions[name] = (env["STRATA_REGISTRY_PARTITION"], env["STRATA_REGISTRY_PARTITIONS"])
        labels = deployment["spec"]["selector"]["matchLabels"]
        assert labels["app.kubernetes.io/component"] == name
    assert partitions == {
        "registry": ("0", "3"),
        "registry-1": ("1", "3"),
        "registry-2": ("2", "3"),
    }
    budgets = {b["metadata"]["name"] for b in rendered.of_kind("PodDisruptionBudget")}
    assert {_name("registry-1"), _name("registry-2")} <= budgets
    policy = rendered.get("NetworkPolicy", _name("nats"))
    client = next(r for r in policy["spec"]["ingress"] if r["ports"][0]["port"] == "client")
    (expression,) = client["from"][0]["podSelector"]["matchExpressions"]
    assert {"registry-1", "registry-2"} <= set(expression["values"])
    # One partition (the default) is the single registry of before, with no partition settings.
    (single,) = _containers(render().get("Deployment", _name("registry")))
    assert "STRATA_REGISTRY_PARTITIONS" not in _env(single)


def test_coordinator_replica_count_applies_to_every_service_unless_one_says(
    render: Render,
) -> None:
    rendered = render("coordinator.replicaCount=2", "coordinator.services.gateway.replicaCount=3")
    replicas = {
        n: rendered.get("Deployment", _name(n))["spec"]["replicas"] for n in STRATA_SERVICES
    }
    assert replicas == {"registry": 2, "sharding": 2, "barrier": 2, "checkpoint": 2, "gateway": 3}


@pytest.mark.nats
async def test_a_nats_server_set_up_as_the_official_chart_values_say_admits_strata_users(
    render: Render, tmp_path: Path
) -> None:
    """The layout the official NATS chart gives its pod with `nats-chart-values.yaml`: its own
    nats.conf in /etc/nats-config including ours from the mounted ConfigMap, the passwords in the
    environment from the operator's Secret. Every Strata user logs in; a wrong password does not."""
    rendered = render(*SCENARIOS["external-nats"])
    data = rendered.get("ConfigMap", _name("nats-auth"))["data"]
    values = yaml.safe_load(data["nats-chart-values.yaml"])
    (mount,) = [p["value"] for p in values["container"]["patch"]]
    etc = tmp_path / "etc"
    config_dir = etc / "nats-config"
    auth_dir = etc / Path(mount["mountPath"]).relative_to("/etc")
    config_dir.mkdir(parents=True)
    auth_dir.mkdir(parents=True)
    (auth_dir / "auth.conf").write_text(data["auth.conf"])
    (port,) = procutil.free_ports(1)
    # As the official chart renders config.merge: JSON-like, the include last.
    (config_dir / "nats.conf").write_text(
        "{\n"
        f'  "port": {port},\n  "host": "127.0.0.1",\n'
        f'  "jetstream": {{"store_dir": {json.dumps(str(tmp_path / "js"))}}},\n'
        f"  include {values['config']['merge']['zzz$include']};\n"
        "}\n"
    )
    secret = {  # the operator's Secret, nats.auth.existingSecret
        key: f"password-{key}"
        for key in ("services-password", "gateway-password", "workers-default-password")
    }
    env = {"PATH": "/usr/bin:/bin"}
    for variable, source in values["container"]["env"].items():
        reference = source["valueFrom"]["secretKeyRef"]
        assert reference["name"] == "strata-nats-credentials"
        env[variable] = secret[reference["key"]]
    server = Process(
        "nats",
        [str(nats_server_binary()), "-c", str(config_dir / "nats.conf")],
        env,
        tmp_path / "nats.log",
    ).start()
    url = f"nats://127.0.0.1:{port}"
    try:
        users = {
            "strata-services": "services-password",
            "strata-gateway": "gateway-password",
            "strata-workers-default": "workers-default-password",
        }
        deadline = asyncio.get_running_loop().time() + 20
        for user, key in users.items():
            while True:
                try:
                    client = await natsprobe.connect(url, user, secret[key])
                    break
                except (OSError, nats.errors.NoServersError):
                    server.check_running()
                    assert asyncio.get_running_loop().time() < deadline, "nats-server not up"
                    await asyncio.sleep(0.1)
            assert client.nc.is_connected, user
            await client.close()
        with pytest.raises(Exception, match=r"(?i)authorization"):
            await natsprobe.connect(url, "strata-services", "wrong")
    finally:
        server.stop()
