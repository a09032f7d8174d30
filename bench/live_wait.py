"""What `LiveGroup`'s watchful wait costs a step, next to a plain wait on each collective.

While a step's collectives have not completed, `LiveGroup` waits on them in 0.25 s turns
(`strata.torch.live.watch`), looking between turns whether the registry failed a member of its
group, so a paused or cut-off peer is left behind at the heartbeat timeout rather than the
collective's. The baseline, measured in the same run in alternating rounds, is `work.wait()` on
each. Ranks are processes of their own on one machine (gloo, CPU); each step all-reduces what a
`LiveGroup` step does for a 32-2048-2048-2 MLP: the vote (a few int64s), a 1 MiB bucket and a
16 MiB one. The figure is each way's median step over the rounds (a round's figure: the median of
`--steps` steps after `--warmup`), and the ratio of the watchful wait to the plain one per round,
median (min-max).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

WAYS = ("plain", "watch")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rank_main(rank: int, size: int, port: int, rounds: int, steps: int, warmup: int) -> None:
    import torch
    import torch.distributed as dist
    from strata.torch.live import watch

    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", port, size, rank == 0, timeout=timedelta(seconds=60)
    )
    group = dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=60))
    tensors = [torch.ones(64, dtype=torch.int64), torch.ones(1 << 18), torch.ones(4 << 20)]

    def plain(works: list[Any]) -> None:
        for work in works:
            work.wait()

    def watchful(works: list[Any]) -> None:
        watch(works, list)
        for work in works:
            work.wait()

    waits: dict[str, Callable[[list[Any]], None]] = {"plain": plain, "watch": watchful}
    medians: dict[str, list[float]] = {way: [] for way in WAYS}
    for number in range(rounds):
        order = WAYS if number % 2 == 0 else WAYS[::-1]
        for way in order:
            wait = waits[way]
            times = []
            for step in range(warmup + steps):
                started = time.perf_counter()
                wait([group.allreduce([tensor]) for tensor in tensors])
                if step >= warmup:
                    times.append(time.perf_counter() - started)
            medians[way].append(statistics.median(times))
    if rank != 0:
        return
    for way in WAYS:
        values = [v * 1e3 for v in medians[way]]
        print(
            f"{way:>5}: {statistics.median(values):.2f} ms a step "
            f"({min(values):.2f}-{max(values):.2f})"
        )
    ratios = [w / p for w, p in zip(medians["watch"], medians["plain"], strict=True)]
    print(
        f"watch / plain, per round: {statistics.median(ratios):.3f} "
        f"({min(ratios):.3f}-{max(ratios):.3f})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=3, help="processes (default 3)")
    parser.add_argument("--rounds", type=int, default=9, help="rounds of each way (default 9)")
    parser.add_argument("--steps", type=int, default=40, help="steps timed a round (default 40)")
    parser.add_argument("--warmup", type=int, default=5, help="steps not timed first (default 5)")
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        rank_main(args.rank, args.ranks, args.port, args.rounds, args.steps, args.warmup)
        return
    port = free_port()
    print(f"load average at the start: {', '.join(f'{v:.1f}' for v in os.getloadavg())}")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    common = ["--ranks", str(args.ranks), "--rounds", str(args.rounds), "--port", str(port)]
    common += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    procs = [
        subprocess.Popen([sys.executable, __file__, *common, "--rank", str(rank)], env=env)
        for rank in range(args.ranks)
    ]
    codes = [proc.wait() for proc in procs]
    print(f"load average at the end: {', '.join(f'{v:.1f}' for v in os.getloadavg())}")
    if any(codes):
        sys.exit(f"a rank failed: exit codes {codes}")


if __name__ == "__main__":
    main()
