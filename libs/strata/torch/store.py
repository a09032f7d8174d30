"""A `torch.distributed.Store` kept in a JetStream key-value bucket, for torchrun's rendezvous.

torchrun's agents exchange what they need to start a group (the master address, their role infos,
the exit barrier) through a store. With the c10d backend that is a TCPStore inside one agent, lost
with it; `KVStore` keeps every key in the replicated `STRATA_RENDEZVOUS` bucket instead, so any
agent (or NATS node) may die without taking the store along. `RendezvousBucket` is the async core;
`KVStore` is the synchronous face torch calls, running the core on a background event loop.

Errors are torch's own, so torch's code handles them as it does TCPStore's: a `wait` or `get`
whose keys are not set in time raises `DistStoreError`, and a call NATS did not answer within the
store's timeout (an outage, a server stopped) raises `DistNetworkError` once that timeout is up.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from datetime import timedelta
from typing import Any, TypeVar

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
HEARD_FIRST_S = 0.002
"""After a put was heard on a missing key's subject, how long before it is read again if that
read did not find it yet (then twice as long each time, up to `RECHECK_S`): the server delivers
a put to subscribers as it routes it, and the stream stores it a moment later, so a read right
after the put was heard can still miss it."""
CAS_ATTEMPTS = 1000
MAX_BATCH = 1000
"""The most keys JetStream writes in one atomic batch (its default limit)."""
ATOMIC_DISABLED = 10174
"""JetStream's error code for an atomic batch sent to a stream that does not allow them."""
BATCH_ID, BATCH_SEQUENCE, BATCH_COMMIT = "Nats-Batch-Id", "Nats-Batch-Sequence", "Nats-Batch-Commit"
BATCH_TIMEOUT_S = 5.0
WAIT_GRACE_S = 0.5
"""How long past its own deadline a wait may take to report what it found, before it is cut off."""
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


class StoreQuotaExceeded(QuotaExceeded, dist.DistStoreError):
    """A store write past the job's rendezvous quota: Strata's `quota_exceeded`, and the
    DistStoreError torch's callers catch."""


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
        self._atomic: bool | None = None
        """Whether the bucket takes atomic batches (None: not tried yet)."""
        self._known: dict[str, tuple[bytes, int]] = {}
        """The value and revision of each key as this connection last wrote or read it: a
        read-modify-write first tries its write on it, which costs one round trip where it is
        still current and is refused (then read afresh) where another writer came between."""

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
        deadline: float = ConnectOptions.deadline,
    ) -> RendezvousBucket:
        """Connect and find the bucket (made here when it is missing and the credential may).

        `job` is the one whose keys this connection reads first (to see that the bucket is
        there); `inbox_prefix` is where replies come, which a worker credential confines to its
        own; `deadline` is how long the connection and that first read are tried.
        """
        options = ConnectOptions(
            name=name,
            user=settings.nats_user,
            password=settings.nats_password,
            inbox_prefix=inbox_prefix,
            deadline=deadline,
        )
        nc = await connect(servers, options)
        try:
            kv = await _bucket(nc, settings, job, min(deadline, PROBE_DEADLINE_S))
        except BaseException:
            await nc.close()
            raise
        return cls(nc, kv, job)

    async def close(self) -> None:
        if not self.nc.is_closed:
            # With the server gone, flushing what is left fails: nothing more to do then.
            with contextlib.suppress(OSError, nats.errors.Error):
                await self.nc.close()

    async def read(self, key: str) -> tuple[bytes, int] | None:
        """The value and revision of `key`, or None when it is not there (or deleted)."""

        async def get() -> tuple[bytes, int] | None:
            try:
                entry = await self.kv.get(key)
            except nats.js.errors.KeyNotFoundError:
                self._known.pop(key, None)
                return None
            current = entry.value or b"", entry.revision or 0
            self._known[key] = current
            return current

        return await retry_transient(get, f"reading rendezvous key {key}")

    async def read_many(self, keys: list[str]) -> list[tuple[bytes, int] | None]:
        """`read` of each of `keys`, all at once."""
        if len(keys) == 1:  # no task for a single read: most reads are of one key
            return [await self.read(keys[0])]
        return list(await asyncio.gather(*(self.read(key) for key in keys)))

    async def put(self, key: str, value: bytes) -> int:
        revision = await self._write(key, lambda: self.kv.put(key, value))
        self._known[key] = value, revision
        return revision

    async def put_many(self, items: list[tuple[str, bytes]]) -> None:
        """`put` of each (key, value), all as one: JetStream's atomic batch stores every key or
        none. A bucket made before it allowed batches (its stream is brought up to date when
        Strata's services start) gets them one by one, at once. A key named twice gets its last
        value."""
        latest = dict(items)
        if 1 < len(latest) <= MAX_BATCH and self._atomic is not False:
            try:
                await self._write(", ".join(sorted(latest)), lambda: self._put_batch(latest))
                return
            except nats.js.errors.APIError as exc:
                if exc.err_code != ATOMIC_DISABLED:
                    raise
                self._atomic = False
        await asyncio.gather(*(self.put(key, value) for key, value in latest.items()))

    async def _put_batch(self, items: dict[str, bytes]) -> None:
        batch = uuid.uuid4().hex
        pending = list(items.items())
        for key in items:
            self._known.pop(key, None)
        for number, (key, value) in enumerate(pending, start=1):
            headers = {BATCH_ID: batch, BATCH_SEQUENCE: str(number)}
            subject = subjects.kv_subject(subjects.RENDEZVOUS_BUCKET, key)
            if number < len(pending):
                await self.nc.publish(subject, value, headers=headers)
                continue
            headers[BATCH_COMMIT] = "1"
            reply = await self.nc.request(subject, value, timeout=BATCH_TIMEOUT_S, headers=headers)
            answer = json.loads(reply.data or b"{}")
            if "error" in answer:
                raise nats.js.errors.APIError.from_error(answer["error"])

    async def modify(
        self, key: str, change: Callable[[bytes | None], bytes | None]
    ) -> tuple[bytes | None, bool]:
        """Apply `change` to `key`'s value (None: missing) atomically: `change` returns the new
        value, or None to leave the key as it is. The key's value afterwards and whether it was
        written. A write names the revision `change` saw, so a racing writer makes it start over
        on the value that writer left; a decision not to write is taken on a fresh read only."""
        for _ in range(CAS_ATTEMPTS):
            known = self._known.get(key)
            fresh = False
            if known is None:
                # Most keys a read-modify-write meets are new (torch's counters): try creating.
                value: bytes | None = None
                revision: int | None = None
            else:
                value, revision = known
            wanted = change(value)
            if wanted is None:
                current = await self.read(key)
                fresh = True
                value, revision = (None, None) if current is None else current
                wanted = change(value)
                if wanted is None:
                    return value, False
            if await self.swap(key, wanted, revision) is not None:
                return wanted, True
            if not fresh:
                await self.read(key)
        raise dist.DistStoreError(f"writing {key!r} lost {CAS_ATTEMPTS} races in a row")

    async def swap(self, key: str, value: bytes, revision: int | None) -> int | None:
        """Write `value` if `key` is still at `revision` (None: if it does not exist); the new
        revision, or None when someone else wrote first."""

        async def write() -> int | None:
            try:
                if revision is None:
                    written = await self.kv.create(key, value)
                else:
                    written = await self.kv.update(key, value, last=revision)
            except nats.js.errors.KeyWrongLastSequenceError:
                self._known.pop(key, None)
                return None
            self._known[key] = value, written
            return written

        return await self._write(key, write)

    async def delete(self, key: str) -> bool:
        if await self.read(key) is None:
            return False
        await self._write(key, lambda: self.kv.delete(key))
        self._known.pop(key, None)
        return True

    async def wait_for(self, keys: list[str], timeout: float) -> dict[str, bytes]:
        """The values of `keys` once all exist; `TimeoutError` after `timeout` seconds.

        It reads them once; for keys still missing it listens to their subjects before reading
        them again, so a put between that read and the wait is not missed; it reads again now
        and then all the same, for a put missed while the connection was re-established. A put
        heard but not readable yet (the stream stores it just after the server delivers it) is
        read again within milliseconds (`HEARD_FIRST_S`), not at the next `RECHECK_S`.
        """
        deadline = time.monotonic() + timeout
        # Most waits find their keys set already: one read each, and no subscription.
        found = {
            key: current[0]
            for key, current in zip(keys, await self.read_many(keys), strict=True)
            if current is not None
        }
        if len(found) == len(keys):
            return found
        arrived = asyncio.Event()
        subs = [
            await self.nc.subscribe(
                subjects.kv_subject(subjects.RENDEZVOUS_BUCKET, key), cb=_setter(arrived)
            )
            for key in keys
        ]
        heard: float | None = None
        """While a put heard has not been read: how long until the next read."""
        try:
            while True:
                arrived.clear()
                missing = [key for key in keys if key not in found]
                for key, current in zip(missing, await self.read_many(missing), strict=True):
                    if current is not None:
                        found[key] = current[0]
                if len(found) == len(keys):
                    return found
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = [key for key in keys if key not in found]
                    raise TimeoutError(f"keys {missing} not set within {timeout:.1f}s")
                try:
                    await asyncio.wait_for(arrived.wait(), min(remaining, heard or RECHECK_S))
                    heard = HEARD_FIRST_S
                except TimeoutError:
                    if heard is not None:
                        heard = heard * 2 if heard * 2 < RECHECK_S else None
        finally:
            for sub in subs:
                with contextlib.suppress(nats.errors.Error):
                    await sub.unsubscribe()

    async def count(self, pattern: str) -> int:
        """How many live keys match `pattern` (a KV key pattern with `*` or `>`)."""
        try:
            # A refused consumer is dropped unanswered: the wait for it is kept short.
            async with asyncio.timeout(PROBE_TIMEOUT_S):
                watcher = await self.kv.watch(pattern, ignore_deletes=True, meta_only=True)
        except nats.js.errors.NoKeysError:
            return 0
        except TimeoutError:
            raise dist.DistStoreError(
                "counting rendezvous store keys lists the bucket through a consumer, which a "
                "worker credential may not create (or NATS did not answer within "
                f"{PROBE_TIMEOUT_S:.0f}s); torchrun never counts them"
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


async def _bucket(nc: NATS, settings: Settings, job: str, deadline: float) -> KeyValue:
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
            lambda: _exists(nc, job), "reading the rendezvous bucket", deadline
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
            lambda: ensure_stream(js, spec), "making the rendezvous bucket", deadline
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

    Every operation is one or a few JetStream calls: `add`, `compare_set` and `append` are atomic
    through the key's revision, `get`, `multi_get` and `wait` block until the keys are set, and
    every call ends within the store's timeout (which `set_timeout` changes, also through a
    `PrefixStore` wrapped around this one). The extended API (`append`, `multi_get`, `multi_set`)
    is native; `multi_set` writes all its keys or none (a JetStream atomic batch). torch's
    queues and `list_keys` are not offered: torch does not pass them on to a store written in
    Python.
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
        self._clones: list[KVStore] = []
        self.set_timeout(timeout)

    def _key(self, key: str) -> str:
        return subjects.rendezvous_store_key(self._job, key)

    def _seconds(self, timeout: timedelta | None) -> float | None:
        """The timeout of a call in seconds: `timeout`, else the store's own (C++) timeout, which
        a PrefixStore's `set_timeout` sets; None for torch's "no timeout" (zero)."""
        current: timedelta = self.timeout  # type: ignore[attr-defined]
        seconds = (timeout if timeout is not None else current).total_seconds()
        return seconds if seconds > 0 else None

    def _call(self, coro: Coroutine[Any, Any, T], what: str) -> T:
        """Run `coro` within the store's timeout; NATS unanswered is torch's DistNetworkError."""
        seconds = self._seconds(None)
        try:
            return self._runner.run(coro, timeout=seconds)
        except TimeoutError:
            raise dist.DistNetworkError(
                f"Strata rendezvous store of job {self._job!r}: {what} got no answer from NATS "
                f"within the store's timeout of {seconds:.1f}s; is the NATS cluster reachable "
                "and has JetStream a leader?"
            ) from None
        except QuotaExceeded as exc:
            # torch's callers catch its own error types: one that is both.
            raise StoreQuotaExceeded(exc.message, **exc.details) from None
        except (BusError, nats.errors.Error, OSError) as exc:
            raise dist.DistNetworkError(
                f"Strata rendezvous store of job {self._job!r}: {what} failed with "
                f"{type(exc).__name__}: {exc}"
            ) from None

    def _wait(self, keys: list[str], timeout: timedelta | None) -> dict[str, bytes]:
        seconds = self._seconds(timeout)
        bucket_keys = [self._key(k) for k in keys]
        # No timeout is a wait as long as a process lives; the bucket's wait wants a number.
        deadline = seconds if seconds is not None else float(2**31)
        try:
            return self._runner.run(
                self._bucket.wait_for(bucket_keys, deadline),
                timeout=None if seconds is None else seconds + WAIT_GRACE_S,
            )
        except TimeoutError:
            reason = "" if self._bucket.nc.is_connected else " (NATS was unreachable)"
            raise dist.DistStoreError(
                f"Strata rendezvous store of job {self._job!r}: wait for {keys} timed out after "
                f"{deadline:.1f}s{reason}"
            ) from None
        except (BusError, nats.errors.Error, OSError) as exc:
            raise dist.DistNetworkError(
                f"Strata rendezvous store of job {self._job!r}: wait for {keys} failed with "
                f"{type(exc).__name__}: {exc}"
            ) from None

    def clone(self) -> KVStore:
        """Another handle on the same keys, for use from another thread (as torch's
        `split_group` and DeviceMesh do); it shares this one's NATS connection.

        This store keeps its clones: one made through a `PrefixStore` is held by C++ only,
        which does not keep the Python object that answers its calls alive.
        """
        timeout: timedelta = self.timeout  # type: ignore[attr-defined]
        clone = KVStore(self._bucket, self._runner, self._job, timeout)
        self._clones.append(clone)
        return clone

    def set(self, key: str, value: str | bytes) -> None:
        self._call(self._bucket.put(self._key(key), _text(value)), f"set of {key!r}")

    def get(self, key: str) -> bytes:
        return self._wait([key], None)[self._key(key)]

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._wait(list(keys), timeout)

    def check(self, keys: list[str]) -> bool:
        found = self._call(
            self._bucket.read_many([self._key(k) for k in keys]), f"check of {list(keys)}"
        )
        return all(current is not None for current in found)

    def add(self, key: str, value: int) -> int:
        def plus(current: bytes | None) -> bytes:
            text = current or b"0"
            try:
                number = int(text)
            except ValueError:
                raise dist.DistStoreError(
                    f"add to {key!r}: its value {text[:64]!r} is not an integer"
                ) from None
            return str(number + value).encode()

        written, _ = self._call(self._bucket.modify(self._key(key), plus), f"add to {key!r}")
        assert written is not None
        return int(written)

    def compare_set(
        self, key: str, expected_value: str | bytes, desired_value: str | bytes
    ) -> bytes:
        """TCPStore's rule: set `desired_value` when the key holds `expected_value` (or is missing
        and `expected_value` is empty); return the value the key holds afterwards (for a missing
        key left alone, `expected_value`)."""
        expected, desired = _text(expected_value), _text(desired_value)

        def swap_if_expected(current: bytes | None) -> bytes | None:
            if current is None:
                return None if expected else desired
            return desired if current == expected else None

        value, _ = self._call(
            self._bucket.modify(self._key(key), swap_if_expected), f"compare_set of {key!r}"
        )
        return expected if value is None else value

    def append(self, key: str, value: str | bytes) -> None:
        """Add `value` to the end of the key's value (a missing key starts empty), atomically."""
        tail = _text(value)
        self._call(
            self._bucket.modify(self._key(key), lambda current: (current or b"") + tail),
            f"append to {key!r}",
        )

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """The values of `keys`, in order, once all are set (within the store's timeout)."""
        found = self._wait(list(keys), None)
        return [found[self._key(k)] for k in keys]

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        if len(keys) != len(values):
            raise ValueError(f"multi_set got {len(keys)} keys but {len(values)} values")
        items = [(self._key(k), _text(v)) for k, v in zip(keys, values, strict=True)]
        self._call(self._bucket.put_many(items), f"multi_set of {list(keys)}")

    def has_extended_api(self) -> bool:
        return True

    def delete_key(self, key: str) -> bool:
        return self._call(self._bucket.delete(self._key(key)), f"delete_key of {key!r}")

    def num_keys(self) -> int:
        return self._call(self._bucket.count(subjects.rendezvous_store_keys(self._job)), "num_keys")

    # The names torch's C++ side calls (a PrefixStore around this store, a process group's
    # store): its Python trampoline looks these up by their C++ names.
    def deleteKey(self, key: str) -> bool:
        return self.delete_key(key)

    def getNumKeys(self) -> int:
        return self.num_keys()
