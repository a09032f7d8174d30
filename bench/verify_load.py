"""What verifying before parsing costs a load: the verified read paths against the ones before.

(a) `dcp.load` of a state dict (8 float32 tensors and one plain value) with
    `strata.torch.dcp.Reader`, which reads the metadata's shard whole and checks it against the
    checksum the checkpoint service committed before parsing it (and unpickles the metadata
    through an allow-list), against the read path before that change, kept here only: the footer
    and metadata read by range, checked against the digest in the footer, plain `pickle.loads`,
    every item read by range and checked against its own checksum.
(b) `CheckpointManager.load_state` (the shard checked against the manifest's checksum, then
    `torch.load(weights_only=True)`) against the same load without the check: the shard read
    unverified, then the same `torch.load`.

Rounds alternate, rotating who goes first; figures are medians with the spread (min-max) and the
ratio verified/before. The files are in the page cache after the first round, so the reads run
at memory speed and the checking is as large a share of the time as it can be. It starts its
own nats-server, registry and checkpoint service:
`.venv/bin/python bench/verify_load.py [--size 512M] [--rounds 5]`.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import pickle
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import strata
import torch
import torch.distributed.checkpoint as dcp
from strata.checkpoint import CheckpointManager
from strata.errors import ChecksumMismatch, StrataError
from strata.events.requests import Manifest
from strata.storage import checksum_of
from strata.torch import dcp as strata_dcp
from strata.torch.dcp import Reader, Writer
from torch.distributed.checkpoint.metadata import Metadata

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.checkpoint import alternate, stack
from bench.storage import format_size, parse_size

AIM = 1.05
TENSORS = 8


async def _metadata_before(manager: CheckpointManager, manifest: Manifest) -> Metadata:
    """The metadata read as it was before verification against the manifest (bench only)."""
    storage = manager.aio.storage
    footer_format = strata_dcp._FOOTER
    for shard in sorted(manifest.shards, key=lambda shard: shard.rank):
        footer = await storage.read_range(
            shard.key, shard.bytes - footer_format.size, footer_format.size
        )
        _, offset, length, digest = footer_format.unpack(footer)
        if not length:
            continue
        encoded = await storage.read_range(shard.key, offset, length)
        if checksum_of(encoded) != "xxh128:" + digest.decode():
            raise ChecksumMismatch("metadata", key=shard.key)
        metadata = await asyncio.to_thread(pickle.loads, encoded)
        assert isinstance(metadata, Metadata)
        return metadata
    raise StrataError("no metadata")


class ReaderBefore(Reader):
    """`Reader` with the metadata read as before and no shard verified whole: every item is
    read by range and checked against its own checksum, as before."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            manager = self.manager
            self._metadata = manager._runner.run(_metadata_before(manager, self.manifest))
            self._verified = {}
        return self._metadata


def state_dict(size: int) -> dict[str, Any]:
    per = size // TENSORS // 4
    state: dict[str, Any] = {f"layer{i}": torch.randn(per) for i in range(TENSORS)}
    state["step"] = 1000
    return state


def blank(state: dict[str, Any]) -> dict[str, Any]:
    return {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else -1 for k, v in state.items()}


def spread(values: list[float], scale: float) -> str:
    return f"{min(values) * scale:.0f}-{max(values) * scale:.0f}"


def row(name: str, times: list[float]) -> str:
    return f"{name:<38}{statistics.median(times) * 1000:8.0f} ms  (rounds {spread(times, 1000)})"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--size", default="512M")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="directory on the disk to test")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    size = parse_size(args.size)
    base = Path(tempfile.mkdtemp(dir=args.dir or "/tmp"))
    state = state_dict(size)
    nbytes = sum(
        t.numel() * t.element_size() for t in state.values() if isinstance(t, torch.Tensor)
    )
    lines = [
        f"Verified loads vs the read paths before, {time.strftime('%Y-%m-%d')}, Python "
        f"{platform.python_version()}, torch {torch.__version__}, {os.cpu_count()} cores, "
        f"load average {os.getloadavg()[0]:.1f}, {args.rounds} rounds, state dict "
        f"{format_size(nbytes)} ({TENSORS} tensors)"
    ]
    try:
        with stack(base) as url, strata.Worker(job="bench-verify", nats_url=url) as worker:
            manager = strata.CheckpointManager(worker, str(base / "ckpt"), keep_count=10)
            dcp.save(state, storage_writer=Writer(manager, step=1), no_dist=True)
            manager.save_state(state, step=2)
            manager.wait()
            manager.wait_committed(2)
            targets = [blank(state), blank(state)]

            def dcp_verified(number: int) -> None:
                dcp.load(targets[0], storage_reader=Reader(manager, step=1), no_dist=True)

            def dcp_before(number: int) -> None:
                dcp.load(targets[1], storage_reader=ReaderBefore(manager, step=1), no_dist=True)

            times: dict[str, list[float]] = {key: [] for key in ("dv", "db", "sv", "sb")}
            alternate(
                [(times["dv"], dcp_verified), (times["db"], dcp_before)], args.rounds, lambda: None
            )
            for target in targets:
                assert all(
                    torch.equal(target[k], v) if isinstance(v, torch.Tensor) else target[k] == v
                    for k, v in state.items()
                )
            manifest = manager._runner.run(manager.aio._manifest(2))
            shard = manifest.shards[0]
            storage = manager.aio.storage

            def state_verified(number: int) -> None:
                loaded = manager.load_state(step=2)
                assert loaded["step"] == 1000

            def state_before(number: int) -> None:
                # The same manifest lookup (a status request to the service), no check.
                assert manager._runner.run(manager.aio._manifest(2)).shards[0] == shard
                data = manager._runner.run(storage.read_range(shard.key, 0, shard.bytes))
                loaded = torch.load(io.BytesIO(data), weights_only=True)
                assert loaded["step"] == 1000

            alternate(
                [(times["sv"], state_verified), (times["sb"], state_before)],
                args.rounds,
                lambda: None,
            )
            ratio_dcp = statistics.median(times["dv"]) / statistics.median(times["db"])
            ratio_state = statistics.median(times["sv"]) / statistics.median(times["sb"])
            lines += [
                "  (a) " + row("dcp.load, verified against the manifest", times["dv"]),
                "      " + row("dcp.load, read path before", times["db"]),
                f"      ratio verified/before {ratio_dcp:26.3f}  "
                f"({'met' if ratio_dcp <= AIM else 'missed'}, aim <= {AIM:.2f})",
                "  (b) " + row("load_state, verified against the manifest", times["sv"]),
                "      " + row("load_state, unverified read", times["sb"]),
                f"      ratio verified/unverified {ratio_state:22.3f}  "
                f"({'met' if ratio_state <= AIM else 'missed'}, aim <= {AIM:.2f})",
            ]
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
