"""Who may publish and subscribe to what: the NATS roles of a secured Strata deployment.

Three roles. `services` may do anything. A `worker` may publish only its own heartbeats, checkpoint
acks and RPC requests, and subscribe only to what the SDK listens to; its NATS user name is its
worker id, which is how "its own" heartbeats are told apart. The `gateway` reads: it may use the
JetStream API to create and read consumers but publish nothing on `strata.>`. `strata up --secure`
and the Helm chart both render these rules. The files that hold passwords or the gateway's API
token are written readable by their owner only.
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

Role = Literal["services", "gateway", "worker"]
ROLES: tuple[Role, ...] = ("services", "gateway", "worker")

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,127}$")

INBOX = "_INBOX.>"
JS_READ_API = (
    "$JS.API.INFO",
    "$JS.API.STREAM.INFO.>",
    "$JS.API.STREAM.NAMES",
    "$JS.API.STREAM.LIST",
    "$JS.API.STREAM.MSG.GET.>",
    "$JS.API.DIRECT.GET.>",
    "$JS.API.CONSUMER.CREATE.>",
    "$JS.API.CONSUMER.INFO.>",
    "$JS.API.CONSUMER.DELETE.>",
    "$JS.FC.>",
)


@dataclass(frozen=True)
class Permissions:
    publish_allow: tuple[str, ...]
    publish_deny: tuple[str, ...]
    subscribe_allow: tuple[str, ...]


def permissions(role: Role, user: str) -> Permissions:
    """The permissions of `user` in `role` (a worker's user name is its worker id)."""
    if role == "services":
        return Permissions((">",), (), (">",))
    if role == "gateway":
        return Permissions(JS_READ_API, (f"{subjects.ROOT}.>",), (f"{subjects.ROOT}.>", INBOX))
    worker = subjects.token(user)
    return Permissions(
        publish_allow=(
            f"{subjects.HEARTBEATS}.*.{worker}",
            f"{subjects.METRICS}.*.*",
            f"{subjects.EVENTS}.*.checkpoint.shard_saved",
            f"{subjects.RPC}.*.*",
        ),
        publish_deny=(),
        subscribe_allow=(
            f"{subjects.EVENTS}.*.worker.*",
            f"{subjects.EVENTS}.*.barrier.*",
            f"{subjects.EVENTS}.*.shard.plan_changed",
            f"{subjects.CONTROL}.*.{worker}",
            f"{subjects.WORLD}.*",
            INBOX,
        ),
    )


@dataclass(frozen=True)
class Credential:
    user: str
    password: str
    role: Role

    def env(self) -> dict[str, str]:
        from strata.config import Env

        return {Env.NATS_USER: self.user, Env.NATS_PASSWORD: self.password}


def _quoted(items: tuple[str, ...]) -> str:
    return "[" + ", ".join(json.dumps(item) for item in items) + "]"


def authorization_config(credentials: list[Credential]) -> str:
    """The `authorization { users = [...] }` block of a nats-server configuration."""
    lines = ["authorization {", "  users = ["]
    for cred in credentials:
        perms = permissions(cred.role, cred.user)
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


def generate_credentials(workers: list[str]) -> list[Credential]:
    """Fresh random passwords for the services, the gateway and each named worker."""
    for name in workers:
        if not _NAME.match(name):
            raise ConfigError(f"worker credential name {name!r} must match {_NAME.pattern}")
    made = [
        Credential("strata-services", secrets.token_urlsafe(24), "services"),
        Credential("strata-gateway", secrets.token_urlsafe(24), "gateway"),
    ]
    made += [Credential(name, secrets.token_urlsafe(24), "worker") for name in workers]
    return made


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
