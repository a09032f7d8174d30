"""A worker process that only heartbeats, for fault tests: `python -m tests.faults.heartbeater
JOB NATS_URL WORKER_ID [WORK...]`. It registers, prints `registered <rank>`, does each WORK on
the main thread, printing `done` after them, then heartbeats until its stdin closes or it is
killed. The work: `import:<module>`; `s3-checkpoints`, a checkpoint manager on S3 (which imports
aioboto3); `slow-import:<module>:<seconds>`, which makes the first import of that module (from
whatever thread) compute for that long first, as a cold import on a loaded machine does."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import time
from collections.abc import Sequence

import strata


class SlowImport(importlib.abc.MetaPathFinder):
    """Computes (holding the GIL as Python code does) for `seconds` before `module` is found."""

    def __init__(self, module: str, seconds: float) -> None:
        self.module, self.seconds = module, seconds

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname == self.module:
            sys.meta_path.remove(self)
            deadline = time.monotonic() + self.seconds
            while time.monotonic() < deadline:
                sum(range(1000))
        return None


def main() -> None:
    job, nats_url, worker_id, *work = sys.argv[1:]
    worker = strata.Worker(job, nats_url, worker_id=worker_id)
    worker.start()
    print(f"registered {worker.rank}", flush=True)
    for item in work:
        if item.startswith("import:"):
            importlib.import_module(item.removeprefix("import:"))
        elif item.startswith("slow-import:"):
            module, seconds = item.removeprefix("slow-import:").split(":")
            sys.meta_path.insert(0, SlowImport(module, float(seconds)))
        elif item == "s3-checkpoints":
            strata.CheckpointManager(worker, path="s3://strata-faults/checkpoints")
        else:
            raise SystemExit(f"unknown work {item!r}")
    if work:
        print("done", flush=True)
    sys.stdin.read()
    worker.stop()


if __name__ == "__main__":
    main()
