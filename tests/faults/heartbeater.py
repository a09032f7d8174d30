"""A worker process that only heartbeats, for fault tests: `python -m tests.faults.heartbeater
JOB NATS_URL WORKER_ID [MODULE...]`. It registers, prints `registered <rank>`, imports each
MODULE on the main thread (printing `imported` when done), then heartbeats until its stdin closes
or it is killed."""

from __future__ import annotations

import importlib
import sys

import strata


def main() -> None:
    job, nats_url, worker_id, *modules = sys.argv[1:]
    worker = strata.Worker(job, nats_url, worker_id=worker_id)
    worker.start()
    print(f"registered {worker.rank}", flush=True)
    for module in modules:
        importlib.import_module(module)
    if modules:
        print("imported", flush=True)
    sys.stdin.read()
    worker.stop()


if __name__ == "__main__":
    main()
