"""Who may publish and subscribe to what: the NATS roles of a secured Strata deployment.

Three roles. `services` may do anything. The `gateway` reads: it may use the JetStream API to
create and read consumers but publish nothing on `strata.>`. A `worker` credential belongs to one
job and names one worker of it (`<worker>@<job>`, made by `strata up --secure`), or every worker
of one job (`strata-workers-<job>`, the job's shared user, made by the chart and by `strata up
--secure`; the worker part of its subjects is `*`): it may publish only its own heartbeats,
metric samples and requests, each on a subject that ends with its job and worker, and its answers
to its own probes (`subjects.probe_answer_subject`), and subscribe only to its job's world
notices, barrier and plan events, its own control notices, its own probes (`registry.suspect`)
and its own inbox; besides, it may use its job's keys of the torchrun rendezvous bucket. Nothing
it publishes reaches the event stream: services record every event, and the subject a request
arrives on says who sent it (see `strata.bus.rpc`). `strata up --secure` and the chart both
render these rules. The files that hold passwords or the gateway's API token are written
readable by their owner only.
--secure`; the worker part of its subjects is `*`): it may publish only its own
heartbeats, metric samples and requests, each on a subject that ends with its job and worker
(requests also where the server's subject mapping moves them: its job's partition only), and
subscribe only to its job's world notices, barrier and plan events, its own control notices,
its own probes (`registry.suspect`) and its own inbox; besides, it may use its job's keys of the
torchrun rendezvous bucket. Nothing it publishes reaches the event stream: services record every
event, and the subject a request arrives on says who sent it (see `strata.bus.rpc`). `strata up
--secure` and the chart both render these rules. The files that hold passwords or the gateway's
API token are written readable by their owner only.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from strata._files import write_private
from strata.errors import ConfigError
from strata.events import subjects
from strata.events.models import ID_PATTERN

Role = Literal["services", "gateway", "worker"]
ROLES: tuple[Role, ...] = ("services", "gateway", "worker")

WORKER_USER_SEPARATOR = "@"
"""Between the worker and the job in a worker credential's user name: no id contains it."""
_ID = re.compile(ID_PATTERN)

JOB_USER_PREFIX = "strata-workers-"
"""Before the job in the user name of a credential every worker of the job shares."""

WORKER_DENY = (
    subjects.all_control(),
    subjects.kv_subject(subjects.SNAPSHOT_BUCKET, ">"),
    *subjects.JETSTREAM_MANAGE_API,
)
"""Denied to a worker credential whatever it is allowed: notices to workers, the snapshot bucket
and the JetStream API that manages streams and consumers. Its only JetStream use is its job's
rendezvous keys (`rendezvous_permissions`); everything else is outside its allow list anyway."""

WORKER_EVENTS = ("barrier",)
"""Areas of its job's events a worker listens to: barrier outcomes (membership reaches it as the
registry's world notices, and its plan as `shard.plan_changed`)."""


@dataclass(frozen=True)
class Permissions:
    publish_allow: tuple[str, ...]
    publish_deny: tuple[str, ...]
    subscribe_allow: tuple[str, ...]


def worker_user(job: str, worker: str) -> str:
    """The NATS user name of a credential for one worker of one job."""
    return f"{worker}{WORKER_USER_SEPARATOR}{job}"


def worker_identity(user: str | None) -> tuple[str, str] | None:
    """(job, worker) a worker credential's user name stands for, or None for any other user."""
    if not user or user.count(WORKER_USER_SEPARATOR) != 1:
        return None
    worker, job = user.split(WORKER_USER_SEPARATOR)
    if not (_ID.match(worker) and _ID.match(job)) or "\n" in user:
        return None
    return job, worker


def job_user(job: str) -> str:
    """The NATS user name of the credential every worker of `job` shares."""
    return JOB_USER_PREFIX + job


def job_of_shared_user(user: str | None) -> str | None:
    """The job whose shared credential `user` is (`job_user`), or None for any other user."""
    if not user or not user.startswith(JOB_USER_PREFIX) or "\n" in user:
        return None
    job = user.removeprefix(JOB_USER_PREFIX)
    return job if _ID.match(job) and WORKER_USER_SEPARATOR not in job else None


def worker_permissions(
    job: str, worker: str, rpc_partitions: int = subjects.DEFAULT_RPC_PARTITIONS
) -> Permissions:
    """What a credential of `worker` (`*`: every worker) of `job` may do. Its requests are
    allowed on their own subjects and on their job's partition (`rpc_partitions` of them), where
    the NATS server's subject mapping moves them before it checks the permission; no other
    partition, so a job's requests never reach the connections that serve another partition."""
    rendezvous = rendezvous_permissions(job)
    return Permissions(
        publish_allow=(
            subjects.heartbeat_subject(job, worker),
            subjects.worker_metrics(job, worker),
            subjects.caller_rpcs(job, worker),
            subjects.probe_answer_subject(job, worker, "*"),
            subjects.caller_partition_rpcs(job, worker, rpc_partitions),
            *rendezvous.publish_allow,
        ),
        publish_deny=WORKER_DENY,
        subscribe_allow=(
            *(subjects.area_events(job, area) for area in WORKER_EVENTS),
            subjects.event_subject(job, "shard.plan_changed"),
            subjects.world_subject(job),
            subjects.control_subject(job, worker),
            subjects.probe_subject(job, worker, "*"),
            subjects.worker_inboxes(job, worker),
            *rendezvous.subscribe_allow,
        ),
    )


# -- torchrun rendezvous --------------------------------------------------------------------------


def rendezvous_permissions(job: str) -> Permissions:
    """What every worker credential of `job` may do in the rendezvous bucket, so that a torchrun
    agent of the job runs on it (`strata.torch.rendezvous`): its job's keys only.

    - write (put, create, update, delete: each a message on the key's own subject) the keys
      under the job's prefix, where every state and store key of the job is;
    - read them, by JetStream direct gets whose subject names the key (a get by sequence or a
      batch names what it reads in the body, which permissions cannot see: not allowed);
    - listen to their subjects, to wake when a key it waits for is written.

    Nothing else of JetStream: no stream or consumer info, creation, update, purge or deletion
    (a consumer's settings, such as the subject it delivers to, are in the request's body too).
    The bucket refuses rollup headers and API purges (`strata.bus.streams.rendezvous_stream`), so
    a message on the job's subjects changes only that one key. A credential of one worker gets
    the whole job's keys: the rendezvous is the job's agents' common state, as the job's store
    is, so the agents of a job trust each other there.
    """
    return Permissions(
        publish_allow=(subjects.rendezvous_subjects(job), subjects.rendezvous_reads(job)),
        publish_deny=(),
        subscribe_allow=(subjects.rendezvous_subjects(job),),
    )


def permissions(
    role: Role, user: str, rpc_partitions: int = subjects.DEFAULT_RPC_PARTITIONS
) -> Permissions:
    """The permissions of `user` in `role` (a worker's user name is `<worker>@<job>`), with
    workers' requests sorted into `rpc_partitions` (`STRATA_RPC_PARTITIONS`)."""
    if role == "services":
        return Permissions((">",), (), (">",))
    if role == "gateway":
        return Permissions(
            subjects.JETSTREAM_READ_API,
            (subjects.all_strata(),),
            (subjects.all_strata(), subjects.DEFAULT_INBOXES),
        )
    identity = worker_identity(user)
    if identity is None:
        shared = job_of_shared_user(user)
        if shared is not None:
            return worker_permissions(shared, "*", rpc_partitions)
        raise ConfigError(
            f"worker credential {user!r} names no job and worker: worker user names are "
            f"<worker>{WORKER_USER_SEPARATOR}<job>, or {JOB_USER_PREFIX}<job> for one every "
            "worker of the job shares (strata up --secure makes both)"
        )
    job, worker = identity
    return worker_permissions(job, worker, rpc_partitions)


@dataclass(frozen=True)
class Credential:
    user: str
    password: str
    role: Role

    def env(self) -> dict[str, str]:
        from strata.config import Env

        return {Env.NATS_USER: self.user, Env.NATS_PASSWORD: self.password}

    @property
    def identity(self) -> tuple[str, str] | None:
        """(job, worker) of a one-worker credential, None for the others."""
        return worker_identity(self.user) if self.role == "worker" else None

    @property
    def job(self) -> str | None:
        """The job of a worker credential, one worker's or the job's shared one."""
        if self.role != "worker":
            return None
        identity = worker_identity(self.user)
        return identity[0] if identity is not None else job_of_shared_user(self.user)


def _quoted(items: tuple[str, ...]) -> str:
    return "[" + ", ".join(json.dumps(item) for item in items) + "]"


def authorization_config(
    credentials: list[Credential], rpc_partitions: int = subjects.DEFAULT_RPC_PARTITIONS
) -> str:
    """The `authorization { users = [...] }` block of a nats-server configuration whose subject
    mapping sorts requests into `rpc_partitions`."""
    lines = ["authorization {", "  users = ["]
    for cred in credentials:
        perms = permissions(cred.role, cred.user, rpc_partitions)
        publish = f"allow: {_quoted(perms.publish_allow)}"
        if perms.publish_deny:
            publish += f", deny: {_quoted(perms.publish_deny)}"
        lines.append(
            f"    {{user: {json.dumps(cred.user)}, password: {json.dumps(cred.password)}, "
            f"permissions: {{publish: {{{publish}}}, "
            f"subscribe: {{allow: {_quoted(perms.subscribe_allow)}}}}}}}"
        )
    lines += ["  ]", "}"]
    return "\n".join(lines)


def _check_id(kind: str, value: str) -> str:
    if not _ID.match(value) or "\n" in value:
        raise ConfigError(f"{kind} {value!r} of a worker credential must match {ID_PATTERN}")
    return value


def service_credentials() -> list[Credential]:
    """Fresh random passwords for the services and the gateway."""
    return [
        Credential("strata-services", secrets.token_urlsafe(24), "services"),
        Credential("strata-gateway", secrets.token_urlsafe(24), "gateway"),
    ]


def worker_credentials(job: str, workers: list[str]) -> list[Credential]:
    """Fresh random passwords for each named worker of `job`."""
    _check_id("job", job)
    return [
        Credential(worker_user(job, _check_id("worker", name)), secrets.token_urlsafe(24), "worker")
        for name in workers
    ]


def job_credential(job: str) -> Credential:
    """A fresh random password for the credential every worker of `job` shares (`job_user`):
    for processes that pick their worker id themselves, such as torchrun's ranks (`rank-N`)."""
    return Credential(job_user(_check_id("job", job)), secrets.token_urlsafe(24), "worker")


def generate_credentials(job: str, workers: list[str]) -> list[Credential]:
    """Fresh random passwords for the services, the gateway and each named worker of `job`."""
    return service_credentials() + worker_credentials(job, workers)


def save_credentials(path: Path, credentials: list[Credential]) -> None:
    """Write them readable by the owner only."""
    write_private(path, json.dumps([asdict(c) for c in credentials], indent=2))


def load_credentials(path: Path) -> list[Credential]:
    try:
        raw = json.loads(path.read_text())
        return [Credential(c["user"], c["password"], c["role"]) for c in raw]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"cannot read credentials from {path}: {exc}") from None


def by_role(credentials: list[Credential], role: Role) -> list[Credential]:
    return [c for c in credentials if c.role == role]


def api_token(path: Path) -> str:
    """The gateway's API token kept in `path`, made (and written readable by the owner only) if
    there is none yet, so a restarted stack keeps the token its users already hold."""
    if path.exists():
        try:
            token = path.read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ConfigError(f"cannot read the API token from {path}: {exc}") from None
        if token:
            return token
    token = secrets.token_urlsafe(32)
    write_private(path, token + "\n")
    return token
