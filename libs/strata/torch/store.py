"""A `torch.distributed.Store` kept in a JetStream key-value bucket, for torchrun's rendezvous.

torchrun's agents exchange what they need to start a group (the master address, their role infos,
the exit barrier) through a store. With the c10d backend that is a TCPStore inside one agent, lost
with it; `KVStore` keeps every key in the replicated `STRATA_RENDEZVOUS` bucket instead, so any
agent (or NATS node) may die without taking the store along. `RendezvousBucket` is the async core;
`KVStore` is the synchronous face torch calls, running the core on a background event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import TypeVar

import nats.errors
import nats.js.errors
import torch.distributed as dist
from nats.aio.client import Client as NATS
from nats.js.kv import KeyValue
from torch._C._distributed_c10d import Store

from strata._loop import LoopRunner
from strata.bus.connection import ConnectOptions, connect, retry_transient
from strata.bus.streams import RendezvousQuota, ensure_stream, rendezvous_stream
from strata.config import Env, Settings
from strata.errors import BusError, ConfigError, QuotaExceeded
from strata.events import subjects

__all__ = ["KVStore", "RendezvousBucket"]

T = TypeVar("T")

RECHECK_S = 1.0
"""While waiting for a key, how often it is read again in case its put was missed (a reconnect
between the subscription and the put)."""
CAS_ATTEMPTS = 1000
PROBE_TIMEOUT_S = 2.0
PROBE_DEADLINE_S = 10.0
"""How long the first read of the bucket is tried. Unanswered, it is most likely refused: NATS
drops a request its user may not send, and the client hears of it only as a timeout."""


QUOTA_REFUSALS = {
    "maximum bytes exceeded": ("bytes", Env.RENDEZVOUS_MAX_BYTES),
    "maximum messages exceeded": ("keys", Env.RENDEZVOUS_MAX_KEYS),
    "message size exceeds maximum allowed": ("value size", Env.RENDEZVOUS_MAX_VALUE_BYTES),
}
"""What JetStream answers a write past one of the job's stream's limits, and the quota and the
setting behind each."""


def quota_refusal(exc: nats.js.errors.APIError, job: str, key: str) -> QuotaExceeded | None:
    """The `quota_exceeded` error a refused write of `job`'s rendezvous `key` stands for, or None
    when JetStream refused it for another reason."""
    description = (exc.description or "").lower()
    for text, (quota, setting) in QUOTA_REFUSALS.items():
        if text in description:
            return QuotaExceeded(
                f"job {job!r} has reached its rendezvous {quota} quota writing key {key!r} "
                f"({exc.description}): delete keys it no longer needs, or raise {setting} "
                "(chart: nats.rendezvous) and restart the services, which apply it to the job's "
                "bucket",
                quota=f"rendezvous_{quota.replace(' ', '_')}",
                setting=setting,
            )
    return None


class RendezvousBucket:
    """The rendezvous bucket of one job on one NATS connection: its state and store keys, within
    the job's quota (`strata.bus.streams.RendezvousQuota`)."""

    def __init__(self, nc: NATS, kv: KeyValue, job: str = "") -> None:
        self.nc = nc
        self.kv = kv
        self.job = job

    async def _write(self, key: str, call: Callable[[], Awaitable[T]]) -> T:
        """`call()`, a write of `key`, retried through transient failures; a refusal for the
        job's quota is `QuotaExceeded`, at once (waiting frees nothing)."""

        async def attempt() -> T:
            try:
                return await call()
            except nats.js.errors.APIError as exc:
                refusal = quota_refusal(exc, self.job, key)
                if refusal is not None:
                    raise refusal from None
                raise

        return await retry_transient(attempt, f"writing {key}")

    @classmethod
    async def open(
        cls,
        servers: list[str],
        settings: Settings,
        job: str,
        *,
        name: str = "strata-rendezvous",
        inbox_prefix: str | None = None,
    ) -> RendezvousBucket:
        """Connect and find the bucket (made here when it is missing and the credential may).

        `job` is the one whose keys this connection reads first (to see that the bucket is
        there); `inbox_prefix` is where replies come, which a worker credential confines to its
        own.
        """
        options = ConnectOptions(
            name=name,
            user=settings.nats_user,
            password=settings.nats_password,
            inbox_prefix=inbox_prefix,
        )
        nc = await connect(servers, options)
        try:
            kv = await _bucket(nc, settings, job)
        except BaseException:
            await nc.close()
            raise
        return cls(nc, kv, job)

    async def close(self) -> None:
        if not self.nc.is_closed:
            await self.nc.close()

    async def read(self, key: str) -> tuple[bytes, int] | None:
        """The value and revision of `key`, or None when it is not there (or deleted)."""

        async def get() -> tuple[bytes, int] | None:
            try:
                entry = await self.kv.get(key)
            except nats.js.errors.KeyNotFoundError:
                return None
            return entry.value or b"", entry.revision or 0

        return await retry_transient(get, f"reading rendezvous key {key}")

    async def put(self, key: str, value: bytes) -> int:
        return await self._write(key, lambda: self.kv.put(key, value))

    async def swap(self, key: str, value: bytes, revision: int | None) -> int | None:
        """Write `value` if `key` is still at `revision` (None: if it does not exist); the new
        revision, or None when someone else wrote first."""

        async def write() -> int | None:
            try:
                if revision is None:
                    return await self.kv.create(key, value)
                return await self.kv.update(key, value, last=revision)
            except nats.js.errors.KeyWrongLastSequenceError:
                return None

        return await self._write(key, write)

    async def delete(self, key: str) -> bool:
        if await self.read(key) is None:
            return False
        await self._write(key, lambda: self.kv.delete(key))
        return True

    async def wait_for(self, keys: list[str], timeout: float) -> dict[str, bytes]:
        """The values of `keys` once all exist; `TimeoutError` after `timeout` seconds.

        It listens to the keys' subjects before reading them, so a put between the read and the
        wait is not missed; it reads again now and then all the same, for a put missed while the
        connection was re-established.
        """
        deadline = time.monotonic() + timeout
        found: dict[str, bytes] = {}
        arrived = asyncio.Event()
        subs = [
            await self.nc.subscribe(
                subjects.kv_subject(subjects.RENDEZVOUS_BUCKET, key), cb=_setter(arrived)
            )
            for key in keys
        ]
        try:
            while True:
                arrived.clear()
                for key in keys:
                    if key not in found:
                        current = await self.read(key)
                        if current is not None:
                            found[key] = current[0]
                if len(found) == len(keys):
                    return found
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = [key for key in keys if key not in found]
                    raise TimeoutError(f"keys {missing} not set within {timeout:.1f}s")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(arrived.wait(), min(remaining, RECHECK_S))
        finally:
            for sub in subs:
                with contextlib.suppress(nats.errors.Error):
                    await sub.unsubscribe()

    async def count(self, pattern: str) -> int:
        """How many live keys match `pattern` (a KV key pattern with `*` or `>`)."""
        try:
            watcher = await self.kv.watch(pattern, ignore_deletes=True, meta_only=True)
        except nats.js.errors.NoKeysError:
            return 0
        except nats.errors.TimeoutError:
            raise dist.DistStoreError(
                "counting rendezvous store keys lists the bucket through a consumer, which a "
                "worker credential may not create; torchrun never counts them"
            ) from None
        keys = 0
        try:
            while True:
                try:
                    entry = await watcher.updates(timeout=5.0)  # type: ignore[no-untyped-call]
                except nats.errors.TimeoutError:
                    break
                if entry is None:
                    break
                keys += 1
        finally:
            await watcher.stop()  # type: ignore[no-untyped-call]
        return keys


def _setter(event: asyncio.Event):  # type: ignore[no-untyped-def]
    async def on_message(_msg: object) -> None:
        event.set()

    return on_message


async def _bucket(nc: NATS, settings: Settings, job: str) -> KeyValue:
    # Built without a look at the stream's settings: a worker credential may not ask for them
    # (they would list every job's keys). Reads are direct gets by subject, which the bucket
    # allows (`rendezvous_stream`).
    js = nc.jetstream()
    bucket = subjects.RENDEZVOUS_BUCKET
    kv = KeyValue(
        name=bucket,
        stream=subjects.rendezvous_stream_name(job),
        pre=subjects.kv_subject(bucket, ""),
        js=js,
        direct=True,
    )
    try:
        exists = await retry_transient(
            lambda: _exists(nc, job), "reading the rendezvous bucket", PROBE_DEADLINE_S
        )
    except BusError as exc:
        raise BusError(
            f"{exc.message} Or NATS user {settings.nats_user or '(none)'} may not read the "
            f"rendezvous keys of job {job!r}: a worker credential of another job, or permissions "
            "rendered before Strata gave them (restart the NATS servers with the current chart "
            "or strata up --secure)"
        ) from None
    if exists:
        return kv
    spec = rendezvous_stream(job, settings.stream_replicas, RendezvousQuota.of(settings))
    try:
        # Retried through a leader election; a worker credential's request is dropped
        # unanswered, so it times out the same way.
        await retry_transient(
            lambda: ensure_stream(js, spec), "making the rendezvous bucket", PROBE_DEADLINE_S
        )
    except (BusError, nats.js.errors.APIError) as exc:
        raise ConfigError(
            f"the rendezvous bucket {bucket} of job {job!r} does not exist and NATS user "
            f"{settings.nats_user or '(none)'} could not make it ({type(exc).__name__}): start "
            "Strata's services (strata up --secure --job, or the chart with the job in its "
            "values) first, they provision it"
        ) from None
    return kv


async def _exists(nc: NATS, job: str) -> bool:
    """Whether the rendezvous bucket's stream answers a read of `job`'s state key."""
    try:
        await nc.request(
            subjects.rendezvous_read(job, subjects.rendezvous_state_key(job)),
            b"",
            timeout=PROBE_TIMEOUT_S,
        )
    except nats.errors.NoRespondersError:
        return False
    return True


def _text(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class KVStore(Store):  # torch.distributed.Store, which mypy cannot see through torch's re-export
    """One job's `torch.distributed.Store` in the rendezvous bucket.

    Every operation is one or a few JetStream calls: `add` and `compare_set` are atomic through the
    key's revision, `get` and `wait` block until the keys are set (for the store's timeout, which
    `set_timeout` changes, also through a `PrefixStore` wrapped around this one).
    """

    def __init__(
        self,
        bucket: RendezvousBucket,
        runner: LoopRunner,
        job: str,
        timeout: timedelta = timedelta(seconds=300),
    ) -> None:
        super().__init__()
        self._bucket = bucket
        self._runner = runner
        self._job = job
        self.set_timeout(timeout)

    def _key(self, key: str) -> str:
        return subjects.rendezvous_store_key(self._job, key)

    def _wait(self, keys: list[str], timeout: timedelta | None) -> dict[str, bytes]:
        # `timeout` is the store's own (C++) timeout, which a PrefixStore's `set_timeout` sets.
        current: timedelta = self.timeout  # type: ignore[attr-defined]
        seconds = (timeout if timeout is not None else current).total_seconds()
        try:
            return self._runner.run(self._bucket.wait_for([self._key(k) for k in keys], seconds))
        except TimeoutError as exc:
            raise dist.DistStoreError(
                f"Strata rendezvous store of job {self._job!r}: wait for {keys} timed out after "
                f"{seconds:.1f}s"
            ) from exc

    def set(self, key: str, value: str | bytes) -> None:
        self._runner.run(self._bucket.put(self._key(key), _text(value)))

    def get(self, key: str) -> bytes:
        return self._wait([key], None)[self._key(key)]

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._wait(list(keys), timeout)

    def check(self, keys: list[str]) -> bool:
        return all(self._runner.run(self._bucket.read(self._key(k))) is not None for k in keys)

    def add(self, key: str, value: int) -> int:
        bucket_key = self._key(key)
        for _ in range(CAS_ATTEMPTS):
            current = self._runner.run(self._bucket.read(bucket_key))
            number = (int(current[0]) if current else 0) + value
            revision = current[1] if current else None
            if self._runner.run(self._bucket.swap(bucket_key, str(number).encode(), revision)):
                return number
        raise dist.DistStoreError(f"add to {key!r} lost {CAS_ATTEMPTS} races in a row")

    def compare_set(
        self, key: str, expected_value: str | bytes, desired_value: str | bytes
    ) -> bytes:
        """TCPStore's rule: set `desired_value` when the key holds `expected_value` (or is missing
        and `expected_value` is empty); return the value the key holds afterwards (for a missing
        key left alone, `expected_value`)."""
        bucket_key = self._key(key)
        expected, desired = _text(expected_value), _text(desired_value)
        for _ in range(CAS_ATTEMPTS):
            current = self._runner.run(self._bucket.read(bucket_key))
            if current is None:
                if expected:
                    return expected
                revision = None
            elif current[0] != expected:
                return current[0]
            else:
                revision = current[1]
            if self._runner.run(self._bucket.swap(bucket_key, desired, revision)):
                return desired
        raise dist.DistStoreError(f"compare_set of {key!r} lost {CAS_ATTEMPTS} races in a row")

    def delete_key(self, key: str) -> bool:
        return self._runner.run(self._bucket.delete(self._key(key)))

    def num_keys(self) -> int:
        return self._runner.run(self._bucket.count(subjects.rendezvous_store_keys(self._job)))
