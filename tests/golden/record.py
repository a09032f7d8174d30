"""Record a golden history: run the scenario against real services and keep its events and state.

`python -m tests.golden.record` starts a private nats-server and the services, runs
`tests.golden.scenario`, exports the job (events and heartbeats, as `strata export` does) to
`<name>.jsonl` and writes the state it rebuilds to `<name>.json`. `--state-only` re-derives the
`.json` from the recorded `.jsonl`: for a deliberate change of what the dashboard shows, never
to make a failing golden test pass without knowing why.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import tempfile
import time
from pathlib import Path

from strata.bus import Bus
from strata.bus.server import NatsServer
from strata.events import subjects
from strata.history import job_history, read_records
from strata.services.readmodel import rebuild, render_dashboard

from tests.golden.scenario import Scenario, checkpoint_service_available
from tests.support import ServiceProcess

HERE = Path(__file__).resolve().parent
JOB = "golden-job"


def write_state(history: Path) -> dict[str, object]:
    records = list(read_records(history))
    job = records[0].event.job
    document = render_dashboard(rebuild(records, job))
    history.with_suffix(".json").write_text(json.dumps(document, indent=2) + "\n")
    return document


SETTLED_S = 1.0
SETTLE_TIMEOUT_S = 20.0


async def settle(bus: Bus, job: str) -> None:
    """Until the job's events stop coming (the services' reactions to the last ones included)."""
    subject = subjects.job_events(job)
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    last, since = -1, time.monotonic()
    while time.monotonic() - since < SETTLED_S:
        if time.monotonic() > deadline:
            raise TimeoutError(f"events of {job} still coming after {SETTLE_TIMEOUT_S}s")
        info = await bus.js.stream_info(subjects.EVENTS_STREAM, subjects_filter=subject)
        count = sum((info.state.subjects or {}).values())
        if count != last:
            last, since = count, time.monotonic()
        await asyncio.sleep(0.1)


async def export(nats_url: str, job: str) -> list[str]:
    async with await Bus.connect(nats_url, name="golden-recorder") as bus:
        await settle(bus, job)
        return [record.to_json() async for record in job_history(bus.js, job, telemetry=True)]


def record(name: str) -> Path:
    target = HERE / f"{name}.jsonl"
    with (
        tempfile.TemporaryDirectory() as scratch,
        NatsServer(store_dir=Path(scratch) / "nats") as nats,
    ):
        names = ["registry", "sharding", "barrier"]
        checkpoints = checkpoint_service_available()
        if checkpoints:
            names.append("checkpoint")
        services = [ServiceProcess(n, nats.url, Path(scratch) / "logs") for n in names]
        with contextlib.ExitStack() as stack:
            for service in services:
                service.start()
                stack.callback(service.stop)
            root = Path(scratch) / "checkpoints" if checkpoints else None
            asyncio.run(Scenario(JOB, nats.url, checkpoint_root=root).run())
            lines = asyncio.run(export(nats.url, JOB))
    target.write_text("\n".join(lines) + "\n")
    print(f"recorded {len(lines)} records of {JOB} to {target}")
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--name", default="training-job", help="file name, without suffix")
    parser.add_argument(
        "--state-only", action="store_true", help="re-derive <name>.json from <name>.jsonl"
    )
    args = parser.parse_args()
    history = HERE / f"{args.name}.jsonl"
    if not args.state_only:
        history = record(args.name)
    document = write_state(history)
    print(f"wrote {history.with_suffix('.json')} ({len(document['workers'])} workers)")  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
