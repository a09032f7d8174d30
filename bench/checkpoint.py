"""How long `CheckpointManager.save_state()` blocks its caller for a 512 MiB state dict, beside
`torch.save` + fsync of the same state dict in the same run. It starts its own nats-server,
registry and checkpoint service: `.venv/bin/python bench/checkpoint.py`.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import strata
import torch
from strata import procutil
from strata.bus.server import NatsServer

ROUNDS = 5


def ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as answer:
            return bool(answer.status == 200)
    except OSError:
        return False


def main() -> None:
    base = Path(tempfile.mkdtemp(dir="/tmp"))
    with NatsServer(store_dir=base / "nats") as server:
        services = []
        for name in ("registry", "checkpoint"):
            port = procutil.free_port()
            env = {**os.environ, "STRATA_NATS_URL": server.url, "STRATA_HEALTH_PORT": str(port)}
            command = [sys.executable, "-m", f"strata.services.{name}"]
            proc = subprocess.Popen(command, env=env, stderr=subprocess.DEVNULL)
            services.append((proc, port))
        deadline = time.monotonic() + 60
        while not all(ready(port) for _, port in services):
            if time.monotonic() > deadline:
                raise SystemExit("services not ready")
            time.sleep(0.1)
        state = {f"layer{i}": torch.randn(16 * 1024 * 1024) for i in range(8)}  # 8 x 64 MiB
        mib = sum(t.numel() * t.element_size() for t in state.values()) / 2**20
        blocking, plain, durable = [], [], []
        with strata.Worker(job="bench-ckpt", nats_url=server.url) as worker:
            manager = strata.CheckpointManager(
                worker, str(base / "ckpt"), keep_count=1, max_pending_bytes=64 * 2**30
            )
            for step in range(ROUNDS):
                started = time.perf_counter()
                manager.save_state(state, step=step)
                blocking.append(time.perf_counter() - started)
                manager.wait()
                durable.append(time.perf_counter() - started)
                started = time.perf_counter()
                with (base / "plain.pt").open("wb") as out:
                    torch.save(state, out)
                    out.flush()
                    os.fsync(out.fileno())
                plain.append(time.perf_counter() - started)
                (base / "plain.pt").unlink()
        for proc, _ in services:
            procutil.terminate(proc, timeout=10)
    b, p, d = (statistics.median(x) * 1000 for x in (blocking, plain, durable))
    print(f"state dict {mib:.0f} MiB, {ROUNDS} rounds, medians:")
    print(f"  save_state() blocks the caller   {b:8.0f} ms")
    print(f"  torch.save + fsync (baseline)    {p:8.0f} ms")
    print(f"  ratio                            {b / p:8.3f}   (aim <= 0.10)")
    print(f"  save_state() until durable       {d:8.0f} ms")


if __name__ == "__main__":
    main()
