"""The SDK behaves like a library inside someone else's training script.

It leaves the program's logging alone, a `with strata.Worker(...)` block does not end before its
checkpoint saves are durable (or says why they are not), and the seeds' calls without a worker
use the process's implicit worker, built from the environment as torchrun sets it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from strata.config import Env

from tests.support import new_job, running_services


@pytest.fixture(scope="module")
def stack(nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log_dir = tmp_path_factory.mktemp("sdk-library-logs")
    with running_services(nats_url, log_dir, ("registry", "sharding", "checkpoint")):
        yield nats_url


def run_script(
    code: str, nats_url: str, cwd: Path, extra_env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in (Env.LOG_FORMAT, "RANK", "WORLD_SIZE", Env.RANK)
    }
    env.update({Env.NATS_URL: nats_url, Env.JOB: new_job("lib"), **(extra_env or {})})
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_programs_logging_set_up_is_left_alone(stack: str, tmp_path: Path) -> None:
    result = run_script(
        """
        import logging
        logging.basicConfig(filename="train.log", level=logging.INFO, format="%(name)s %(message)s")
        root_handlers = list(logging.getLogger().handlers)
        logging.getLogger("train").info("before the worker")
        import strata
        with strata.Worker(worker_id="logger") as worker:
            logging.getLogger("train").info("inside the block")
        logging.getLogger("train").info("after the block")
        assert logging.getLogger().handlers == root_handlers, logging.getLogger().handlers
        """,
        stack,
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    lines = (tmp_path / "train.log").read_text().splitlines()
    assert [line for line in lines if line.startswith("train ")] == [
        "train before the worker",
        "train inside the block",
        "train after the block",
    ]
    # The SDK's own lines reach the program's handlers too, as plain `event key=value` text.
    assert any(line.startswith("strata.worker event=worker_registered") for line in lines), lines
    assert result.stdout == "", "the SDK printed on the program's stdout"


def test_leaving_a_with_block_waits_for_its_checkpoint_saves(stack: str, tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    result = run_script(
        f"""
        import strata
        with strata.Worker(worker_id="saver") as worker:
            ckpt = strata.CheckpointManager(worker, path={str(root)!r}, keep_count=5)
            ckpt.save(b"x" * 50_000_000, step=1)
        # No wait() in the block: leaving it waited for the save to be durable and acked.
        """,
        stack,
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    manifests = list(root.glob("*/step-000000000001/MANIFEST.json"))
    assert len(manifests) == 1, list(root.rglob("*"))


def test_a_save_that_cannot_finish_is_raised_when_the_block_ends(
    stack: str, tmp_path: Path
) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the checkpoint directory should be")
    result = run_script(
        f"""
        import strata
        try:
            with strata.Worker(worker_id="doomed") as worker:
                ckpt = strata.CheckpointManager(worker, path={str(blocker / "ckpt")!r})
                ckpt.save(b"data", step=1)
        except strata.StrataError as exc:
            print("raised", exc.code)
        else:
            print("nothing raised")
        """,
        stack,
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["raised", "storage_error"], result.stdout + result.stderr


def test_the_seeds_calls_without_a_worker_use_the_implicit_one(stack: str, tmp_path: Path) -> None:
    root = tmp_path / "models"
    result = run_script(
        f"""
        import strata
        ckpt = strata.CheckpointManager(path={str(root)!r}, keep_count=5)
        reg = strata.DatasetRegistry()
        reg.register_dataset("points", total_samples=100, shard_size=10, shuffle=True, seed=1)
        worker = strata.default_worker()
        assert reg.get_shard_for_worker("points", worker.id, epoch=0)
        ckpt.save(b"model state bytes", step=5000, epoch=2)
        ckpt.wait_committed(5000)
        print(worker.id, worker.rank, ckpt.latest().step, ckpt.load())
        """,
        stack,
        tmp_path,
        # As torchrun sets them for the process of rank 0 of a world of 1.
        {"RANK": "0", "WORLD_SIZE": "1"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["rank-0", "0", "5000", "b'model", "state", "bytes'"]


def test_under_a_launcher_the_programs_worker_is_the_implicit_one(
    stack: str, tmp_path: Path
) -> None:
    """A worker the program built under torchrun has torch's rank and id; the implicit worker
    is that one, not a second registration taking the id from it."""
    result = run_script(
        """
        import os
        import strata
        with strata.Worker(job=os.environ["STRATA_JOB"]) as worker:
            print(worker.id, worker.rank, strata.default_worker() is worker, worker.superseded)
        """,
        stack,
        tmp_path,
        {"RANK": "1", "WORLD_SIZE": "2"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["rank-1", "1", "True", "False"]


def test_a_path_passed_where_the_worker_goes_is_a_clear_error(stack: str, tmp_path: Path) -> None:
    result = run_script(
        """
        import strata
        try:
            strata.CheckpointManager("s3://my-bucket/models")
        except strata.ValidationError as exc:
            print(exc.message)
        """,
        stack,
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert "pass path=... by name" in result.stdout
