"""The demo worker's `--pg-master HOST:PORT`: parsed, or refused with a clear message."""

from __future__ import annotations

import pytest
from strata.demo import worker

REQUIRED = ["--job", "j", "--nats-url", "nats://127.0.0.1:4222", "--checkpoints", "/tmp/c"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "strata-worker-0.strata-worker.ml.svc:29500",
            ("strata-worker-0.strata-worker.ml.svc", 29500),
        ),
        ("127.0.0.1:1", ("127.0.0.1", 1)),
        ("[::1]:65535", ("::1", 65535)),
    ],
)
def test_pg_master_is_a_host_and_a_port(text: str, expected: tuple[str, int]) -> None:
    assert worker.host_port(text) == expected


@pytest.mark.parametrize(
    "text", ["strata-worker-0", ":29500", "host:", "host:0", "host:70000", "h:p"]
)
def test_a_bad_pg_master_is_refused_before_anything_starts(
    text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        worker.main([*REQUIRED, "--world-size", "2", f"--pg-master={text}"])
    assert exit_.value.code == 2
    assert f"argument --pg-master: expected HOST:PORT, got {text!r}" in capsys.readouterr().err
