"""The key rules every storage backend relies on: only id-like segments, nothing that escapes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from strata.errors import Forbidden, ValidationError
from strata.storage import LocalStorage, check_key, manifest_key, shard_key, step_prefix
from strata.storage._keys import valid_key

BAD_KEYS = [
    "",
    "/",
    "/etc/passwd",
    "/abs/key.bin",
    "..",
    "../escape.bin",
    "job/../../escape.bin",
    "job/..",
    "job/./shard.bin",
    ".",
    "job//shard.bin",
    "job/",
    "/job",
    "job\\..\\escape",
    "job/.hidden",
    "job/-dash-first",
    "job/sp ace",
    "jöb/shard.bin",
    "job/\u2024\u2024/x",  # one-dot leaders, which look like '..'
    "job/\uff53\uff48\uff41\uff52\uff44",  # fullwidth letters
    "job/shard.bin\x00",
    "job/shard\nname",
    "job/shard.bin\n",
    "job/" + "a" * 129,
    "~/shard.bin",
    "job/%2e%2e/x",
]


@pytest.mark.parametrize("key", BAD_KEYS)
def test_bad_keys_are_refused(key: str) -> None:
    with pytest.raises(ValidationError) as caught:
        valid_key(key)
    assert caught.value.field == "key"


@pytest.mark.parametrize("key", BAD_KEYS)
def test_local_backend_refuses_bad_keys_before_any_io(key: str, tmp_path: Path) -> None:
    root = tmp_path / "root"
    storage = LocalStorage(root)
    with pytest.raises(ValidationError):
        storage.path(key)
    assert not root.exists()


def test_a_trailing_newline_is_refused_by_the_key_rules_and_the_backends() -> None:
    # `$` alone would match before a final newline; the key rules match whole segments.
    with pytest.raises(ValidationError, match="not allowed"):
        check_key("job/shard.bin\n")
    with pytest.raises(ValidationError):
        valid_key("job/shard.bin\n")


@pytest.mark.parametrize(
    "key",
    ["job", "job/step-000000000001/rank-00000.bin", "a/b/c/d", "A9_.-x/y", "x" * 128],
)
def test_good_keys_pass(key: str) -> None:
    assert valid_key(key) == key


def test_key_formats() -> None:
    assert shard_key("job-1", 100, 3) == "job-1/step-000000000100/rank-00003.bin"
    assert manifest_key("job-1", 100) == "job-1/step-000000000100/MANIFEST.json"
    assert step_prefix("job-1", 100) == "job-1/step-000000000100"
    assert shard_key("j", 0, 0).startswith(step_prefix("j", 0) + "/")
    assert manifest_key("j", 7).startswith(step_prefix("j", 7) + "/")


def test_key_formats_sort_by_step_and_rank() -> None:
    keys = [shard_key("j", step, rank) for step in (1, 10, 2, 100) for rank in (10, 2, 1)]
    assert sorted(keys) == [
        shard_key("j", step, rank) for step in (1, 2, 10, 100) for rank in (1, 2, 10)
    ]


@pytest.mark.parametrize("job", ["../x", "", ".hidden", "x\n", "-x"])
def test_key_builders_refuse_bad_jobs(job: str) -> None:
    with pytest.raises(ValidationError):
        valid_key(shard_key(job, 1, 0))


def test_symlink_out_of_the_root_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "root"
    outside = tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    os.symlink(outside, root / "job")
    storage = LocalStorage(root)
    with pytest.raises(Forbidden, match="symbolic link"):
        storage.path("job/step-000000000001/rank-00000.bin")


def test_local_uri_is_a_file_url(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    assert storage.root_uri == tmp_path.resolve().as_uri()
    assert storage.uri("job/x.bin") == f"{tmp_path.resolve().as_uri()}/job/x.bin"


@given(st.text(max_size=40))
def test_any_accepted_key_stays_under_the_root(key: str) -> None:
    root = Path("/srv/strata-root")
    try:
        valid_key(key)
    except ValidationError:
        return
    path = LocalStorage(root).path(key)
    assert path.resolve().is_relative_to(root)
    assert ".." not in path.parts
