"""Request/reply over NATS with typed requests, typed results and an answer for every request.

`RpcServer` subscribes once per service to `strata.rpc.<service>.>` in the service's queue group
(so replicas share the load) and dispatches by verb. The caller is the job and worker the subject
ends with (`strata.rpc.<service>.<verb>.<job>.<worker>`), which NATS permissions tie to the
caller's credential: a request whose body names another job, or for a verb a worker sends about
itself another worker, is refused with `forbidden` before any handler runs, so a worker speaks
only for itself. A subject without a caller is an operator's (the services' credential, or an
unsecured NATS). Bytes that don't decode, requests that don't validate, unknown verbs and
handlers that raise all get `{ok: false, error: {code, message}}`; the server never goes silent
and never dies on a message. `RpcClient` sends as the caller it is bound to and turns error
replies back into the matching `StrataError` subclass.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, overload

import nats.errors
import pydantic
import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

import strata
from strata.admission import OPERATOR, Admission, AdmissionLimits, FairQueue, Refusal
from strata.bus.connection import backoff_delays
from strata.bus.intake import FAST_LANE, RequestIntakeClient
from strata.errors import (
    BusError,
    Busy,
    CodecError,
    Forbidden,
    InvalidRequest,
    RateLimited,
    RpcTimeout,
    ServiceUnavailable,
    StrataError,
    error_from_code,
)
from strata.events import subjects
from strata.events.codec import pack, unpack, validation_error
from strata.events.rpc import STATUS_INTERVAL_S, PingRequest, PingResult, RpcEndpoint, Scope
from strata.logs import Throttle
from strata.metrics import (
    MESSAGES_REJECTED,
    RPC_DROPPED,
    RPC_LATENCY,
    RPC_QUEUED,
    RPC_REFUSED,
    RPC_REQUESTS,
)

log = structlog.get_logger("strata.rpc")

DEFAULT_PENDING_MSGS = 65_536
"""Requests the NATS client holds for a service that it has not looked at yet (the
`STRATA_RPC_SUB_PENDING_MSGS` setting); past it, it drops them, counted."""
DEFAULT_PENDING_BYTES = 64 * 1024 * 1024
"""The same bound in bytes (`STRATA_RPC_SUB_PENDING_MB`)."""

STARTS_PER_TURN = 32
"""Admitted requests started as handlers before the event loop's next turn. A burst a job's
budget admits at once (400 of one worker's) would otherwise run back to back in one turn, tens of
milliseconds that another job's request, and the replies its handler awaits, wait behind."""

Req = TypeVar("Req", bound=pydantic.BaseModel)
Res = TypeVar("Res", bound=pydantic.BaseModel)
HandlerResult = pydantic.BaseModel | dict[str, Any] | list[Any] | None


@dataclass(frozen=True)
class Caller:
    """Who sends a request: a worker of a job. The SDK's client is bound to its worker's."""

    job: str
    worker: str


@dataclass(slots=True)
class _Refused:
    """A refusal's answer and counters, made once: a flood repeats the same few. Refusals are
    counted here first and added to the metrics once per read from the socket (`_count_refusals`):
    three Prometheus increments a request would cost more than the rest of a refusal."""

    reply: bytes
    code: str
    refused: Any
    requests: Any
    rejected: Any
    uncounted: int = 0


_REFUSALS_KEPT = 4096


@dataclass(slots=True)
class _Held:
    """A request subject whose worker's budget refuses everything until `until`: its requests
    are refused from the subject's bytes alone, without decoding or charging anything."""

    until: float
    refused: _Refused


_HELD_KEPT = 4096


@dataclass(frozen=True, slots=True)
class _Admitted:
    """A request taken in, waiting in its job's queue for a handler."""

    msg: Msg
    address: subjects.RpcAddress
    arrived: float
    nc: NATS
    """The connection it came on, which its answer goes out on."""


@dataclass(frozen=True)
class _Route(Generic[Req]):
    request: type[Req]
    handler: Callable[[Req], Awaitable[HandlerResult]]
    scope: Scope


def _ok(result: HandlerResult) -> bytes:
    if isinstance(result, pydantic.BaseModel):
        result = result.model_dump(mode="python")
    return pack({"ok": True, "result": result})


def _error(code: str, message: str) -> bytes:
    return pack({"ok": False, "error": {"code": code, "message": message[:4000]}})


class RpcServer:
    """Answers every request on `strata.rpc.<service>.*`; `ping` is built in.

    With `admission` (the `STRATA_RPC_*` settings), a request is taken or refused from its subject
    alone, before its body is decoded (`strata.admission`): its caller's budgets are charged, and
    what is admitted waits in its job's queue, the queues served round robin by up to
    `concurrency` handlers at once (`job_inflight` of one job). A refusal is answered at once
    (`rate_limited`, `busy`) and counted. Without it (a benchmark's baseline), requests are
    handled in arrival order as they come. Either way, a request without a reply subject is
    dropped before any work, and the subscription holds at most `pending_msgs` requests
    (`pending_bytes`) that were not looked at yet: past those the NATS client drops and counts
    (`strata_rpc_dropped_total`), so a flood never makes the server cut the service off as a slow
    consumer.

    With `partitions` (connections, one per partition of `STRATA_RPC_PARTITIONS`), it also takes
    the requests that the NATS server's subject mapping moved to each partition by job
    (`strata.rpcp.<partition>.<service>.>`) on that partition's own connection, and answers each
    on the connection it came on: a job's flood then fills its partition's connection only,
    and another partition's requests never wait behind it in one byte stream. `nc` keeps the
    unpartitioned subjects (operators' requests, and everything on a NATS without the mapping);
    without `partitions`, it takes every partition's requests too.
    """

    def __init__(
        self,
        nc: NATS,
        service: str,
        *,
        concurrency: int = 1,
        admission: AdmissionLimits | None = None,
        pending_msgs: int = DEFAULT_PENDING_MSGS,
        pending_bytes: int = DEFAULT_PENDING_BYTES,
        spawn: Callable[[Coroutine[Any, Any, None], str], asyncio.Task[None]] | None = None,
        partitions: Sequence[NATS] = (),
    ) -> None:
        self._nc = nc
        self._partitions = tuple(partitions)
        self.service = service
        self._spawn = spawn
        """How the status announcements' task is started: a service's supervised `spawn`."""
        self.instance = uuid.uuid4().hex[:12]
        self._routes: dict[str, _Route[Any]] = {}
        self._subs: list[Subscription] = []
        self._started = time.monotonic()
        self._concurrency = max(1, concurrency)
        self._gate = asyncio.Semaphore(concurrency) if concurrency > 1 else None
        self._pending_msgs = pending_msgs
        self._pending_bytes = pending_bytes
        self._tasks: set[asyncio.Task[None]] = set()
        self._announcer: asyncio.Task[None] | None = None
        self.rejected: Counter[str] = Counter()
        self.admission = Admission(service, admission) if admission is not None else None
        limits = admission if admission is not None else AdmissionLimits()
        self._queue: FairQueue[str, _Admitted] = FairQueue(limits.job_pending, limits.max_pending)
        self._job_inflight = limits.job_inflight
        self._inflight = 0
        self._starts = 0
        """Handlers started since `STARTS_PER_TURN` was last reached (`_next_turn`)."""
        self._next_turn_pending = False
        self._inflight_of: Counter[str] = Counter()
        # Metric children looked up once: a labels() call per request costs more than the handler.
        self._latency = RPC_LATENCY.labels(service)
        self._queued = RPC_QUEUED.labels(service)
        self._no_reply = RPC_DROPPED.labels(service, "no_reply_subject")
        self._counted_by: dict[tuple[str, str], Any] = {}
        self._rejected_counters: dict[str, Any] = {}
        self._refusals: dict[tuple[Refusal, str], _Refused] = {}
        self._uncounted: list[_Refused] = []
        self._held: dict[bytes, _Held] = {}
        # One warning per verb and caller every few seconds: forged requests come at their
        # sender's pace, log lines must not.
        self._forbidden_log = Throttle()
        self._refused_log = Throttle()
        self.route("ping", PingRequest, self._ping, scope="open")

    def route(
        self,
        verb: str,
        request: type[Req],
        handler: Callable[[Req], Awaitable[HandlerResult]],
        *,
        scope: Scope,
    ) -> None:
        """Answer `verb` with `handler`; `scope` says whom its requests may speak for."""
        subjects.rpc_subject(self.service, verb)  # validates the verb
        fields = request.model_fields
        if scope != "open" and "job" not in fields:
            raise TypeError(f"{request.__name__} has no job: {verb} cannot be scoped to one")
        if scope == "worker" and "worker_id" not in fields:
            raise TypeError(f"{request.__name__} has no worker_id: {verb} cannot be per worker")
        self._routes[verb] = _Route(request, handler, scope)

    def serve(
        self, endpoint: RpcEndpoint, handler: Callable[[Any], Awaitable[HandlerResult]]
    ) -> None:
        """Answer a catalogued endpoint of this service, with the scope the catalogue gives it."""
        if endpoint.service != self.service:
            raise ValueError(f"{endpoint.service}.{endpoint.verb} is not a verb of {self.service}")
        self.route(endpoint.verb, endpoint.request, handler, scope=endpoint.scope)

    async def _ping(self, _: PingRequest) -> PingResult:
        return self.status()

    def status(self) -> PingResult:
        """What `ping` answers and what is announced on `strata.status.<service>`."""
        return PingResult(
            service=self.service,
            instance=self.instance,
            uptime_s=time.monotonic() - self._started,
            version=strata.__version__,
        )

    async def start(self) -> RpcServer:
        self._started = time.monotonic()
        await self._subscribe(self._nc, subjects.service_rpcs(self.service))
        if not self._partitions:  # every partition, on the one connection
            await self._subscribe(self._nc, subjects.partition_rpcs(self.service, "*"))
        for partition, nc in enumerate(self._partitions):
            subject = subjects.partition_rpcs(self.service, partition)
            if isinstance(nc, RequestIntakeClient) and FAST_LANE and self.admission is not None:
                sub = await nc.subscribe_direct(
                    subject,
                    functools.partial(self._take, nc),
                    queue=subjects.rpc_queue_group(self.service),
                    after_read=self._count_refusals,
                )
                self._subs.append(sub)
            else:
                await self._subscribe(nc, subject)
        # Until the server has the SUB, callers get "no responders". nats-py writes flush()'s PING
        # straight to the socket, ahead of the still-buffered SUB, so one round trip is not proof;
        # by the second the SUB has been written, and that PONG comes after the server took it.
        for nc in (self._nc, *self._partitions):
            await nc.flush()
            await nc.flush()
        if self._spawn is not None:
            self._announcer = self._spawn(self._announce(), "status")
        else:
            self._announcer = asyncio.create_task(self._announce(), name=f"{self.service}-status")
        return self

    async def _subscribe(self, nc: NATS, subject: str) -> None:
        async def on_message(msg: Msg) -> None:
            await self._on_message(nc, msg)

        self._subs.append(
            await nc.subscribe(
                subject,
                queue=subjects.rpc_queue_group(self.service),
                cb=on_message,
                pending_msgs_limit=self._pending_msgs,
                pending_bytes_limit=self._pending_bytes,
            )
        )

    async def _announce(self) -> None:
        subject = subjects.status_subject(self.service)
        while True:
            with contextlib.suppress(nats.errors.Error):
                await self._nc.publish(subject, pack(self.status().model_dump()))
            await asyncio.sleep(STATUS_INTERVAL_S)

    async def stop(self) -> None:
        announcer, self._announcer = self._announcer, None
        if announcer is not None:
            announcer.cancel()
            if self._spawn is not None:
                await asyncio.wait([announcer])  # a death is its supervisor's to report
            else:
                with contextlib.suppress(asyncio.CancelledError):
                    await announcer
        subs, self._subs = self._subs, []
        for sub in subs:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _on_message(self, nc: NATS, msg: Msg) -> None:
        # nats-py awaits this for one message at a time: it must only sort, never do the work.
        if not msg.reply:
            self._drop_unanswerable()
            return
        if self.admission is None:
            await self._in_arrival_order(nc, msg)
            return
        answer = self._sort(nc, msg.subject, msg.reply, msg.data, msg)
        if answer is not None:
            self._count_refusals()
            await self._publish(nc, msg.reply, answer)

    def _take(self, nc: RequestIntakeClient, subject: bytes, reply: bytes, data: bytes) -> None:
        """A request of a partition, as `strata.bus.intake` cut it from the socket's bytes: sorted
        with no `Msg` made unless it is admitted, and a refusal queued on the connection at once,
        so refusing a flood costs less than sending it."""
        if not reply:
            self._drop_unanswerable()
            return
        held = self._held.get(subject)
        if held is not None:
            if time.monotonic() < held.until:  # a flood's path: refused as its last one was
                refused = held.refused
                refused.uncounted += 1
                if refused.uncounted == 1:
                    self._uncounted.append(refused)
                if not nc.reply_now(reply, refused.reply):
                    self._count_reject("reply_not_sent")
                return
            del self._held[subject]
        answer = self._sort(nc, subject.decode(), reply.decode(), data, None, subject)
        if answer is not None and not nc.reply_now(reply, answer):
            self._count_reject("reply_not_sent")

    def _drop_unanswerable(self) -> None:
        # Nobody can read an answer: doing the work would only cost the other callers.
        self._no_reply.inc()
        self._count_reject("no_reply_subject")

    def _sort(
        self,
        nc: NATS,
        subject: str,
        reply: str,
        data: bytes,
        msg: Msg | None,
        hold: bytes | None = None,
    ) -> bytes | None:
        """Admit a request into its job's queue (None), or the answer that refuses it. With
        `hold` (the subject's bytes), a refusal by the worker's own budget is remembered for as
        long as that budget stays spent (`_take`)."""
        admission = self.admission
        assert admission is not None
        arrived = time.perf_counter()
        try:
            address = subjects.parse_rpc_subject(subject)
        except ValueError as exc:
            return self._counted(
                "?", _error(InvalidRequest.code, str(exc)), InvalidRequest.code, nc
            )
        job = address.job or OPERATOR
        now = time.monotonic()
        refusal = admission.admit(address.job, address.worker, now)
        if refusal is None:
            if msg is None:
                msg = Msg(_client=nc, subject=subject, reply=reply, data=data)
            admitted = _Admitted(msg, address, arrived, nc)
            if not self._queue.push(job, admitted, bounded=job != OPERATOR):
                refusal = admission.busy(job, self._queue.queued(job), len(self._queue))
        if refusal is not None:
            answer = self._refusal(address, refusal)
            if hold is not None and address.job is not None:
                wait = admission.held_for(refusal, address.job, address.worker, now)
                if wait > 0:
                    if len(self._held) >= _HELD_KEPT:
                        self._held.clear()
                    refused = self._refusals[(refusal, self._verb_key(address))]
                    self._held[hold] = _Held(now + wait, refused)
            return answer
        self._pump()
        return None

    def _verb_key(self, address: subjects.RpcAddress) -> str:
        return address.verb if address.verb in self._routes else "?"

    async def _in_arrival_order(self, nc: NATS, msg: Msg) -> None:
        if self._gate is None:
            await self._serve(nc, msg)
            return
        await self._gate.acquire()
        task = asyncio.create_task(self._serve_released(nc, msg))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve_released(self, nc: NATS, msg: Msg) -> None:
        try:
            await self._serve(nc, msg)
        finally:
            assert self._gate is not None
            self._gate.release()

    def _may_start(self, job: str) -> bool:
        return job == OPERATOR or self._inflight_of[job] < self._job_inflight

    def _pump(self) -> None:
        """Start admitted requests, round robin between jobs, while handlers are free, at most
        `STARTS_PER_TURN` before the event loop's next turn: the rest wait in their jobs' queues,
        so that another job's request sorted meanwhile is started in turn with them."""
        queue = self._queue
        while queue and self._inflight < self._concurrency:
            if self._starts >= STARTS_PER_TURN:
                if not self._next_turn_pending:
                    self._next_turn_pending = True
                    asyncio.get_running_loop().call_soon(self._next_turn)
                break
            popped = queue.pop(self._may_start)
            if popped is None:
                break
            job, admitted = popped
            self._starts += 1
            self._inflight += 1
            self._inflight_of[job] += 1
            task = asyncio.create_task(self._serve_admitted(job, admitted))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        self._queued.set(len(queue))

    def _next_turn(self) -> None:
        self._next_turn_pending = False
        self._starts = 0
        self._pump()

    async def _serve_admitted(self, job: str, admitted: _Admitted) -> None:
        try:
            await self._serve(admitted.nc, admitted.msg, admitted.address, admitted.arrived)
        finally:
            self._inflight -= 1
            left = self._inflight_of[job] - 1
            if left:
                self._inflight_of[job] = left
            else:
                del self._inflight_of[job]
            self._pump()

    def _refusal(self, address: subjects.RpcAddress, refusal: Refusal) -> bytes:
        """Count and log a refusal; its answer."""
        # The path a flood takes, once per message: everything it can reuse is looked up.
        verb = self._verb_key(address)
        refused = self._refusals.get((refusal, verb))
        if refused is None:
            if len(self._refusals) >= _REFUSALS_KEPT:
                self._count_refusals()
                self._refusals.clear()
            refused = self._refusals[(refusal, verb)] = _Refused(
                _error(refusal.code, refusal.message),
                refusal.code,
                RPC_REFUSED.labels(self.service, refusal.code),
                RPC_REQUESTS.labels(self.service, verb, refusal.code),
                MESSAGES_REJECTED.labels(f"rpc.{self.service}", refusal.code),
            )
        refused.uncounted += 1
        if refused.uncounted == 1:
            self._uncounted.append(refused)
        held_back = self._refused_log((refusal.code, address.job, address.worker))
        if held_back is not None:
            log.warning(
                "rpc_refused",
                service=self.service,
                code=refusal.code,
                caller_job=address.job,
                caller_worker=address.worker,
                held_back=held_back,
            )
        return refused.reply

    def _count_refusals(self) -> None:
        """Add the refusals sorted since the last call to the metrics."""
        uncounted, self._uncounted = self._uncounted, []
        for refused in uncounted:
            count, refused.uncounted = refused.uncounted, 0
            refused.refused.inc(count)
            refused.requests.inc(count)
            refused.rejected.inc(count)
            self.rejected[refused.code] += count

    async def _publish(self, nc: NATS, reply: str, answer: bytes) -> None:
        try:
            await nc.publish(reply, answer)
        except nats.errors.Error as exc:
            log.warning("rpc_reply_failed", service=self.service, error=str(exc))

    def _count_reject(self, code: str) -> None:
        self.rejected[code] += 1
        counter = self._rejected_counters.get(code)
        if counter is None:
            counter = MESSAGES_REJECTED.labels(f"rpc.{self.service}", code)
            self._rejected_counters[code] = counter
        counter.inc()

    async def _serve(
        self,
        nc: NATS,
        msg: Msg,
        address: subjects.RpcAddress | None = None,
        started: float | None = None,
    ) -> None:
        if started is None:
            started = time.perf_counter()
        if address is None:
            try:
                address = subjects.parse_rpc_subject(msg.subject)
            except ValueError as exc:
                reply = _error(InvalidRequest.code, str(exc))
                await self._publish(
                    nc, msg.reply, self._counted("?", reply, InvalidRequest.code, nc)
                )
                return
        reply, outcome = await self._reply_for(msg, address)
        await self._publish(nc, msg.reply, self._counted(address.verb, reply, outcome, nc))
        self._latency.observe(time.perf_counter() - started)

    def _counted(self, verb: str, reply: bytes, outcome: str, nc: NATS) -> bytes:
        """Count an answer by verb and outcome; the answer, or an error if it is larger than
        the server takes."""
        key = (verb if verb in self._routes else "?", outcome)
        counter = self._counted_by.get(key)
        if counter is None:
            counter = self._counted_by[key] = RPC_REQUESTS.labels(self.service, *key)
        counter.inc()
        if outcome != "ok":
            self._count_reject(outcome)
        limit = nc.max_payload
        if limit and len(reply) > limit:
            message = (
                f"{self.service}.{verb}'s answer is {len(reply)} bytes, more than the NATS "
                f"server's max_payload of {limit}: raise max_payload or ask for less at a time"
            )
            reply = _error("reply_too_large", message)
            self._count_reject("reply_too_large")
        return reply

    async def _reply_for(self, msg: Msg, address: subjects.RpcAddress) -> tuple[bytes, str]:
        verb = address.verb
        route = self._routes.get(verb)
        if route is None:
            known = ", ".join(sorted(self._routes))
            message = f"{self.service} has no verb {verb[:64]!r}; it has: {known}"
            return _error("unknown_verb", message), "unknown_verb"
        try:
            request = route.request.model_validate(unpack(msg.data))
        except StrataError as exc:
            return _error(exc.code, exc.message), exc.code
        except pydantic.ValidationError as exc:
            invalid = validation_error(exc, f"{self.service}.{verb} request")
            return _error(InvalidRequest.code, invalid.message), InvalidRequest.code
        try:
            request = self._as_caller(route, request, address)
        except Forbidden as exc:
            self._warn_forbidden(address, exc)
            return _error(exc.code, exc.message), exc.code
        try:
            return _ok(await route.handler(request)), "ok"
        except StrataError as exc:
            return _error(exc.code, exc.message), exc.code
        except Exception as exc:  # a handler bug must be answered, never crash the server
            log.exception("rpc_handler_failed", service=self.service, verb=verb)
            message = (
                f"{self.service}.{verb} failed unexpectedly ({type(exc).__name__}: {exc}); "
                "this is a bug in the service: see its logs"
            )
            return _error("internal", message), "internal"

    def _as_caller(self, route: _Route[Req], request: Req, address: subjects.RpcAddress) -> Req:
        """The request as its caller may send it, or `Forbidden` when it speaks for another job or
        worker. An operator's request (no caller on the subject) may speak for anyone."""
        if route.scope == "open" or address.job is None or address.worker is None:
            return request
        job = getattr(request, "job", None)
        if job != address.job:
            raise Forbidden(
                f"{self.service}.{address.verb} for job {job!r} was sent by worker "
                f"{address.worker!r} of job {address.job!r}: a worker acts in its own job only "
                "(its NATS credential decides which job that is)"
            )
        if route.scope != "worker":
            return request
        worker = getattr(request, "worker_id", None)
        if worker is None:
            return request.model_copy(update={"worker_id": address.worker})
        if worker != address.worker:
            raise Forbidden(
                f"{self.service}.{address.verb} for worker {worker!r} was sent by worker "
                f"{address.worker!r} of job {address.job!r}: a worker speaks only for itself "
                "(its NATS credential decides who it is)"
            )
        return request

    def _warn_forbidden(self, address: subjects.RpcAddress, exc: Forbidden) -> None:
        held_back = self._forbidden_log((address.verb, address.job, address.worker))
        if held_back is None:
            return
        log.warning(
            "rpc_forbidden",
            service=self.service,
            verb=address.verb,
            caller_job=address.job,
            caller_worker=address.worker,
            error=exc.message,
            held_back=held_back,
        )


class RpcClient:
    """Typed calls to `strata.rpc.<service>.<verb>`, sent as `caller` when it is bound to one
    (the SDK binds it to its worker), else as an operator."""

    def __init__(self, nc: NATS, *, timeout: float = 5.0, caller: Caller | None = None) -> None:
        self._nc = nc
        self._timeout = timeout
        self.caller = caller

    def bound(self, caller: Caller) -> RpcClient:
        """A client on the same connection that sends as `caller`."""
        return RpcClient(self._nc, timeout=self._timeout, caller=caller)

    @overload
    async def call(
        self,
        service: str,
        verb: str,
        request: pydantic.BaseModel | dict[str, Any] | None = None,
        *,
        result: type[Res],
        timeout: float | None = None,
        retry_for: float = 0.0,
        idempotent: bool = False,
    ) -> Res: ...

    @overload
    async def call(
        self,
        service: str,
        verb: str,
        request: pydantic.BaseModel | dict[str, Any] | None = None,
        *,
        result: None = None,
        timeout: float | None = None,
        retry_for: float = 0.0,
        idempotent: bool = False,
    ) -> Any: ...

    async def call(
        self,
        service: str,
        verb: str,
        request: pydantic.BaseModel | dict[str, Any] | None = None,
        *,
        result: type[Res] | None = None,
        timeout: float | None = None,
        retry_for: float = 0.0,
        idempotent: bool = False,
    ) -> Any:
        """Send a request and return its result, or raise the error its reply carries.

        With `retry_for`, a call that finds no responder (a service restarting) or is refused by
        the service's admission control (`rate_limited`) is retried with backoff for that long;
        an `idempotent` call is also retried after a timeout or a `busy` refusal.
        """
        caller = self.caller
        subject = (
            subjects.rpc_subject(service, verb)
            if caller is None
            else subjects.rpc_subject(service, verb, caller.job, caller.worker)
        )
        if isinstance(request, pydantic.BaseModel):
            payload = pack(request.__pydantic_serializer__.to_python(request))
        else:
            payload = pack(request or {})
        per_attempt = timeout if timeout is not None else self._timeout
        deadline = time.monotonic() + retry_for
        delays = backoff_delays(0.05, 1.0)
        error: StrataError
        while True:
            try:
                msg = await self._nc.request(subject, payload, timeout=per_attempt)
                return _parse_reply(subject, msg.data, result)
            except ServiceUnavailable as exc:
                error = exc  # the service answered that it cannot serve yet: retry like silence
            except RateLimited as exc:
                error = exc  # refused before any work was done: sending it again is always safe
            except Busy as exc:
                error = exc  # a handler may refuse with `busy` after some work: idempotent only
                if not idempotent:
                    raise
            except nats.errors.NoRespondersError:
                error = ServiceUnavailable(
                    f"no {service} service answers {subject}: is it running "
                    "(strata up, or strata serve " + service + ")?"
                )
            except (TimeoutError, nats.errors.TimeoutError):
                error = RpcTimeout(f"{subject} got no reply within {per_attempt:.1f}s")
                if not idempotent:
                    raise error from None
            except nats.errors.ConnectionClosedError:
                raise BusError(f"cannot call {subject}: the NATS connection is closed") from None
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise error
            await asyncio.sleep(min(next(delays), remaining))


def _parse_reply(subject: str, data: bytes, result: type[Res] | None) -> Any:
    body = unpack(data)
    if not isinstance(body, dict) or not isinstance(body.get("ok"), bool):
        raise CodecError(f"reply from {subject} is not a Strata reply envelope")
    if not body["ok"]:
        error = body.get("error")
        if not isinstance(error, dict):
            raise CodecError(f"error reply from {subject} carries no error object")
        raise error_from_code(str(error.get("code", "error")), str(error.get("message", "")))
    value = body.get("result")
    if result is None:
        return value
    try:
        return result.model_validate(value)
    except pydantic.ValidationError as exc:
        raise validation_error(exc, f"reply from {subject}") from None
