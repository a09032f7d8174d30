"""Checksums of stored objects: `xxh128:<hex>` (XXH3, 128 bits) over exactly the bytes stored.

Both backends compute the checksum when writing and compare it when reading; a difference is a
`ChecksumMismatch` naming the key and both values, so damaged bytes are never handed back.
"""

from __future__ import annotations

import xxhash

from strata.errors import ChecksumMismatch, ValidationError
from strata.storage.base import CHECKSUM_ALGORITHM

_PREFIX = f"{CHECKSUM_ALGORITHM}:"


def checksum_of(data: bytes | memoryview) -> str:
    """`xxh128:<32 hex digits>` of `data`; releases the GIL, so it can run beside other work."""
    return _PREFIX + xxhash.xxh3_128_hexdigest(data)


def check_checksum(value: str, *, field: str = "checksum") -> str:
    """`value` if it is an `xxh128:` checksum this package can verify, else `ValidationError`."""
    algorithm, sep, digest = value.partition(":")
    if not sep or algorithm != CHECKSUM_ALGORITHM or len(digest) != 32:
        raise ValidationError(
            f"checksum {value!r} cannot be verified: expected '{_PREFIX}' followed by 32 hex "
            "digits, as recorded by Strata's storage backends",
            field=field,
        )
    try:
        int(digest, 16)
    except ValueError:
        raise ValidationError(
            f"checksum {value!r} has a digest that is not hex", field=field
        ) from None
    return value.lower()


def verify(key: str, uri: str, data: bytes | memoryview, *expected: str | None) -> str:
    """The checksum of `data`, after checking it equals every recorded checksum given.

    `expected` holds the caller's record (e.g. from a manifest) and the one stored with the object;
    either may be None when not known.
    """
    wanted = [check_checksum(value) for value in expected if value is not None]
    actual = checksum_of(data)
    for value in wanted:
        if value != actual:
            raise ChecksumMismatch(
                f"checksum mismatch for {key!r} ({uri}): {value} was recorded at write but the "
                f"stored bytes have {actual}; the object is damaged or was replaced, so its bytes "
                "are not used",
                key=key,
                uri=uri,
                expected=value,
                actual=actual,
            )
    return actual
