"""torchrun's rendezvous on Strata: `torchrun --rdzv-backend=strata --rdzv-endpoint=HOST:PORT
--rdzv-id=JOB train.py`.

torch's `DynamicRendezvousHandler` does the rendezvous (min and max nodes, elastic join and leave,
restarts, `--max-restarts`, keep-alives) as with the c10d backend; it keeps its state through a
`RendezvousBackend`, here `JetStreamRendezvousBackend`: one key of the replicated
`STRATA_RENDEZVOUS` bucket per job, whose revision is the fencing token. The store the agents
share is `KVStore`, in the same bucket, so no single agent's death loses either. torch finds the
backend through the `torchrun.handlers` entry point `strata` (see pyproject.toml).

The rendezvous id is the Strata job, and the agent passes the NATS URL and the job on to its
workers (`STRATA_NATS_URL`, `STRATA_JOB`, unless already set), so `strata.default_worker()` in each
rank joins the same job with torch's rank.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Coroutine
from datetime import timedelta
from typing import Any, TypeVar

import nats.errors
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousParameters,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousBackend,
    Token,
    create_handler,
)

from strata._loop import LoopRunner
from strata.config import Env, Settings, load_settings
from strata.errors import BusError, ConfigError
from strata.events import subjects
from strata.events.models import ID_PATTERN
from strata.torch.store import KVStore, RendezvousBucket

__all__ = [
    "BACKEND_NAME",
    "JetStreamRendezvousBackend",
    "create_backend",
    "create_rdzv_handler",
    "handler",
    "nats_servers",
]

BACKEND_NAME = "strata"
DEFAULT_PORT = 4222
DEFAULT_READ_TIMEOUT_S = 60
_SCHEMES = ("nats://", "tls://", "ws://", "wss://")
_ID = re.compile(ID_PATTERN)

T = TypeVar("T")


def nats_servers(endpoint: str, settings: Settings) -> list[str]:
    """The NATS servers an `--rdzv-endpoint` names: `HOST[:PORT]` (port 4222 by default) or NATS
    URLs, several separated by commas; none (torchrun's default) means `STRATA_NATS_URL`."""
    if not endpoint.strip():
        return settings.nats_servers
    servers = []
    for part in (piece.strip() for piece in endpoint.split(",")):
        if not part:
            continue
        if "://" in part:
            if not part.startswith(_SCHEMES):
                raise ConfigError(
                    f"rendezvous endpoint {part!r} is not a NATS address; give HOST:PORT or "
                    "nats://HOST:PORT"
                )
            servers.append(part)
            continue
        host, colon, port = part.rpartition(":")
        if not colon or host.endswith(":"):  # no port, or a bare IPv6 address
            host, port = part, str(DEFAULT_PORT)
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(
                f"rendezvous endpoint {part!r} is not HOST:PORT (e.g. 10.0.0.5:4222) "
                "or a nats:// URL"
            )
        servers.append(f"nats://{host}:{port}")
    if not servers:
        raise ConfigError(f"rendezvous endpoint {endpoint!r} names no NATS server")
    return servers


def _check_run_id(run_id: str) -> str:
    if not _ID.match(run_id):
        raise ConfigError(
            f"--rdzv-id {run_id!r} is not a valid Strata job id: letters, digits, '_', '.', '-', "
            "starting with a letter or digit, at most 128 characters"
        )
    return run_id


class JetStreamRendezvousBackend(RendezvousBackend):
    """torch's rendezvous state for one run, in one key of the rendezvous bucket.

    The fencing token is the key's revision: a write names the revision it read and JetStream
    refuses it when another agent wrote since, as etcd's compare-and-swap does for torch's etcd
    backend. JetStream leader changes are retried for up to a minute; past that, or with NATS
    unreachable, torch sees a `RendezvousConnectionError`.
    """

    def __init__(self, bucket: RendezvousBucket, runner: LoopRunner, run_id: str) -> None:
        self._bucket = bucket
        self._runner = runner
        self._key = subjects.rendezvous_state_key(_check_run_id(run_id))

    @property
    def name(self) -> str:
        return BACKEND_NAME

    def close(self) -> None:
        """Close the NATS connection and its event loop (the store shares them). torchrun never
        calls it: the agent's process ends instead."""
        try:
            self._runner.run(self._bucket.close())
        finally:
            self._runner.close()

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        try:
            return self._runner.run(coro)
        except (BusError, nats.errors.Error, TimeoutError, OSError) as exc:
            raise RendezvousConnectionError(
                f"the Strata rendezvous backend could not reach JetStream: {exc}"
            ) from exc

    def get_state(self) -> tuple[bytes, Token] | None:
        return self._call(self._bucket.read(self._key))

    def set_state(
        self, state: bytes, token: Token | None = None
    ) -> tuple[bytes, Token, bool] | None:
        if token is not None and not isinstance(token, int):
            # A token from another backend can never match: report the state as it is.
            current = self.get_state()
            return None if current is None else (*current, False)
        revision = self._call(self._bucket.swap(self._key, state, token))
        if revision is not None:
            return state, revision, True
        current = self.get_state()
        return None if current is None else (*current, False)


def create_backend(params: RendezvousParameters) -> tuple[JetStreamRendezvousBackend, KVStore]:
    """The backend and store of one agent, on one NATS connection of its own.

    `--rdzv-conf read_timeout=S` sets the store's timeout (60 seconds by default, as for c10d).
    """
    settings = load_settings()
    servers = nats_servers(params.endpoint, settings)
    run_id = _check_run_id(params.run_id)
    read_timeout = params.get_as_int("read_timeout", DEFAULT_READ_TIMEOUT_S)
    if read_timeout is None or read_timeout <= 0:
        raise ConfigError(f"read_timeout must be a positive number of seconds, not {read_timeout}")
    runner = LoopRunner(name=f"strata-rendezvous-{run_id}")
    try:
        bucket = runner.run(RendezvousBucket.open(servers, settings))
    except BaseException:
        runner.close()
        raise
    store = KVStore(bucket, runner, run_id, timeout=timedelta(seconds=read_timeout))
    # Passed on to the workers this agent starts, so their Strata worker joins this job on this
    # NATS; a value the user set stays.
    os.environ.setdefault(Env.NATS_URL, ",".join(servers))
    os.environ.setdefault(Env.JOB, run_id)
    return JetStreamRendezvousBackend(bucket, runner, run_id), store


def create_rdzv_handler(params: RendezvousParameters) -> RendezvousHandler:
    """torch's dynamic rendezvous handler, with its state and store in JetStream."""
    backend, store = create_backend(params)
    return create_handler(store, backend, params)


def handler() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """The `torchrun.handlers` entry point: torch calls it for the handler's factory."""
    return create_rdzv_handler
