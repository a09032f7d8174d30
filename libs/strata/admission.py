"""Admission control of a service's requests: budgets per caller, and fair queues between jobs.

Every service takes every job's requests from one subscription, so without these one job's flood
(a crash-looping script, a metrics call in a tight loop, a hostile credential) delays every other
job's requests behind it. `RpcServer` looks at a request's subject only (its job and worker,
before the body is decoded) and asks `Admission` whether to take it: the caller's job, and its
worker, each have a token bucket; what is admitted waits in its job's own queue, and the queues
are served round robin, so a job's backlog delays that job only. Everything here is pure: the
clock is passed in, so tests drive time instead of sleeping.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")

OPERATOR = ""
"""The job key of a request without a caller (`strata.rpc.<service>.<verb>`). Only the services'
credential may send one where NATS permissions are in force (`strata up --secure`, the chart), so
operators (the CLI, tools, benchmarks) have no budget and no bound of their own but the service's
total: their requests wait in one queue, served in turn with the jobs'."""


@dataclass(frozen=True)
class AdmissionLimits:
    """The bounds a service applies to its requests (the `STRATA_RPC_*` settings).

    Sized for a 1,000-worker job: its start (every worker registers, reads the members, asks for
    its shards and meets at a barrier within a second or two) passes without a refusal.
    """

    job_rate: float = 2_000.0
    """Requests per second one job may send one service, on average."""
    job_burst: int = 5_000
    """Requests one job may send one service at once, above the average."""
    worker_rate: float = 200.0
    """Requests per second one worker may send one service, on average."""
    worker_burst: int = 400
    """Requests one worker may send one service at once."""
    job_pending: int = 8_192
    """Admitted requests of one job waiting for a handler; more are refused with `busy`."""
    max_pending: int = 32_768
    """Admitted requests of all jobs waiting for a handler, together."""
    job_inflight: int = 1_024
    """Requests of one job in handlers at once (each waits for its batch's round trip)."""
    max_buckets: int = 65_536
    """Budgets kept at once, per kind (jobs, workers); idle ones are forgotten first."""


class TokenBucket:
    """`rate` tokens a second up to `burst`; a request takes one. Starts full."""

    __slots__ = ("burst", "last", "rate", "tokens")

    def __init__(self, rate: float, burst: int, now: float) -> None:
        self.rate = rate
        self.burst = float(burst)
        self.tokens = float(burst)
        self.last = now

    def refill(self, now: float) -> float:
        """The tokens there are at `now` (a clock that goes back adds none)."""
        elapsed = now - self.last
        if elapsed > 0:
            self.tokens = min(self.burst, self.tokens + elapsed * self.rate)
            self.last = now
        return self.tokens

    def take(self, now: float) -> bool:
        """Take one token if there is one; False (and nothing taken) when the budget is spent."""
        if self.refill(now) >= 1.0:
            self.tokens -= 1.0
            return True
        return False

    def full(self, now: float) -> bool:
        return self.refill(now) >= self.burst

    def wait(self, now: float) -> float:
        """Seconds until there is a token to take (0 when there is one now)."""
        tokens = self.refill(now)
        return 0.0 if tokens >= 1.0 else (1.0 - tokens) / self.rate


class Budgets(Generic[K]):
    """A token bucket per key, with at most `max_keys` kept.

    A full bucket is the same as no bucket, so when there are too many, the full ones are
    forgotten; if most are in use, the oldest go until a quarter is free (their callers get a
    full budget again: a bound on memory matters more than those keys' exactness).
    """

    def __init__(self, rate: float, burst: int, max_keys: int) -> None:
        self.rate = rate
        self.burst = burst
        self.max_keys = max_keys
        self._buckets: dict[K, TokenBucket] = {}

    def __len__(self) -> int:
        return len(self._buckets)

    def take(self, key: K, now: float) -> bool:
        bucket = self._buckets.get(key)
        if bucket is None:
            if len(self._buckets) >= self.max_keys:
                self._forget(now)
            bucket = self._buckets[key] = TokenBucket(self.rate, self.burst, now)
        return bucket.take(now)

    def wait(self, key: K, now: float) -> float:
        """Seconds until `key`'s bucket has a token (0 for a key with no bucket: a full one)."""
        bucket = self._buckets.get(key)
        return 0.0 if bucket is None else bucket.wait(now)

    def _forget(self, now: float) -> None:
        # Down to three quarters at once, so that a stream of new keys (made-up worker ids)
        # pays for one scan per max_keys/4 of them, not one per key.
        target = self.max_keys - max(1, self.max_keys // 4)
        idle = [key for key, bucket in self._buckets.items() if bucket.full(now)]
        for key in idle:
            del self._buckets[key]
        while len(self._buckets) > target:
            del self._buckets[next(iter(self._buckets))]


class FairQueue(Generic[K, T]):
    """A FIFO queue per key, served round robin, with a bound per key and one for all.

    `pop` takes the head of the next key in turn (skipping keys `eligible` refuses, e.g. a job
    with as many requests in handlers as it may have), so a key with a long queue gets one turn
    per round like any other.
    """

    def __init__(self, per_key: int, total: int) -> None:
        self.per_key = per_key
        self.total = total
        self._queues: dict[K, deque[T]] = {}
        self._turns: deque[K] = deque()
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def queued(self, key: K) -> int:
        queue = self._queues.get(key)
        return len(queue) if queue is not None else 0

    def push(self, key: K, item: T, *, bounded: bool = True) -> bool:
        """Queue `item` behind `key`'s others; False (nothing queued) when a bound is reached
        (with `bounded=False`, only the total's)."""
        if self._size >= self.total:
            return False
        queue = self._queues.get(key)
        if queue is None:
            queue = self._queues[key] = deque()
            self._turns.append(key)
        elif bounded and len(queue) >= self.per_key:
            return False
        queue.append(item)
        self._size += 1
        return True

    def pop(self, eligible: Callable[[K], bool] | None = None) -> tuple[K, T] | None:
        """The next key's oldest item, in round-robin order; None when nothing may be served."""
        for _ in range(len(self._turns)):
            key = self._turns[0]
            self._turns.rotate(-1)
            if eligible is not None and not eligible(key):
                continue
            queue = self._queues[key]
            item = queue.popleft()
            self._size -= 1
            if not queue:
                del self._queues[key]
                # The key just rotated to the back: drop it from the turns there.
                self._turns.pop()
            return key, item
        return None


REFUSALS_KEPT = 4096
"""Refusal messages kept made (one per refused caller), forgotten wholesale past it."""


@dataclass(frozen=True)
class Refusal:
    """Why a request is not taken: its error code and the message its caller gets."""

    code: str
    message: str


class Admission:
    """Decides, from the caller alone, whether a service takes a request now.

    `admit` charges the caller's budgets (its job's, and its worker's where the subject names
    one); `RpcServer` then queues what is admitted in a `FairQueue`.
    """

    def __init__(self, service: str, limits: AdmissionLimits) -> None:
        self.service = service
        self.limits = limits
        self._jobs: Budgets[str] = Budgets(limits.job_rate, limits.job_burst, limits.max_buckets)
        self._workers: Budgets[tuple[str, str]] = Budgets(
            limits.worker_rate, limits.worker_burst, limits.max_buckets
        )
        self._refusals: dict[tuple[str, str | None, str | None], Refusal] = {}

    def admit(self, job: str | None, worker: str | None, now: float) -> Refusal | None:
        """None to take the request; else the refusal to answer with. A worker's budget is
        checked first, so a single noisy worker spends its own budget, not its job's."""
        if job is None:
            return None  # an operator's (see OPERATOR)
        if worker is not None and not self._workers.take((job, worker), now):
            return self._refusal("worker", job, worker)
        if not self._jobs.take(job, now):
            return self._refusal("job", job, worker)
        return None

    def held_for(self, refusal: Refusal, job: str, worker: str | None, now: float) -> float:
        """Seconds for which every request of `worker` of `job` is refused as `refusal` was: until
        its own budget has a token again when that budget refused it (a refused request takes
        no token of either budget, so nothing else changes meanwhile); 0 for any other refusal."""
        if worker is None or self._refusals.get(("worker", job, worker)) is not refusal:
            return 0.0
        return self._workers.wait((job, worker), now)

    def _refusal(self, kind: str, job: str | None, worker: str | None) -> Refusal:
        # A flood is refused many times a second with the same words: made once per caller.
        key = (kind, job, worker if kind == "worker" else None)
        found = self._refusals.get(key)
        if found is None:
            if len(self._refusals) >= REFUSALS_KEPT:
                self._refusals.clear()
            found = self._refusals[key] = self._word(kind, job, worker)
        return found

    def _word(self, kind: str, job: str | None, worker: str | None) -> Refusal:
        if kind == "worker":
            return Refusal(
                "rate_limited",
                f"worker {worker!r} of job {job!r} sent {self.service} more than "
                f"{self.limits.worker_rate:g} requests/s (bursts of {self.limits.worker_burst}); "
                "slow down and retry, or raise STRATA_RPC_WORKER_RATE / STRATA_RPC_WORKER_BURST "
                "on the service (chart: coordinator.admission.workerRate / workerBurst)",
            )
        return Refusal(
            "rate_limited",
            f"job {job!r} sent {self.service} more than {self.limits.job_rate:g} requests/s "
            f"(bursts of {self.limits.job_burst}); slow down and retry, or raise "
            "STRATA_RPC_JOB_RATE / STRATA_RPC_JOB_BURST on the service (chart: "
            "coordinator.admission.jobRate / jobBurst)",
        )

    def busy(self, job: str, queued: int, total: int) -> Refusal:
        """The refusal of a request that found its job's queue, or every queue, full."""
        limits = self.limits
        who = f"job {job!r}" if job else "operator requests"
        if queued >= limits.job_pending:
            return Refusal(
                "busy",
                f"{self.service} already holds {limits.job_pending} requests of {who} waiting "
                "to be served; retry later, or raise STRATA_RPC_JOB_PENDING on the service (chart: "
                "coordinator.admission.jobPending)",
            )
        return Refusal(
            "busy",
            f"{self.service} already holds {limits.max_pending} requests waiting to be served; "
            "retry later, or raise STRATA_RPC_MAX_PENDING on the service (chart: "
            "coordinator.admission.maxPending)",
        )
