"""Settings every part of Strata reads, from the environment (and CLI flags where sensible).

The names of the environment variables are constants in `Env`, the one place they are spelled; the
seeds' storage names (`STORAGE_BACKEND`, `CHECKPOINT_BUCKET`, `AWS_REGION`) carry no prefix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final, Literal

from pydantic import AliasChoices, Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from strata.admission import AdmissionLimits
from strata.errors import ConfigError
from strata.events.models import MAX_RANK, MAX_SHARDS
from strata.events.subjects import DEFAULT_RPC_PARTITIONS, MAX_RPC_PARTITIONS


class Env:
    """Environment variable names, spelled once."""

    NATS_URL: Final = "STRATA_NATS_URL"
    JOB: Final = "STRATA_JOB"
    RANK: Final = "STRATA_RANK"
    STREAM_REPLICAS: Final = "STRATA_STREAM_REPLICAS"
    HEARTBEAT_INTERVAL: Final = "STRATA_HEARTBEAT_INTERVAL"
    HEARTBEAT_TIMEOUT: Final = "STRATA_HEARTBEAT_TIMEOUT"
    REGISTRY_PARTITIONS: Final = "STRATA_REGISTRY_PARTITIONS"
    REGISTRY_PARTITION: Final = "STRATA_REGISTRY_PARTITION"
    DATA_DIR: Final = "STRATA_DATA_DIR"
    LOG_FORMAT: Final = "STRATA_LOG_FORMAT"
    LOG_LEVEL: Final = "STRATA_LOG_LEVEL"
    HEALTH_PORT: Final = "STRATA_HEALTH_PORT"
    HTTP_PORT: Final = "STRATA_HTTP_PORT"
    LISTEN_HOST: Final = "STRATA_LISTEN_HOST"
    NATS_USER: Final = "STRATA_NATS_USER"
    NATS_PASSWORD: Final = "STRATA_NATS_PASSWORD"
    STORAGE_BACKEND: Final = "STORAGE_BACKEND"
    CHECKPOINT_BUCKET: Final = "CHECKPOINT_BUCKET"
    AWS_REGION: Final = "AWS_REGION"
    S3_ENDPOINT_URL: Final = "STRATA_S3_ENDPOINT_URL"
    TEST_NATS_URL: Final = "STRATA_TEST_NATS_URL"
    TEST_TIER: Final = "STRATA_TEST_TIER"
    API_TOKEN: Final = "STRATA_API_TOKEN"
    REPLAY_MAX_EVENTS: Final = "STRATA_REPLAY_MAX_EVENTS"
    REPLAY_TIMEOUT: Final = "STRATA_REPLAY_TIMEOUT"
    REPLAY_CONCURRENCY: Final = "STRATA_REPLAY_CONCURRENCY"
    REPLAY_SNAPSHOT_MB: Final = "STRATA_REPLAY_SNAPSHOT_MB"
    ACK_JOURNAL: Final = "STRATA_ACK_JOURNAL"
    BARRIER_RECORD_ARRIVALS_S: Final = "STRATA_BARRIER_RECORD_ARRIVALS_S"
    RPC_ADMISSION: Final = "STRATA_RPC_ADMISSION"
    RPC_JOB_RATE: Final = "STRATA_RPC_JOB_RATE"
    RPC_JOB_BURST: Final = "STRATA_RPC_JOB_BURST"
    RPC_WORKER_RATE: Final = "STRATA_RPC_WORKER_RATE"
    RPC_WORKER_BURST: Final = "STRATA_RPC_WORKER_BURST"
    RPC_JOB_PENDING: Final = "STRATA_RPC_JOB_PENDING"
    RPC_MAX_PENDING: Final = "STRATA_RPC_MAX_PENDING"
    RPC_JOB_INFLIGHT: Final = "STRATA_RPC_JOB_INFLIGHT"
    RPC_SUB_PENDING_MSGS: Final = "STRATA_RPC_SUB_PENDING_MSGS"
    RPC_SUB_PENDING_MB: Final = "STRATA_RPC_SUB_PENDING_MB"
    RPC_PARTITIONS: Final = "STRATA_RPC_PARTITIONS"
    MAX_DATASETS_PER_JOB: Final = "STRATA_MAX_DATASETS_PER_JOB"
    MAX_SHARDS_PER_DATASET: Final = "STRATA_MAX_SHARDS_PER_DATASET"
    RENDEZVOUS_JOBS: Final = "STRATA_RENDEZVOUS_JOBS"
    JETSTREAM_MAX_FILE_STORE: Final = "STRATA_JETSTREAM_MAX_FILE_STORE"
    GATEWAY_HEADER_TIMEOUT: Final = "STRATA_GATEWAY_HEADER_TIMEOUT"
    GATEWAY_MAX_CONNECTIONS: Final = "STRATA_GATEWAY_MAX_CONNECTIONS"
    GATEWAY_METRICS_MB: Final = "STRATA_GATEWAY_METRICS_MB"
    RENDEZVOUS_MAX_BYTES: Final = "STRATA_RENDEZVOUS_MAX_BYTES"
    RENDEZVOUS_MAX_KEYS: Final = "STRATA_RENDEZVOUS_MAX_KEYS"
    RENDEZVOUS_MAX_VALUE_BYTES: Final = "STRATA_RENDEZVOUS_MAX_VALUE_BYTES"


GATEWAY_HEADER_TIMEOUT_S: Final = 10.0
"""Seconds an HTTP connection to the gateway may take to send a request's headers."""
GATEWAY_MAX_CONNECTIONS: Final = 2048
"""HTTP connections the gateway holds; past it, the oldest still sending its headers is closed."""

GATEWAY_METRICS_MB: Final = 256
"""MiB the gateway's training metric history may take, all jobs together: 1,000 workers with 5
figures each, at 256 points per worker and figure."""

RENDEZVOUS_MAX_BYTES: Final = 64 * 1024**2
"""A job's rendezvous keys together, reserved from the JetStream store per job. A 1,000-agent
torchrun job keeps a state key of some 200 KB and a few small store keys per agent and round."""
RENDEZVOUS_MAX_KEYS: Final = 100_000
RENDEZVOUS_MAX_VALUE_BYTES: Final = 1024**2
"""One rendezvous key's value: the state of 1,000 agents is some 200 KB."""


LogFormat = Literal["auto", "json", "console"]


class Settings(BaseSettings):
    """Everything configurable, validated once at start-up."""

    model_config = SettingsConfigDict(env_prefix="STRATA_", extra="ignore", frozen=True)

    nats_url: str = "nats://127.0.0.1:4222"
    nats_user: str | None = None
    nats_password: str | None = None
    job: str = "default"
    rank: int | None = Field(default=None, ge=0, le=MAX_RANK)
    """The rank a worker asks the registry for when `rank=` is not given (None: the lowest free)."""
    stream_replicas: int = Field(default=1, ge=1, le=5)
    heartbeat_interval: float = Field(default=1.0, gt=0, le=300)
    heartbeat_timeout: float = Field(default=5.0, gt=0, le=3600)
    registry_partitions: int = Field(default=1, ge=1, le=256)
    """Registry processes sharing the heartbeat intake (`strata.events.subjects.partition_of`)."""
    registry_partition: int = Field(default=0, ge=0, le=255)
    """Which of them this process is; partition 0 is also the leader that decides membership."""
    data_dir: Path = Path("./.strata")
    log_format: LogFormat = "auto"
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    health_port: int = Field(default=0, ge=0, le=65535)
    http_port: int = Field(default=8080, ge=0, le=65535)
    listen_host: str = "0.0.0.0"
    """The address the HTTP ports (gateway, health and metrics) bind: all interfaces in a
    container, the `--host` of `strata up` on a workstation."""

    replay_max_events: int = Field(default=250_000, ge=1)
    """The most messages (events, plus heartbeats when asked for) one replay folds."""
    replay_timeout: float = Field(default=30.0, gt=0, le=3600)
    """Seconds one replay may take, reading included."""
    replay_concurrency: int = Field(default=2, ge=1, le=64)
    """Replays a gateway runs at once; more are refused until one ends."""
    replay_snapshot_mb: int = Field(default=256, ge=0, le=1_000_000)
    """MiB the gateway's snapshots of past states (for time travel) may take, all jobs together."""

    storage_backend: Literal["local", "s3"] = Field(
        default="local", validation_alias=AliasChoices(Env.STORAGE_BACKEND, "storage_backend")
    )
    checkpoint_bucket: str | None = Field(
        default=None, validation_alias=AliasChoices(Env.CHECKPOINT_BUCKET, "checkpoint_bucket")
    )
    aws_region: str | None = Field(
        default=None, validation_alias=AliasChoices(Env.AWS_REGION, "aws_region")
    )
    s3_endpoint_url: str | None = None
    ack_journal: Path | None = None
    """A file to append the id of every event JetStream acknowledged to (tests check it)."""
    barrier_record_arrivals_s: float = Field(default=1.0, ge=0, le=3600)
    """How long the barrier service may hold `barrier.arrived` events (the record of who waits,
    not needed for a release) before writing them; a generation's conclusion writes them at once."""
    rendezvous_jobs: str = ""
    """Jobs (comma-separated) whose rendezvous bucket the services make at start: those whose
    workers hold a credential, which may not make one. Without credentials an agent makes its
    job's bucket itself."""
    gateway_header_timeout: float = Field(default=GATEWAY_HEADER_TIMEOUT_S, gt=0, le=3600)
    gateway_max_connections: int = Field(default=GATEWAY_MAX_CONNECTIONS, ge=1, le=1_000_000)
    gateway_metrics_mb: int = Field(default=GATEWAY_METRICS_MB, ge=1, le=1_000_000)
    jetstream_max_file_store: int = Field(default=8 * 1024**3, ge=64 * 1024**2)
    """The file store of `strata up`'s embedded nats-server, in bytes: the telemetry stream's
    and every rendezvous bucket's bytes are reserved from it, the event stream has the rest."""
    rendezvous_max_bytes: int = Field(default=RENDEZVOUS_MAX_BYTES, ge=1024, le=1024**4)
    rendezvous_max_keys: int = Field(default=RENDEZVOUS_MAX_KEYS, ge=1, le=100_000_000)
    rendezvous_max_value_bytes: int = Field(
        default=RENDEZVOUS_MAX_VALUE_BYTES, ge=1024, le=8 * 1024**2
    )

    # Admission control of every service's requests (`strata.bus.admission`): defaults sized for
    # a 1,000-worker job; see docs/operations.md, "Limits".
    rpc_admission: bool = True
    """False takes every request as it comes (one FIFO, no budgets): for benchmarks only."""
    rpc_job_rate: float = Field(default=AdmissionLimits.job_rate, gt=0, le=10_000_000)
    rpc_job_burst: int = Field(default=AdmissionLimits.job_burst, ge=1, le=10_000_000)
    rpc_worker_rate: float = Field(default=AdmissionLimits.worker_rate, gt=0, le=10_000_000)
    rpc_worker_burst: int = Field(default=AdmissionLimits.worker_burst, ge=1, le=10_000_000)
    rpc_job_pending: int = Field(default=AdmissionLimits.job_pending, ge=1, le=10_000_000)
    rpc_max_pending: int = Field(default=AdmissionLimits.max_pending, ge=1, le=10_000_000)
    rpc_job_inflight: int = Field(default=AdmissionLimits.job_inflight, ge=1, le=1_000_000)
    rpc_sub_pending_msgs: int = Field(default=65_536, ge=1, le=10_000_000)
    """Requests the NATS client holds for a service before it drops (and counts) the next."""
    rpc_sub_pending_mb: int = Field(default=64, ge=1, le=65_536)
    """MiB of requests the NATS client holds for a service before it drops (and counts) more."""
    rpc_partitions: int = Field(default=DEFAULT_RPC_PARTITIONS, ge=1, le=MAX_RPC_PARTITIONS)
    """Partitions the NATS server sorts workers' requests into by job (its configuration's
    subject mapping must say the same number); each service takes each on a connection of its
    own, so a job's flood queues only in its partition's connection."""
    max_datasets_per_job: int = Field(default=256, ge=1, le=100_000)
    """Datasets one job may register (`quota_exceeded` past it)."""
    max_shards_per_dataset: int = Field(default=MAX_SHARDS, ge=1, le=MAX_SHARDS)
    """Shards one dataset may have (`quota_exceeded` past it: use larger shards)."""

    def admission_limits(self) -> AdmissionLimits | None:
        """The services' admission limits; None when admission control is off."""
        if not self.rpc_admission:
            return None
        return AdmissionLimits(
            job_rate=self.rpc_job_rate,
            job_burst=self.rpc_job_burst,
            worker_rate=self.rpc_worker_rate,
            worker_burst=self.rpc_worker_burst,
            job_pending=self.rpc_job_pending,
            max_pending=self.rpc_max_pending,
            job_inflight=self.rpc_job_inflight,
        )

    @field_validator("nats_url")
    @classmethod
    def _nats_url_scheme(cls, value: str) -> str:
        for url in value.split(","):
            if not url.strip().startswith(("nats://", "tls://", "ws://", "wss://")):
                raise ValueError(
                    f"{url.strip()!r} is not a NATS URL; use nats://host:port "
                    "(several may be given, separated by commas)"
                )
        return value

    @field_validator("heartbeat_timeout")
    @classmethod
    def _timeout_after_interval(cls, value: float, info: object) -> float:
        data = getattr(info, "data", {})
        interval = data.get("heartbeat_interval")
        if interval is not None and value <= interval:
            raise ValueError(
                f"heartbeat timeout ({value}s) must be longer than the heartbeat interval "
                f"({interval}s), or every worker would be failed between two heartbeats"
            )
        return value

    @field_validator("registry_partition")
    @classmethod
    def _partition_in_range(cls, value: int, info: object) -> int:
        partitions = getattr(info, "data", {}).get("registry_partitions")
        if partitions is not None and value >= partitions:
            raise ValueError(
                f"registry partition {value} does not exist with {partitions} partition(s): "
                f"partitions are numbered 0 to {partitions - 1}"
            )
        return value

    @property
    def rendezvous_job_list(self) -> tuple[str, ...]:
        return tuple(job.strip() for job in self.rendezvous_jobs.split(",") if job.strip())

    @property
    def nats_servers(self) -> list[str]:
        return [url.strip() for url in self.nats_url.split(",") if url.strip()]


def load_settings(**overrides: object) -> Settings:
    """Read the settings from the environment, with explicit overrides (e.g. CLI flags) on top.

    Raises `ConfigError` naming the variable and what is wrong with it.
    """
    clean = {key: value for key, value in overrides.items() if value is not None}
    try:
        return Settings(**clean)  # type: ignore[arg-type]
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            name = str(error["loc"][0]) if error["loc"] else "settings"
            env = name if name.isupper() else getattr(Env, name.upper(), f"STRATA_{name.upper()}")
            problems.append(f"{env}: {error['msg']}")
        raise ConfigError("invalid settings: " + "; ".join(problems)) from None
