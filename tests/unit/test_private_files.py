"""Secrets are written readable by their owner only, from the first byte, whatever was there."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from strata._files import write_private
from strata.security import api_token, generate_credentials, load_credentials, save_credentials


@pytest.fixture
def open_umask() -> Iterator[None]:
    # The most permissive umask: a mode set after the fact would show here.
    previous = os.umask(0)
    try:
        yield
    finally:
        os.umask(previous)


@pytest.mark.usefixtures("open_umask")
def test_a_new_file_is_private(tmp_path: Path) -> None:
    path = tmp_path / "deeper" / "secret"
    write_private(path, "s3cret")
    assert path.read_text() == "s3cret"
    assert path.stat().st_mode & 0o777 == 0o600


@pytest.mark.usefixtures("open_umask")
def test_a_readable_file_already_there_is_replaced_not_reopened(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_text("old")
    path.chmod(0o644)
    before = path.stat().st_ino

    write_private(path, "new")

    assert path.read_text() == "new"
    assert path.stat().st_mode & 0o777 == 0o600
    # A new file took its place: the old, readable one was never opened for the secret.
    assert path.stat().st_ino != before
    assert [p.name for p in tmp_path.iterdir()] == ["secret"]


@pytest.mark.usefixtures("open_umask")
def test_credentials_and_the_api_token_are_private(tmp_path: Path) -> None:
    credentials = generate_credentials("job", ["worker-0"])
    save_credentials(tmp_path / "credentials.json", credentials)
    assert (tmp_path / "credentials.json").stat().st_mode & 0o777 == 0o600
    assert load_credentials(tmp_path / "credentials.json") == credentials

    token = api_token(tmp_path / "api-token")
    assert len(token) >= 32
    assert (tmp_path / "api-token").stat().st_mode & 0o777 == 0o600
    assert api_token(tmp_path / "api-token") == token  # kept across restarts
