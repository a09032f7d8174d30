"""Logs are JSON lines off a terminal and carry the bound job/worker/step context."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import structlog
from strata.logs import bind, configure_logging, get_logger


@pytest.fixture(autouse=True)
def _clean_logging() -> Iterator[None]:
    structlog.contextvars.clear_contextvars()
    yield
    structlog.contextvars.clear_contextvars()
    structlog.reset_defaults()


def test_json_lines_carry_bound_context(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("json", "info")
    bind(job="resnet", worker="w-1", step=42)
    get_logger("test").info("checkpoint_saved", bytes=10)
    get_logger("test").debug("hidden")
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert record["event"] == "checkpoint_saved"
    assert (record["job"], record["worker"], record["step"], record["bytes"]) == (
        "resnet",
        "w-1",
        42,
        10,
    )
    assert record["level"] == "info"


def test_console_lines_show_the_context_prefix(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("console", "debug")
    bind(job="resnet", worker="w-1", rank=3, step=7)
    get_logger("test").info("barrier_released")
    err = capsys.readouterr().err
    assert "[resnet/w-1#3 - step 7] barrier_released" in err


def test_console_exceptions_are_rich_tracebacks(capsys: pytest.CaptureFixture[str]) -> None:
    # structlog itself is imported without rich (strata._imports); the console renderer is given
    # rich's tracebacks by configure_logging, with the frames' locals.
    configure_logging("console", "debug")
    step_of_the_failure = 7
    try:
        raise RuntimeError(f"shard {step_of_the_failure} unreadable")
    except RuntimeError:
        get_logger("test").exception("load_failed")
    err = capsys.readouterr().err
    assert "load_failed" in err
    assert "Traceback (most recent call last)" in err
    assert "RuntimeError: shard 7 unreadable" in err
    assert "step_of_the_failure = 7" in err  # rich shows locals; a plain traceback does not
