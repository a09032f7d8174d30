"""The worker's membership: the registry's notices (register again, superseded), re-registering
on its own after being marked failed, and the job's world (membership epoch, size)."""

from __future__ import annotations

import contextlib
import functools
import inspect
import time

from nats.aio.msg import Msg

from strata.aio._core import MEMBERS_RETRY_S, REGISTRY, RPC_TIMEOUT_S
from strata.aio._heartbeats import _Heartbeats
from strata.errors import StrataError, WorkerSuperseded
from strata.events import decode_model, subjects
from strata.events.requests import (
    Lease,
    MembersRequest,
    MembersResult,
    Registration,
    SuspectRequest,
    SuspectResult,
    WorkerNotice,
    WorldNotice,
)


class _Membership(_Heartbeats):
    """Notices, re-registration and the job's world; see `strata.aio.Worker`."""

    # -- notices from the registry ----------------------------------------------------------------

    async def _subscribe_control(self) -> None:
        if self._control is not None:
            with contextlib.suppress(Exception):
                await self._control.unsubscribe()
        if self._probes is not None:
            with contextlib.suppress(Exception):
                await self._probes.unsubscribe()
        self._control = await self.bus.nc.subscribe(
            subjects.control_subject(self._job, self._worker_id), cb=self._on_control
        )
        # Subscribed before registering (and on this connection, so the server has it before
        # the registration): a probe of the registration, from its first moment, finds a
        # responder for as long as this process's connection lives (`registry.suspect`).
        self._probes = await self.bus.nc.subscribe(
            subjects.probe_subject(self._job, self._worker_id, "*"), cb=self._on_probe
        )

    async def _on_probe(self, msg: Msg) -> None:
        """Answer the registry's probe of one of this process's registrations at once; a probe
        of another process's instance of this worker id goes unanswered (the registry then
        changes nothing)."""
        instance = subjects.untoken(msg.subject.rsplit(".", 1)[-1])
        if instance not in (self._instance, self._next_instance) or not msg.reply:
            return
        with contextlib.suppress(Exception):
            await msg.respond(b"")

    async def _on_control(self, msg: Msg) -> None:
        try:
            notice = decode_model(msg.data, WorkerNotice, "worker notice")
        except StrataError as exc:
            self._log.warning("worker_notice_ignored", error=str(exc))
            return
        if (notice.job, notice.worker_id) != (self._job, self._worker_id):
            return
        if notice.instance is not None and notice.instance != self._instance:
            return  # for another process using this worker id
        if notice.kind == "reregister":
            if notice.instance == self._instance and self._registration is not None:
                # This very registration is over (not a late notice to an earlier instance).
                self._lease_lost = True
            self._request_rejoin(notice.reason)
        elif notice.kind == "superseded" and not self._rejoining:
            self._supersede(notice.reason)

    def _supersede(self, reason: str) -> None:
        """Another process holds this worker id now: stop heartbeating, never register again."""
        if self._superseded is not None or not self._started or self._stopping:
            return
        self._superseded = reason
        self._log.error(
            "worker_superseded",
            reason=reason,
            consequence="this process no longer counts as the worker: its heartbeats stop, it "
            "will not register again, and its barrier arrivals are refused; stop it",
        )

    def _request_rejoin(self, reason: str) -> None:
        if (
            not self._started
            or self._stopping
            or self._registration is None
            or self._superseded is not None
        ):
            return
        if self._rejoin_task is not None and not self._rejoin_task.done():
            return  # one re-registration answers a whole burst of notices
        # Heartbeats sent before the last registration can still draw notices after it.
        if time.monotonic() - self._registered_at < 2 * self._registration.heartbeat_interval:
            return
        self._rejoin_task = self._spawn(self._rejoin(reason), "rejoin")

    async def _rejoin(self, reason: str) -> None:
        previous_rank = self.rank
        self._log.warning("worker_reregistering", reason=reason)
        # The old instance's heartbeats stop meanwhile: one reaching the registry after the new
        # registration and before its answer would draw a `superseded` notice to this process.
        self._rejoining = True
        try:
            registration = await self._register(rejoin=True)
        except WorkerSuperseded as exc:
            self._supersede(exc.message)
            return
        except StrataError as exc:
            self._log.error(
                "worker_reregister_failed",
                error=str(exc),
                consequence="the registry will ask again on the next heartbeat",
            )
            return
        finally:
            self._rejoining = False
        self._apply_registration(registration)
        if not registration.rejoined:
            # The registry still had this registration live (e.g. it was rebuilding its state).
            self._log.info("worker_reregister_not_needed", rank=registration.rank)
            return
        self._rejoin_count += 1
        self._log.warning(
            "worker_rejoined",
            rank=registration.rank,
            previous_rank=previous_rank,
            world_size=self._membership_view[1],
            membership_epoch=self._membership_view[0],
            rejoin_count=self._rejoin_count,
        )
        if self._on_rejoin is None:
            return
        try:
            outcome = self._on_rejoin(registration)
            if inspect.isawaitable(outcome):
                await outcome
        except Exception:
            self._log.exception("on_rejoin_failed")

    def _apply_registration(self, registration: Registration) -> None:
        if registration.instance != self._instance:
            # A rejoin: this process is the new instance from now on (its heartbeats, notices,
            # barrier arrivals and checkpoint saves), and the old one's lease is over.
            self._instance = registration.instance
            self._register_request = self._register_request.model_copy(
                update={"instance": registration.instance, "worker_id": self._worker_id}
            )
        self._next_instance = None
        self._registration = registration
        self._registered_at = time.monotonic()
        self._lease = Lease(
            worker_id=registration.worker_id,
            instance=registration.instance,
            epoch=registration.lease_epoch,
        )
        self._lease_confirmed_at = max(self._lease_confirmed_at, self._register_sent_at)
        self._lease_lost = False
        self._lease_doubt_since = None
        self._observe_membership(registration.membership_epoch, registration.world_size)

    # -- membership -------------------------------------------------------------------------------

    async def members(
        self, *, include_gone: bool = False, retry_for: float = MEMBERS_RETRY_S
    ) -> MembersResult:
        """The job's membership as the registry sees it (live workers; all with include_gone)."""
        result = await self.bus.rpc.call(
            REGISTRY,
            "members",
            MembersRequest(job=self._job, include_gone=include_gone),
            result=MembersResult,
            timeout=RPC_TIMEOUT_S,
            retry_for=retry_for,
            idempotent=True,
        )
        self._observe_membership(result.membership_epoch, result.world_size)
        return result

    async def report_suspect(self, worker_id: str) -> SuspectResult:
        """Report a peer of this job suspected dead (a collective with it failed); returns what
        the registry decided. It probes the peer's registration: if NATS answers that nobody
        listens there (the peer's connection is gone, as after a kill), its failure is recorded
        at once (`failed`), without waiting for the heartbeat timeout; a peer that answers is
        `alive`, and one that does not answer in time (paused) is left to the heartbeat timeout
        (`unanswered`). `not_live`: the peer holds no live registration. Needs this worker's
        live lease (`StaleLease` otherwise)."""
        return await self.bus.rpc.call(
            REGISTRY,
            "suspect",
            SuspectRequest(
                job=self._job, worker_id=self._worker_id, suspect=worker_id, lease=self.lease
            ),
            result=SuspectResult,
            timeout=RPC_TIMEOUT_S,
            idempotent=True,
        )

    def _observe_membership(self, membership_epoch: int, world_size: int) -> None:
        if membership_epoch >= self._membership_view[0]:
            self._membership_view = (membership_epoch, max(0, world_size))

    async def _on_world_notice(self, msg: Msg) -> None:
        """The registry's notice of the job's world: epoch and size, newest wins."""
        try:
            notice = decode_world_notice(msg.data)
        except StrataError:
            return
        if notice.job == self._job:
            self._observe_membership(notice.membership_epoch, notice.world_size)


@functools.lru_cache(maxsize=64)
def decode_world_notice(data: bytes) -> WorldNotice:
    """A world notice; every in-process worker of the job receives the same bytes, decoded once.
    Raises `strata.CodecError` for anything else."""
    return decode_model(data, WorldNotice, "world notice")
