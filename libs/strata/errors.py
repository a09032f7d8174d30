"""The one exception tree of Strata.

Every error is a `StrataError` with a stable machine-readable `code` and a message a person can act
on. The same codes travel in RPC error replies (`{ok: false, error: {code, message}}`), so a client
turns a reply back into the matching subclass with `error_from_code`.

    StrataError
    ├── ConfigError            bad settings or arguments               config_invalid
    │   ├── MissingExtra       an optional part is not installed       missing_extra
    │   └── InvalidArgument    a bad argument where a ValueError is    invalid_argument
    │                          promised (torch's rendezvous options)
    ├── CodecError             bytes that are not a valid message      malformed
    ├── ValidationError        a field that breaks the contract        invalid_field
    │   └── InvalidRequest     an RPC request that breaks it           invalid_request
    ├── NotFound               the thing asked for does not exist      not_found
    ├── Forbidden              a request for another job or worker     forbidden
    ├── ConflictError          contradicts what is already recorded    conflict
    │   ├── WorkerSuperseded   a newer process holds this worker id    superseded
    │   └── EpochOutOfRange    an epoch no longer or not yet planned   epoch_out_of_range
    ├── BusError               NATS trouble                            bus_error
    │   ├── PublishTimeout     no ack before the deadline              publish_timeout
    │   ├── ServiceUnavailable nobody answers a subject                unavailable
    │   └── RpcTimeout         an RPC got no reply in time             rpc_timeout
    ├── RpcError               a handler failed unexpectedly           internal
    ├── BarrierBroken          a participant failed or left            barrier_broken
    ├── BarrierTimeout         a barrier was not complete in time      barrier_timeout
    ├── ChecksumMismatch       stored bytes differ from their record   checksum_mismatch
    ├── MissingShard           a checkpoint has no shard of a rank     missing_shard
    ├── StorageError           the checkpoint store failed             storage_error
    ├── LimitExceeded          a configured bound was reached          limit_exceeded
    │   ├── TooLarge           a request would take in too much        too_large
    │   ├── QuotaExceeded      a job's share of a resource is used up  quota_exceeded
    │   └── Busy               too many such requests at once          busy
    │       └── RateLimited    a caller sends faster than its budget   rate_limited
    ├── DeadlineExceeded       work not finished by its deadline       deadline_exceeded
    └── BackgroundTaskFailed   a task of the process died unexpectedly background_task_failed
"""

from __future__ import annotations

from typing import Any, ClassVar


class StrataError(Exception):
    """Root of every error Strata raises on purpose."""

    code: ClassVar[str] = "error"

    def __init__(self, message: str, *, code: str | None = None, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code  # type: ignore[misc]  # instance override of the class default
        self.details: dict[str, Any] = details

    def to_reply(self) -> dict[str, str]:
        """The `error` object of an RPC reply."""
        return {"code": self.code, "message": self.message}

    def __str__(self) -> str:
        return f"[{self.code}] {self.message}"


class ConfigError(StrataError):
    code = "config_invalid"


class MissingExtra(ConfigError):
    """Something needs an extra of the distribution (`pip install 'strata-ctl[server]'`)."""

    code = "missing_extra"


class InvalidArgument(ConfigError, ValueError):
    """A bad argument of an API whose callers expect `ValueError` for it, as torch's do of a
    rendezvous backend's options."""

    code = "invalid_argument"


class CodecError(StrataError):
    code = "malformed"


class ValidationError(StrataError):
    """A value breaks the contract; `field` names where (dotted path), when known."""

    code = "invalid_field"

    def __init__(self, message: str, *, field: str | None = None, **details: Any) -> None:
        super().__init__(message, **details)
        self.field = field


class InvalidRequest(ValidationError):
    code = "invalid_request"


class NotFound(StrataError):
    code = "not_found"


class Forbidden(StrataError):
    """The request names a job or worker other than the caller's own: the caller's identity comes
    from the subject it sent on (which NATS permissions tie to its credential), never from the
    body, and a worker speaks only for itself."""

    code = "forbidden"


class ConflictError(StrataError):
    code = "conflict"


class WorkerSuperseded(ConflictError):
    """Another process registered this process's worker id after it (a restart): this one no
    longer counts as that worker, and must not register again."""

    code = "superseded"


class StaleLease(ConflictError):
    """A request carried a worker registration (lease) that is no longer the worker's current
    one: the registry failed it (a pause or a cut longer than the heartbeat timeout), the worker
    left, or another registration replaced it. Nothing of the request was recorded; the work the
    process did under that lease and did not report is another worker's now. The SDK registers
    again as a new instance and starts over from the plan."""

    code = "stale_lease"


class LeaseRequired(ConflictError):
    """A request that changes sharding state carried no lease: it comes from an SDK older than
    the service, which cannot be fenced. Upgrade strata on the workers."""

    code = "lease_required"


class LeaseExpired(StrataError):
    """Raised by the SDK, not a service: this worker's last confirmed heartbeat is older than the
    heartbeat timeout, so the registry may have failed it and given its shards to others, and
    no new registration came in time."""

    code = "lease_expired"


class EpochOutOfRange(ConflictError):
    """An epoch whose plan was dropped (too old) or that is too far past the latest planned."""

    code = "epoch_out_of_range"


class BusError(StrataError):
    code = "bus_error"


class PublishTimeout(BusError):
    code = "publish_timeout"


class ServiceUnavailable(BusError):
    code = "unavailable"


class RpcTimeout(BusError):
    code = "rpc_timeout"


class RpcError(StrataError):
    code = "internal"


class BarrierBroken(StrataError):
    code = "barrier_broken"


class BarrierTimeout(StrataError):
    code = "barrier_timeout"


class ChecksumMismatch(StrataError):
    code = "checksum_mismatch"


class MissingShard(StrataError):
    """The checkpoint exists but holds no shard of the rank asked for.

    Not a `NotFound`: code that treats `NotFound` as "no checkpoint yet, start fresh" must not
    start one rank fresh while the others resume.
    """

    code = "missing_shard"


class StorageError(StrataError):
    code = "storage_error"


class LimitExceeded(StrataError):
    """A bound set to keep one caller from exhausting a shared service was reached."""

    code = "limit_exceeded"


class TooLarge(LimitExceeded):
    code = "too_large"


class QuotaExceeded(LimitExceeded):
    """A job holds as much of a resource as one job may (datasets, shards, its rendezvous
    bucket's bytes, keys or value size): only that job is refused, retrying does not help; the
    message names the quota and the setting that raises it."""

    code = "quota_exceeded"


class Busy(LimitExceeded):
    """Retry later: the bound is on work in progress, not on the request itself."""

    code = "busy"


class RateLimited(Busy):
    """The caller (its job, or its worker) sent more requests than its budget allows; the
    request was refused before any work was done, so sending it again later is always safe."""

    code = "rate_limited"


class DeadlineExceeded(StrataError):
    code = "deadline_exceeded"


class BackgroundTaskFailed(StrataError):
    """A task this process runs on its own (a worker's heartbeats, a service's event feed) died
    of an exception nothing handles: what it did is no longer done. `task` names it; the
    exception is the `__cause__`."""

    code = "background_task_failed"


_BY_CODE: dict[str, type[StrataError]] = {
    cls.code: cls
    for cls in (
        ConfigError,
        MissingExtra,
        InvalidArgument,
        CodecError,
        ValidationError,
        InvalidRequest,
        NotFound,
        Forbidden,
        ConflictError,
        WorkerSuperseded,
        StaleLease,
        LeaseRequired,
        LeaseExpired,
        EpochOutOfRange,
        BusError,
        PublishTimeout,
        ServiceUnavailable,
        RpcTimeout,
        RpcError,
        BarrierBroken,
        BarrierTimeout,
        ChecksumMismatch,
        MissingShard,
        StorageError,
        LimitExceeded,
        TooLarge,
        QuotaExceeded,
        Busy,
        RateLimited,
        DeadlineExceeded,
        BackgroundTaskFailed,
    )
}


def error_from_code(code: str, message: str, **details: Any) -> StrataError:
    """Rebuild the exception an RPC error reply stands for; unknown codes keep their code."""
    cls = _BY_CODE.get(code)
    if cls is None:
        return StrataError(message, code=code, **details)
    return cls(message, **details)
