"""Where checkpoint bytes are stored: one `StorageBackend` interface, local disk and S3 behind it.

`open_storage` turns a location (`s3://bucket/prefix`, `file:///abs/path` or a plain path) or,
without one, the settings (`STORAGE_BACKEND`, `CHECKPOINT_BUCKET`, `AWS_REGION`,
`STRATA_S3_ENDPOINT_URL`, `STRATA_DATA_DIR`) into a backend. `S3Storage` is imported on first use,
so the local backend works without the `s3` extra installed.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

from strata.config import Settings, load_settings
from strata.errors import ConfigError
from strata.storage._checksum import checksum_of
from strata.storage.base import (
    CHECKSUM_ALGORITHM,
    StorageBackend,
    WriteResult,
    check_key,
    manifest_key,
    shard_key,
    step_prefix,
)
from strata.storage.local import LocalStorage

if TYPE_CHECKING:
    from strata.storage.s3 import S3Storage

CHECKPOINTS_DIR = "checkpoints"
"""Where checkpoints go when no location is given: under the data dir, or as the S3 prefix."""


def open_storage(location: str | None = None, settings: Settings | None = None) -> StorageBackend:
    """The backend for `location`, or for the configured default when it is None.

    `s3://bucket[/prefix]` gives `S3Storage` (region and endpoint from the settings);
    `file:///abs/path` or a plain path gives `LocalStorage`. Without a location,
    `STORAGE_BACKEND=s3` means `s3://$CHECKPOINT_BUCKET/checkpoints`, otherwise
    `$STRATA_DATA_DIR/checkpoints`. Raises `ConfigError` for a location it cannot use.
    """
    if settings is None:
        settings = load_settings()
    if location is None:
        location = default_location(settings)
    if not location.strip():
        raise ConfigError("storage location is empty; give a path or an s3://bucket/prefix URL")
    parts = urlsplit(location)
    scheme = parts.scheme.lower()
    if scheme not in ("s3", "file") and "://" not in location:
        return LocalStorage(location)
    if scheme == "s3":
        if not parts.netloc:
            raise ConfigError(
                f"storage location {location!r} names no bucket; use s3://bucket/prefix"
            )
        if parts.query or parts.fragment:
            raise ConfigError(f"storage location {location!r}: S3 URLs take no '?' or '#' part")
        return _s3_storage(parts.netloc, parts.path, settings)
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise ConfigError(
                f"storage location {location!r} names host {parts.netloc!r}; file URLs are "
                "local: file:///absolute/path"
            )
        path = unquote(parts.path)
        if not path.startswith("/"):
            raise ConfigError(f"storage location {location!r}: use file:///absolute/path")
        return LocalStorage(path)
    raise ConfigError(
        f"storage location {location!r} has unknown scheme {parts.scheme!r}; use s3://bucket/prefix,"
        " file:///absolute/path or a plain path"
    )


def default_location(settings: Settings) -> str:
    """The location the settings choose when none is given explicitly."""
    if settings.storage_backend == "s3":
        if not settings.checkpoint_bucket:
            raise ConfigError(
                "STORAGE_BACKEND=s3 needs CHECKPOINT_BUCKET (the bucket checkpoints go to)"
            )
        return f"s3://{settings.checkpoint_bucket}/{CHECKPOINTS_DIR}"
    return str(Path(settings.data_dir) / CHECKPOINTS_DIR)


def _s3_storage(bucket: str, prefix: str, settings: Settings) -> StorageBackend:
    from strata.storage.s3 import S3Storage

    return S3Storage(
        bucket,
        prefix.strip("/"),
        region=settings.aws_region,
        endpoint_url=settings.s3_endpoint_url,
    )


def __getattr__(name: str) -> Any:
    if name == "S3Storage":
        from strata.storage.s3 import S3Storage

        return S3Storage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CHECKSUM_ALGORITHM",
    "LocalStorage",
    "S3Storage",
    "StorageBackend",
    "WriteResult",
    "check_key",
    "checksum_of",
    "default_location",
    "manifest_key",
    "open_storage",
    "shard_key",
    "step_prefix",
]
