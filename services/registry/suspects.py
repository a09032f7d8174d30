"""A worker's report of a peer it suspects dead (`registry.suspect`), judged on evidence.

A collective failing with a peer is a hint, not evidence: a slow or paused peer fails it as well.
The registry probes the suspect's current registration (one request to its probe subject,
`subjects.probe_subject`, where the SDK listens from before it registers for as long as its
connection lives) and acts on one answer only: NATS's immediate "no responders", which says that
no connection holds that subscription any more (the process was killed, or its connection is
gone). Then the failure is recorded at once, with the same event, id (`failure_id`) and
conditional write as the heartbeat timeout's, so whichever decision is stored first counts and a
registration ends once. A probe answered means alive; a probe unanswered within its timeout (a
paused process, a slow network) changes nothing, and the heartbeat timeout decides as usual.
"""

from __future__ import annotations

import asyncio

import nats.errors
import structlog
from strata.errors import ConflictError
from strata.events import WorkerFailed, subjects
from strata.events.requests import SuspectRequest, SuspectResult, SuspectVerdict
from strata.services.leases import Leases
from strata.services.registry import domain
from strata.services.registry.detector import FailureDetector

log = structlog.get_logger("strata.registry")

PROBE_TIMEOUT_S = 1.0
"""How long a probe waits for the suspect's answer (at most a quarter of the heartbeat timeout).
Only "no responders" is acted on, and it comes at once; the timeout bounds how long a paused
suspect holds the reporter's request."""

RECORD_ATTEMPTS = 3
"""Conditional writes of a proven failure refused (another worker event stored meanwhile) before
the report is answered without it; the heartbeat timeout still applies."""


class SuspectReports(FailureDetector):
    async def _suspect(self, request: SuspectRequest) -> SuspectResult:
        job = self.state.jobs.get(request.job)
        reporter = job.members.get(request.worker_id) if job is not None else None
        leases = Leases()
        if reporter is not None:
            if reporter.live:
                leases.current[reporter.worker_id] = (reporter.instance, reporter.registered_epoch)
            else:
                leases.ended[reporter.worker_id] = reporter.status
        refused = leases.check(request.job, request.lease, request.worker_id)
        if refused is not None:
            raise refused
        suspect = job.members.get(request.suspect) if job is not None else None
        if job is None or suspect is None or not suspect.live:
            return self._answer(request, "not_live")
        instance = suspect.instance
        probe = subjects.probe_subject(request.job, request.suspect, instance)
        timeout = min(PROBE_TIMEOUT_S, self.policy.heartbeat_timeout / 4)
        try:
            await self.bus.nc.request(probe, b"", timeout=timeout)
        except nats.errors.NoRespondersError:
            pass  # the evidence: nobody listens on the registration's probe subject
        except nats.errors.TimeoutError:
            log.info("suspect_unanswered", job=request.job, worker_id=request.suspect)
            return self._answer(request, "unanswered")
        else:
            return self._answer(request, "alive")
        reason = (
            f"reported by {request.worker_id}: its probe found no responder (the process's "
            "NATS connection is gone)"
        )
        return self._answer(request, await self._record_suspect(request, instance, reason))

    async def _record_suspect(
        self, request: SuspectRequest, instance: str, reason: str
    ) -> SuspectVerdict:
        """Store the suspect's failure with the detector's conditional write: only if no event
        on the job's worker subjects was stored after the last one folded here. A refused write
        is decided again once caught up (the registration may have ended or changed since)."""
        for _ in range(RECORD_ATTEMPTS):
            async with self.lock:
                failure = domain.suspect_failure(
                    self.state, request.job, request.suspect, instance, reason, self.now_ns()
                )
                if failure is None:
                    # Ended meanwhile: failed by this report's twin or its heartbeat timeout, left,
                    # or registered again as another instance.
                    member = self.state.job(request.job).members.get(request.suspect)
                    live = member is not None and member.live
                    return "failed" if not live and member is not None else "not_live"
                contradicted = await self._contradicted_by_stream([failure])
                if contradicted is None or contradicted:
                    return "unanswered"  # the stream holds newer heartbeats: not silent
                try:
                    ack = await self.bus.publish(
                        failure,
                        expected_last_subject_seq=self._worker_seqs.get(request.job, 0),
                        expected_subject=subjects.area_events(request.job, "worker"),
                    )
                except ConflictError:
                    await self.sync()
                    async with asyncio.timeout(self._bound_s()):
                        await self._learn_worker_seq(request.job)
                    continue
            await self.wait_applied(ack.seq)
            self._log_failed(failure)
            return "failed"
        return "unanswered"

    def _log_failed(self, failure: WorkerFailed) -> None:
        log.warning(
            "worker_failed",
            job=failure.job,
            worker_id=failure.worker_id,
            reason=failure.reason,
        )

    def _answer(self, request: SuspectRequest, verdict: SuspectVerdict) -> SuspectResult:
        job = self.state.jobs.get(request.job)
        if verdict != "failed":
            log.info("suspect_reported", job=request.job, suspect=request.suspect, verdict=verdict)
        return SuspectResult(
            job=request.job,
            suspect=request.suspect,
            verdict=verdict,
            membership_epoch=job.membership_epoch if job is not None else 0,
        )
