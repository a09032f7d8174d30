"""A worker's report of a peer it suspects dead (`registry.suspect`), judged on evidence.

A collective failing with a peer is a hint, not evidence: a slow or paused peer fails it as well.
The registry probes the suspect's current registration (a request to its probe subject,
`subjects.probe_subject`, sent again until the first answer, where the SDK listens from before it
registers for as long as its connection lives, answered on the worker's own probe answer subject,
which a worker credential may publish on) and acts on one answer only: NATS's "no responders", which
says that no connection holds that subscription any more (the process was killed, or its connection
is gone). Then the failure is recorded at once, with the same event, id (`failure_id`) and
conditional write as the heartbeat timeout's, so whichever decision is stored first counts and a
registration ends once. A probe answered means alive; a probe unanswered within its timeout (a
paused process, a slow network) changes nothing, and the heartbeat timeout decides as usual.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from typing import Literal

import nats.errors
import structlog
from nats.aio.client import Client as NATS
from strata.errors import ConflictError
from strata.events import WorkerFailed, subjects
from strata.events.requests import SuspectRequest, SuspectResult, SuspectVerdict
from strata.services.leases import Leases
from strata.services.registry import domain
from strata.services.registry.detector import FailureDetector

log = structlog.get_logger("strata.registry")

PROBE_TIMEOUT_S = 1.0
"""How long a probe waits for the suspect's answer (at most a quarter of the heartbeat timeout),
sending it again meanwhile (`probe`). Only "no responders" is acted on; the timeout bounds how
long a paused suspect holds the reporter's request."""

NO_RESPONDERS = "503"
"""The status NATS gives, in a message's headers, to the reply subject of a request that found
no subscriber."""

ProbeOutcome = Literal["answered", "no_responders", "unanswered"]


REPROBE_FIRST_S = 0.05
"""How long the first probe waits before the same probe is sent again (then twice as long each
time, within the probe's timeout)."""


async def probe(nc: NATS, job: str, worker_id: str, instance: str, timeout: float) -> ProbeOutcome:
    """Probe one registration of a worker. The reply subject is the worker's own probe answer
    subject (`subjects.probe_answer_subject`), with a fresh nonce, rather than this connection's
    inbox: a worker credential may publish there and nowhere else that a reply could go, so a
    live worker answers under `strata up --secure` too, and only for itself.

    The probe is sent again after `REPROBE_FIRST_S`, then at doubling intervals, until the first
    answer or the timeout. A peer's report can come within milliseconds of the suspect's death,
    before the NATS server has read its closed connection: the first probe then goes into that
    connection's buffer, unanswered and with no "no responders", and only a later one finds the
    subscription gone. The first message decides: an answer to any probe, or "no responders"."""
    answers = subjects.probe_answer_subject(job, worker_id, secrets.token_hex(8))
    sub = await nc.subscribe(answers, max_msgs=1)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    wait = REPROBE_FIRST_S
    try:
        while True:
            await nc.publish(subjects.probe_subject(job, worker_id, instance), b"", reply=answers)
            left = deadline - loop.time()
            try:
                msg = await sub.next_msg(timeout=max(0.001, min(wait, left)))
                break
            except nats.errors.TimeoutError:
                if wait >= left:
                    return "unanswered"
                wait *= 2
    finally:
        with contextlib.suppress(nats.errors.BadSubscriptionError):
            await sub.unsubscribe()  # unless already gone with its one message
    if msg.headers and msg.headers.get("Status") == NO_RESPONDERS:
        return "no_responders"
    return "answered"


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
        timeout = min(PROBE_TIMEOUT_S, self.policy.heartbeat_timeout / 4)
        outcome = await probe(self.bus.nc, request.job, request.suspect, instance, timeout)
        if outcome == "unanswered":
            log.info("suspect_unanswered", job=request.job, worker_id=request.suspect)
            return self._answer(request, "unanswered")
        if outcome == "answered":
            return self._answer(request, "alive")
        # The evidence: nobody listens on the registration's probe subject.
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
