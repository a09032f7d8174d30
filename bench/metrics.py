"""What `log_metrics` costs the training thread, next to publishing each sample from it.

A sync `strata.Worker` (a real registry and nats-server) logs two figures per step. The baseline,
measured in the same run in alternating rounds, is what an unbatched call would do: hand each
sample to the worker's event loop and wait for its publish, as `set_state` does for a new state.
Each figure is the median of the rounds' per-call means (µs), with the spread (min-max).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

import strata
from strata import procutil
from strata.bus.server import NatsServer
from strata.config import Env
from strata.events import MetricSampled

READY_TIMEOUT_S = 60.0


def start_registry(nats_url: str, log: Path) -> subprocess.Popen[bytes]:
    port = procutil.free_port()
    env = {**os.environ, Env.NATS_URL: nats_url, Env.HEALTH_PORT: str(port)}
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "strata.services.registry"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=procutil.child_preexec,
        )
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        url = f"http://127.0.0.1:{port}/readyz"
        with (
            contextlib.suppress(urllib.error.URLError, OSError),
            urllib.request.urlopen(url, timeout=1) as answer,
        ):
            if answer.status == 200:
                return proc
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the registry did not start:\n{log.read_text()[-2000:]}")
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=0.05)


def per_call_us(calls: int, call: Callable[[int], None]) -> float:
    began = time.perf_counter()
    for step in range(calls):
        call(step)
    return (time.perf_counter() - began) / calls * 1e6


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--calls", type=int, default=5000, help="calls per variant and round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp, NatsServer(store_dir=Path(tmp) / "nats") as server:
        registry = start_registry(server.url, Path(tmp) / "registry.log")
        try:
            with strata.Worker(job="bench-metrics", nats_url=server.url) as worker:

                def batched(step: int) -> None:
                    figures = {"loss": 1.0 / (step + 1), "samples_per_s": 812.0}
                    worker.log_metrics(figures, step=step)

                def unbatched(step: int) -> None:
                    for name, value in (("loss", 1.0 / (step + 1)), ("samples_per_s", 812.0)):
                        sample = MetricSampled(
                            job=worker.job,
                            source=worker.id,
                            worker_id=worker.id,
                            name=name,
                            value=value,
                            step=step,
                        )
                        worker.runner.run(worker.bus.publish_telemetry(sample))

                rounds: dict[str, list[float]] = {"log_metrics": [], "publish per call": []}
                for _ in range(args.rounds):
                    rounds["log_metrics"].append(per_call_us(args.calls, batched))
                    rounds["publish per call"].append(per_call_us(args.calls, unbatched))
                worker.flush_metrics()
        finally:
            procutil.terminate(registry, timeout=10)
    medians = {name: statistics.median(values) for name, values in rounds.items()}
    print(f"{args.calls} calls x {args.rounds} rounds, two figures per call (µs per call)")
    for name, values in rounds.items():
        print(f"  {name:17} {medians[name]:8.2f}  (spread {min(values):.2f}-{max(values):.2f})")
    ratio = medians["log_metrics"] / medians["publish per call"]
    print(f"  ratio {ratio:.3f} (log_metrics / publish per call; below 1 is cheaper)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
