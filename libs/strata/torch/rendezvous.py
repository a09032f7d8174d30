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
rank joins the same job with torch's rank. Every key of a job starts with the job's own prefix,
so a worker credential of the job may be let use the job's keys and no other's
(`strata.security.rendezvous_permissions`).

A finished run's id can be used again at once, as with c10d: a closed rendezvous that no agent of
its run keeps alive any more reads as a new one (`reusable`).

torch imports this module in every torchrun agent, whatever its backend, so it imports nothing
of its own until torch asks for a handler: nats, pydantic and the SDK come with
`create_rdzv_handler`.
"""

from __future__ import annotations

import contextlib
import io
import pickle
from collections.abc import Callable, Coroutine
from datetime import UTC, datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any, TypeGuard, TypeVar

# The entry point and the factory come before torch's imports: importing this module first (not
# through torch) imports torch's rendezvous package, which loads every `torchrun.handlers` entry
# point, this one included, while this module is still half made.


def handler() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """The `torchrun.handlers` entry point: torch calls it for the handler's factory."""
    return create_rdzv_handler


def create_rdzv_handler(params: RendezvousParameters) -> RendezvousHandler:
    """torch's dynamic rendezvous handler, with its state and store in JetStream."""
    backend, store = create_backend(params)
    rdzv = create_handler(store, backend, params)
    # torch's factory reads the handler's settings from `params`; only `shutdown` differs.
    rdzv.__class__ = StrataRendezvousHandler
    assert isinstance(rdzv, StrataRendezvousHandler)
    rdzv._strata_backend = backend
    return rdzv


from torch.distributed.elastic.rendezvous import (  # noqa: E402
    RendezvousConnectionError,
    RendezvousError,
    RendezvousHandler,
    RendezvousParameters,
    RendezvousStateError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (  # noqa: E402
    DynamicRendezvousHandler,
    RendezvousBackend,
    Token,
    _NodeDesc,
    _RendezvousState,
    create_handler,
)

if TYPE_CHECKING:
    from strata._loop import LoopRunner
    from strata.config import Settings
    from strata.torch.store import KVStore, RendezvousBucket

__all__ = [
    "BACKEND_NAME",
    "ForbiddenRendezvousState",
    "JetStreamRendezvousBackend",
    "create_backend",
    "create_rdzv_handler",
    "handler",
    "nats_servers",
    "reusable",
    "validated_state",
]

BACKEND_NAME = "strata"
DEFAULT_PORT = 4222
DEFAULT_READ_TIMEOUT_S = 60
KEEP_ALIVE_INTERVAL_S = 5
KEEP_ALIVE_MAX_ATTEMPT = 3
"""torch's defaults for `--rdzv-conf keep_alive_interval` and `keep_alive_max_attempt`: an agent
whose last keep-alive is older than their product is dead to torch, and so to `reusable`."""
AGENT_INBOX = "torchrun-agent"
"""The worker part of an agent's inbox prefix when its credential is not one worker's."""
LEAVE_ATTEMPTS = 100
_SCHEMES = ("nats://", "tls://", "ws://", "wss://")

T = TypeVar("T")


def nats_servers(endpoint: str, settings: Settings) -> list[str]:
    """The NATS servers an `--rdzv-endpoint` names: `HOST[:PORT]` (port 4222 by default) or NATS
    URLs, several separated by commas; none (torchrun's default) means `STRATA_NATS_URL`. A
    malformed one is an `InvalidArgument`, a `ValueError` as torch's c10d backend raises."""
    from strata.errors import InvalidArgument

    if not endpoint.strip():
        return settings.nats_servers
    servers = []
    for part in (piece.strip() for piece in endpoint.split(",")):
        if not part:
            continue
        if "://" in part:
            if not part.startswith(_SCHEMES):
                raise InvalidArgument(
                    f"rendezvous endpoint {part!r} is not a NATS address; give HOST:PORT or "
                    "nats://HOST:PORT"
                )
            servers.append(part)
            continue
        host, colon, port = part.rpartition(":")
        if not colon or host.endswith(":"):  # no port, or a bare IPv6 address
            host, port = part, str(DEFAULT_PORT)
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidArgument(
                f"rendezvous endpoint {part!r} is not HOST:PORT (e.g. 10.0.0.5:4222) "
                "or a nats:// URL"
            )
        servers.append(f"nats://{host}:{port}")
    if not servers:
        raise InvalidArgument(f"rendezvous endpoint {endpoint!r} names no NATS server")
    return servers


DEFAULT_RUN_ID = "none"
"""The id torchrun (and `accelerate launch`, which has no option for it) gives without
`--rdzv-id`: every such job would share one rendezvous, so it means the job in STRATA_JOB."""


def _check_run_id(run_id: str) -> str:
    import os
    import re

    from strata.config import Env
    from strata.errors import ConfigError, InvalidArgument
    from strata.events.models import ID_PATTERN

    if run_id == DEFAULT_RUN_ID:
        job = os.environ.get(Env.JOB)
        if not job:
            raise ConfigError(
                f"no rendezvous id: give --rdzv-id JOB, or set {Env.JOB} (accelerate launch "
                "takes no --rdzv-id: set the variable)"
            )
        run_id = job

    if not re.match(ID_PATTERN, run_id):
        raise InvalidArgument(
            f"--rdzv-id {run_id!r} is not a valid Strata job id: letters, digits, '_', '.', '-', "
            "starting with a letter or digit, at most 128 characters"
        )
    return run_id


from strata.errors import Forbidden  # noqa: E402


class ForbiddenRendezvousState(Forbidden, RendezvousStateError):
    """The job's rendezvous state key holds something other than torch's rendezvous state.

    A `forbidden` StrataError, and the `RendezvousStateError` torch raises for a corrupt state.
    """


_MODULE = _RendezvousState.__module__
_STATE_TYPES: dict[tuple[str, str], type] = {
    (_MODULE, "_RendezvousState"): _RendezvousState,
    (_MODULE, "_NodeDesc"): _NodeDesc,
    ("datetime", "datetime"): datetime,
    ("datetime", "timedelta"): timedelta,
    ("datetime", "timezone"): timezone,
}
"""Every type torch's pickle of a `_RendezvousState` names: nothing else is ever looked up."""
_STATE_FIELDS = frozenset(vars(_RendezvousState()))


class _StateUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = _STATE_TYPES.get((module, name))
        if found is None:
            raise ForbiddenRendezvousState(
                f"the rendezvous state refers to {module}.{name}, which is not one of torch's "
                "rendezvous state types; it is not loaded (another writer of the job's state "
                "key wrote it)",
                type=f"{module}.{name}",
            )
        return found


def checked_state(value: bytes) -> _RendezvousState:
    """The rendezvous state in `value`, unpickled with an allow-list of torch's state types and
    checked field by field, or `ForbiddenRendezvousState`.

    Any worker credential of a job may write the job's state key, and torch unpickles whatever
    the backend hands it: so the backend hands it only a state it rebuilt from these types.
    """
    try:
        state = _StateUnpickler(io.BytesIO(value)).load()
    except ForbiddenRendezvousState:
        raise
    except Exception as exc:
        raise ForbiddenRendezvousState(
            f"the rendezvous state cannot be read as torch's: {type(exc).__name__}: {exc}"
        ) from None
    if not _well_formed(state):
        raise ForbiddenRendezvousState(
            "the rendezvous state is not a well-formed torch rendezvous state; it is not used"
        )
    return state


def _well_formed(state: object) -> TypeGuard[_RendezvousState]:
    if type(state) is not _RendezvousState or set(vars(state)) != _STATE_FIELDS:
        return False

    def node(value: object) -> bool:
        return (
            type(value) is _NodeDesc
            and set(vars(value)) == {"addr", "pid", "local_id"}
            and type(value.addr) is str
            and type(value.pid) is int
            and type(value.local_id) is int
        )

    return (
        type(state.round) is int
        and type(state.complete) is bool
        and type(state.closed) is bool
        and (state.deadline is None or type(state.deadline) is datetime)
        and type(state.participants) is dict
        and all(node(k) and type(v) is int for k, v in state.participants.items())
        and type(state.wait_list) is set
        and all(node(k) for k in state.wait_list)
        and type(state.redundancy_list) is set
        and all(node(k) for k in state.redundancy_list)
        and type(state.last_heartbeats) is dict
        and all(node(k) and type(v) is datetime for k, v in state.last_heartbeats.items())
    )


def validated_state(value: bytes) -> bytes:
    """`value` unpickled through `checked_state` and pickled again: the bytes torch unpickles."""
    return pickle.dumps(checked_state(value))


def _decode(value: bytes) -> _RendezvousState | None:
    try:
        return checked_state(value)
    except RendezvousStateError:
        return None


def reusable(value: bytes, now: datetime, expiry: timedelta) -> bytes | None:
    """A new rendezvous's state in place of a finished run's `value`, or None when `value` is
    not finished.

    Finished: closed (torchrun closes it when the job ends, whatever the outcome), and no agent
    of the run keeps it alive any more: each agent takes itself out of `last_heartbeats` once it
    has closed it (`StrataRendezvousHandler.shutdown`), and one killed before that is dead to
    torch once its last keep-alive is older than `expiry`. An agent of the run that is still
    running keeps its keep-alives fresh, so it, and every newcomer, still sees the run closed.
    The new state starts at the next round, so that the store keys of the new run's rounds (the
    round is in their prefix) are never the finished run's.
    """
    state = _decode(value)
    if state is None or not state.closed:
        return None
    if any(beat >= now - expiry for beat in state.last_heartbeats.values()):
        return None
    fresh = _RendezvousState()
    fresh.round = state.round + 1
    return pickle.dumps(fresh)


class JetStreamRendezvousBackend(RendezvousBackend):
    """torch's rendezvous state for one run, in one key of the rendezvous bucket.

    The fencing token is the key's revision: a write names the revision it read and JetStream
    refuses it when another agent wrote since, as etcd's compare-and-swap does for torch's etcd
    backend. A finished run's state reads as a new rendezvous at the same revision (`reusable`),
    so of two agents starting a new run, one writes over it and the other is refused and reads
    what the first wrote. A call NATS does not answer within `timeout` (the rendezvous's
    `read_timeout`: a leader election that takes longer, NATS unreachable) is a
    `RendezvousConnectionError` to torch, as with its c10d and etcd backends.
    """

    def __init__(
        self,
        bucket: RendezvousBucket,
        runner: LoopRunner,
        run_id: str,
        keep_alive_expiry: timedelta = timedelta(
            seconds=KEEP_ALIVE_INTERVAL_S * KEEP_ALIVE_MAX_ATTEMPT
        ),
        timeout: timedelta = timedelta(seconds=DEFAULT_READ_TIMEOUT_S),
    ) -> None:
        from strata.events import subjects

        self._bucket = bucket
        self._runner = runner
        self._key = subjects.rendezvous_state_key(_check_run_id(run_id))
        self._expiry = keep_alive_expiry
        self._timeout = timeout.total_seconds()

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
        import nats.errors

        from strata.errors import BusError

        try:
            return self._runner.run(coro, timeout=self._timeout)
        except TimeoutError:
            raise RendezvousConnectionError(
                "the Strata rendezvous backend got no answer from JetStream within its "
                f"read_timeout of {self._timeout:.0f}s; is the NATS cluster reachable and has "
                "JetStream a leader?"
            ) from None
        except (BusError, nats.errors.Error, OSError) as exc:
            raise RendezvousConnectionError(
                f"the Strata rendezvous backend could not reach JetStream: {exc}"
            ) from exc

    def get_state(self) -> tuple[bytes, Token] | None:
        current = self._call(self._bucket.read(self._key))
        if current is None:
            return None
        value, revision = current
        value = validated_state(value)
        fresh = reusable(value, datetime.now(UTC), self._expiry)
        return (fresh if fresh is not None else value), revision

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

    def leave(self, node: _NodeDesc) -> None:
        """Take `node` out of the state's keep-alives (and lists), so that a closed rendezvous
        whose agents have all left is reusable at once."""
        for _ in range(LEAVE_ATTEMPTS):
            current = self._call(self._bucket.read(self._key))
            state = None if current is None else _decode(current[0])
            if current is None or state is None or node not in state.last_heartbeats:
                return
            del state.last_heartbeats[node]
            state.participants.pop(node, None)
            state.wait_list.discard(node)
            state.redundancy_list.discard(node)
            if self._call(self._bucket.swap(self._key, pickle.dumps(state), current[1])):
                return
        raise RendezvousError(f"leaving the rendezvous lost {LEAVE_ATTEMPTS} races in a row")


class StrataRendezvousHandler(DynamicRendezvousHandler):
    """torch's dynamic rendezvous handler, which also leaves the state's keep-alives when it
    shuts down (after closing the rendezvous, as torch's does), so the run id can be reused."""

    _strata_backend: JetStreamRendezvousBackend

    def shutdown(self) -> bool:
        closed = super().shutdown()
        if closed:
            # A failure here costs only the wait for this agent's keep-alive to expire.
            with contextlib.suppress(RendezvousError):
                self._strata_backend.leave(self._this_node)
        return closed


def _inbox_prefix(run_id: str, user: str | None) -> str:
    """Where the agent's replies come: a worker credential's own inbox (which must be of this
    job), else an inbox of the job's that the job's shared worker user may read."""
    from strata.errors import ConfigError
    from strata.events import subjects
    from strata.security import job_of_shared_user, worker_identity

    identity = worker_identity(user)
    if identity is None:
        shared = job_of_shared_user(user)
        if shared is not None and shared != run_id:
            raise ConfigError(
                f"the NATS credential {user!r} is shared by the workers of job {shared!r}, but "
                f"--rdzv-id is {run_id!r}: use that job's credential, or that job as the "
                "rendezvous id"
            )
        return subjects.worker_inbox_prefix(run_id, AGENT_INBOX)
    job, worker = identity
    if job != run_id:
        raise ConfigError(
            f"the NATS credential {user!r} is for job {job!r}, but --rdzv-id is {run_id!r}: "
            "use that job's credential, or that job as the rendezvous id"
        )
    return subjects.worker_inbox_prefix(job, worker)


def create_backend(params: RendezvousParameters) -> tuple[JetStreamRendezvousBackend, KVStore]:
    """The backend and store of one agent, on one NATS connection of its own.

    `--rdzv-conf read_timeout=S` (60 seconds by default, as for c10d) bounds every call: the
    first connection, each state read or write, each store call. As torch's c10d backend does,
    a bad option raises `ValueError` (`InvalidArgument`) and NATS not reached within
    `read_timeout` raises `RendezvousConnectionError`.
    """
    import os

    import nats.errors

    from strata._loop import LoopRunner
    from strata.config import Env, load_settings
    from strata.errors import BusError, InvalidArgument
    from strata.torch.store import KVStore, RendezvousBucket

    settings = load_settings()
    servers = nats_servers(params.endpoint, settings)
    run_id = _check_run_id(params.run_id)
    read_timeout = params.get_as_int("read_timeout", DEFAULT_READ_TIMEOUT_S)
    if read_timeout is None or read_timeout <= 0:
        raise InvalidArgument(
            f"read_timeout must be a positive number of seconds, not {read_timeout} "
            "(--rdzv-conf read_timeout=60)"
        )
    interval = params.get_as_int("keep_alive_interval", KEEP_ALIVE_INTERVAL_S) or 0
    attempts = params.get_as_int("keep_alive_max_attempt", KEEP_ALIVE_MAX_ATTEMPT) or 0
    inbox = _inbox_prefix(run_id, settings.nats_user)
    runner = LoopRunner(name=f"strata-rendezvous-{run_id}")
    opening = RendezvousBucket.open(
        servers, settings, run_id, inbox_prefix=inbox, deadline=read_timeout
    )
    try:
        bucket = runner.run(opening, timeout=read_timeout)
    except (TimeoutError, BusError, nats.errors.Error, OSError) as exc:
        runner.close()
        raise RendezvousConnectionError(
            f"the Strata rendezvous backend could not reach NATS at {', '.join(servers)} within "
            f"its read_timeout of {read_timeout}s: {exc}"
        ) from None
    except BaseException:
        runner.close()
        raise
    store = KVStore(bucket, runner, run_id, timeout=timedelta(seconds=read_timeout))
    # Passed on to the workers this agent starts, so their Strata worker joins this job on this
    # NATS; a value the user set stays.
    os.environ.setdefault(Env.NATS_URL, ",".join(servers))
    os.environ.setdefault(Env.JOB, run_id)
    backend = JetStreamRendezvousBackend(
        bucket,
        runner,
        run_id,
        keep_alive_expiry=timedelta(seconds=interval * attempts),
        timeout=timedelta(seconds=read_timeout),
    )
    return backend, store
