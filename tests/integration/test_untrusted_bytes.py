"""Nothing runs, and nothing of another job is deleted, on the say of bytes a worker can write.

Every worker may write the checkpoint store and its job's rendezvous state key, and anyone may
hand over an export file. Each attack here passes only when the code it plants never runs (it
would write a marker file), the victim's checkpoints are all still there and unchanged, and the
victim gets an error with a code (`checksum_mismatch`, `forbidden`, `too_large`, ...) instead
of a crash. Real processes throughout: nats-server, the registry and checkpoint services, an S3
server, `strata replay` as a command.
"""

from __future__ import annotations

import os
import pickle
import struct
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import strata
import torch
import torch.distributed.checkpoint as dcp
from strata._loop import LoopRunner
from strata.bus.server import NatsServer
from strata.config import Env, load_settings
from strata.errors import ChecksumMismatch, Forbidden, NotFound
from strata.events.models import DatasetRegistered, ShardPlanChanged
from strata.history import Record
from strata.storage import LocalStorage, manifest_key, shard_key
from strata.torch.dcp import Reader, Writer, load_metadata
from strata.torch.rendezvous import ForbiddenRendezvousState, JetStreamRendezvousBackend
from strata.torch.store import RendezvousBucket
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.elastic.rendezvous import RendezvousStateError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousSettings,
    RendezvousTimeout,
    _BackendRendezvousStateHolder,
)

from tests.s3 import S3Endpoint, moto_server  # noqa: F401
from tests.support import ServiceProcess, new_job, running_services, wait_until

pytestmark = pytest.mark.nats

RELAXED = {Env.HEARTBEAT_INTERVAL: "0.5", Env.HEARTBEAT_TIMEOUT: "10"}
_FOOTER = struct.Struct("<16sQQ32s")
_MAGIC = b"STRATADCP1\0\0\0\0\0\0"


class Payload:
    """Unpickled, it writes `marker`: the proof that bytes from storage ran as code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, (f"open({str(self.marker)!r}, 'w').write('ran')",))


class SystemPayload:
    """A pickle that imports `os` and calls `os.system` to write `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture
def stack(own_nats_server: NatsServer, tmp_path: Path) -> Iterator[tuple[str, ServiceProcess]]:
    with running_services(
        own_nats_server.url, tmp_path / "logs", ("registry", "checkpoint"), env=RELAXED
    ) as started:
        yield own_nats_server.url, started[1]


def sample_state() -> dict[str, Any]:
    generator = torch.Generator().manual_seed(7)
    return {"w": torch.randn(256, 64, generator=generator), "step": 40, "note": {"lr": 0.1}}


def blank(state: dict[str, Any]) -> dict[str, Any]:
    return {"w": torch.zeros_like(state["w"]), "step": -1, "note": {"lr": -1.0}}


def snapshot(root: Path) -> dict[str, bytes]:
    """Every regular file under `root`, by relative path: what the victim must keep."""
    return {
        str(path.relative_to(root)): path.read_bytes()
        for path in sorted(root.rglob("*"))
        if path.is_file() and not path.is_symlink()
    }


def test_a_forged_dcp_shard_with_a_valid_inner_digest_is_refused_before_unpickling(
    stack: tuple[str, ServiceProcess], tmp_path: Path
) -> None:
    url, _ = stack
    root = tmp_path / "ckpt"
    marker = tmp_path / "marker"
    with strata.Worker(new_job("victim"), url) as worker:
        manager = strata.CheckpointManager(worker, str(root))
        state = sample_state()
        dcp.save(state, storage_writer=Writer(manager, step=1), no_dist=True)
        shard = manager.latest().shards[0]  # type: ignore[union-attr]
        file = root / shard.key
        # The attacker rewrites the shard: same size, its own pickle where the tensors were,
        # a footer pointing at it with that pickle's correct digest.
        original = file.read_bytes()
        evil = pickle.dumps(Payload(marker))
        digest = xxh128_hex(evil)
        forged = bytearray(original)
        forged[0 : len(evil)] = evil
        forged[-_FOOTER.size :] = _FOOTER.pack(_MAGIC, 0, len(evil), digest.encode())
        assert len(forged) == len(original)
        file.write_bytes(bytes(forged))
        with pytest.raises(ChecksumMismatch, match="recorded at commit") as caught:
            Reader(manager, step=1).read_metadata()
        assert caught.value.code == "checksum_mismatch"
        with pytest.raises(CheckpointException, match=r"\[checksum_mismatch\]"):
            dcp.load(blank(state), storage_reader=Reader(manager, step=1), no_dist=True)
        assert not marker.exists()
        # Put back, the same checkpoint loads whole: the refusal was about the bytes.
        file.write_bytes(original)
        loaded = blank(state)
        dcp.load(loaded, storage_reader=Reader(manager, step=1), no_dist=True)
        assert torch.equal(loaded["w"], state["w"])
        assert loaded["step"] == 40
        assert loaded["note"] == {"lr": 0.1}


def xxh128_hex(data: bytes) -> str:
    import xxhash

    return xxhash.xxh3_128_hexdigest(data)


def test_metadata_or_items_that_pass_every_checksum_still_cannot_run_code(
    stack: tuple[str, ServiceProcess], tmp_path: Path
) -> None:
    url, _ = stack
    marker = tmp_path / "marker"
    # DCP metadata: only DCP's own types are ever looked up.
    with pytest.raises(Forbidden, match="not one of DCP's metadata types"):
        load_metadata(pickle.dumps(Payload(marker)))
    with pytest.raises(Forbidden, match=r"posix\.system|os\.system"):
        load_metadata(pickle.dumps(SystemPayload(marker)))
    # A non-tensor item the job saved itself (so every checksum matches) whose unpickling
    # would run code: DCP's planner would torch.load it with weights_only=False.
    with strata.Worker(new_job("items"), url) as worker:
        manager = strata.CheckpointManager(worker, str(tmp_path / "ckpt"))
        state = {"w": torch.ones(4), "hook": Payload(marker)}
        dcp.save(state, storage_writer=Writer(manager, step=1), no_dist=True)
        target = {"w": torch.zeros(4), "hook": None}
        with pytest.raises(CheckpointException, match=r"\[forbidden\] DCP item 'hook'"):
            dcp.load(target, storage_reader=Reader(manager, step=1), no_dist=True)
        assert not marker.exists()
        # load_state reads with weights_only=True: the same object is refused there too.
        manager.save_state({"hook": Payload(marker)}, step=2)
        manager.wait()
        manager.wait_committed(2)
        with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
            manager.load_state(step=2)
        assert not marker.exists()


@pytest.fixture
def runner() -> Iterator[LoopRunner]:
    loop = LoopRunner("test-untrusted")
    yield loop
    loop.close()


def test_a_pickle_in_the_rendezvous_state_key_is_refused_not_run(
    nats_url: str, runner: LoopRunner, tmp_path: Path
) -> None:
    marker = tmp_path / "marker"
    job, other = new_job("rdzv"), new_job("rdzv")
    # Each job's keys live in a bucket of its own (its quota).
    bucket = runner.run(RendezvousBucket.open([nats_url], load_settings(), job))
    other_bucket = runner.run(RendezvousBucket.open([nats_url], load_settings(), other))
    try:
        victim = JetStreamRendezvousBackend(bucket, runner, job)
        attacker = JetStreamRendezvousBackend(bucket, runner, job)
        # A worker of the job writes a pickle that imports os into the job's state key.
        assert attacker.set_state(pickle.dumps(SystemPayload(marker))) is not None
        with pytest.raises(ForbiddenRendezvousState, match=r"posix\.system|os\.system") as caught:
            victim.get_state()
        assert caught.value.code == "forbidden"
        assert isinstance(caught.value, RendezvousStateError)
        # torch's own state holder (what DynamicRendezvousHandler syncs through) sees the error.
        settings = RendezvousSettings(
            job, 1, 2, RendezvousTimeout(), timedelta(seconds=5), keep_alive_max_attempt=3
        )
        with pytest.raises(RendezvousStateError, match=r"\[forbidden\]"):
            _BackendRendezvousStateHolder(victim, settings).sync()
        # A state that is not well formed is refused as well, and so is a write that finds
        # such a state in place (the backend answers with the current state).
        malformed = JetStreamRendezvousBackend(other_bucket, runner, other)
        malformed.set_state(pickle.dumps({"round": 1}))
        with pytest.raises(ForbiddenRendezvousState, match="not a well-formed"):
            JetStreamRendezvousBackend(other_bucket, runner, other).get_state()
        with pytest.raises(ForbiddenRendezvousState):
            victim.set_state(pickle.dumps(SystemPayload(marker)))
        assert not marker.exists()
    finally:
        runner.run(other_bucket.close())
        runner.run(bucket.close())


def save_victim(url: str, root: Path, step: int) -> tuple[strata.Worker, str, bytes]:
    victim = strata.Worker(new_job("victim"), url).start()
    manager = strata.CheckpointManager(victim, str(root))
    payload = b"the victim's committed state " * 1000
    manager.save(payload, step=step)
    manager.wait()
    manager.wait_committed(step)
    return victim, victim.job, payload


def test_a_linked_job_directory_makes_the_service_delete_nothing_of_the_victim(
    stack: tuple[str, ServiceProcess], tmp_path: Path
) -> None:
    url, checkpoint_service = stack
    root = tmp_path / "ckpt"
    victim, victim_job, payload = save_victim(url, root, 40)
    try:
        before = snapshot(root)
        attacker_job = new_job("attacker")
        os.symlink(root / victim_job, root / attacker_job)
        attacker = strata.Worker(attacker_job, url).start()
        manager = strata.CheckpointManager(attacker, str(root))
        # Opens step 40 under its own job, writes nothing, leaves: the step is aborted, and its
        # files (as the service sees them: <root>/<attacker>/step-40) removed.
        manager._runner.run(manager.aio.declare(40, 0))
        attacker.stop()
        wait_until(
            lambda: "symbolic link" in checkpoint_service.log_file.read_text(errors="replace"),
            30,
            "the service to refuse the cleanup through the link",
        )
        assert snapshot(root) == before
        assert strata.CheckpointManager(victim, str(root)).load(step=40) == payload
    finally:
        victim.stop()


@pytest.mark.parametrize("level", ["job", "step", "file"])
def test_a_link_at_any_level_of_the_tree_is_never_followed(
    level: str, tmp_path: Path, runner: LoopRunner
) -> None:
    root = tmp_path / "ckpt"
    storage = LocalStorage(root)
    victim_key = shard_key("victim", 40, 0)
    runner.run(storage.write(victim_key, b"victim bytes"))
    runner.run(storage.write(manifest_key("victim", 40), b"{}"))
    before = snapshot(root)
    own = shard_key("attacker", 40, 0)
    if level == "job":
        os.symlink(root / "victim", root / "attacker")
    elif level == "step":
        (root / "attacker").mkdir()
        os.symlink(root / "victim" / "step-000000000040", root / "attacker" / "step-000000000040")
    else:
        (root / "attacker" / "step-000000000040").mkdir(parents=True)
        os.symlink(root / victim_key, root / own)
    with pytest.raises(Forbidden, match="symbolic link"):
        runner.run(storage.read(own))
    with pytest.raises(Forbidden, match="symbolic link"):
        runner.run(storage.read_range(own, 0, 4))
    assert runner.run(storage.size(own)) is None
    assert runner.run(storage.exists(own)) is False
    if level == "job":
        with pytest.raises(Forbidden, match="symbolic link"):
            runner.run(storage.list("attacker"))
    else:
        assert runner.run(storage.list("attacker")) == []  # links are no keys
    if level == "file":
        # The link itself is the attacker's to replace or remove; what it points at is not.
        runner.run(storage.write(own, b"attacker bytes"))
        assert runner.run(storage.read(own)) == b"attacker bytes"
        runner.run(storage.delete(own))
        assert runner.run(storage.delete_prefix("attacker/step-000000000040")) == 0
        assert not (root / "attacker" / "step-000000000040").exists()
    else:
        with pytest.raises(Forbidden, match="symbolic link"):
            runner.run(storage.write(own, b"attacker bytes"))
        with pytest.raises(Forbidden, match="symbolic link"):
            runner.run(storage.delete_prefix("attacker/step-000000000040"))
        with pytest.raises(Forbidden, match="symbolic link"):
            runner.run(storage.delete(own))
    assert snapshot(root) == before
    assert runner.run(storage.read(victim_key)) == b"victim bytes"


def test_on_s3_a_manifest_naming_another_jobs_key_is_refused(
    moto_server: S3Endpoint,  # noqa: F811
    own_nats_server: NatsServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bucket = moto_server.new_bucket()
    env = {
        Env.S3_ENDPOINT_URL: moto_server.url,
        Env.AWS_REGION: moto_server.region,
        "AWS_ACCESS_KEY_ID": moto_server.access_key,
        "AWS_SECRET_ACCESS_KEY": moto_server.secret_key,
        **RELAXED,
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    location = f"s3://{bucket}/runs"
    logs = tmp_path / "logs"
    registry = ServiceProcess("registry", own_nats_server.url, logs, env=env).start()
    checkpoint = ServiceProcess("checkpoint", own_nats_server.url, logs, env=env).start()
    try:
        victim = strata.Worker(new_job("victim"), own_nats_server.url).start()
        attacker = strata.Worker(new_job("attacker"), own_nats_server.url).start()
        try:
            secret = b"the victim's weights"
            victims = strata.CheckpointManager(victim, location)
            victims.save(secret, step=5)
            victims.wait()
            manifest = victims.wait_committed(5) and victims.latest()
            assert manifest is not None
            # With the service down, a manager reads manifests from storage, which any
            # worker can write: the attacker's names the victim's shard (checksum and all).
            checkpoint.stop()
            forged = manifest.model_copy(update={"job": attacker.job})
            client = moto_server.client()
            client.put_object(
                Bucket=bucket,
                Key=f"runs/{manifest_key(attacker.job, 5)}",
                Body=forged.model_dump_json().encode(),
            )
            attackers = strata.CheckpointManager(attacker, location)
            with pytest.raises(Forbidden, match="outside this job's own prefix") as caught:
                attackers.load(step=5)
            assert caught.value.code == "forbidden"
            listed = client.list_objects_v2(Bucket=bucket, Prefix=f"runs/{victim.job}/")
            assert len(listed["Contents"]) == 2  # the victim's shard and manifest, untouched
            assert victims.load(step=5) == secret  # from storage too, its own prefix
            attackers.close()
            victims.close()
        finally:
            attacker.stop()
            victim.stop()
    finally:
        checkpoint.stop()
        registry.stop()


def replay_file(path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "strata", "replay", "--file", str(path), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_a_deeply_nested_export_line_is_a_one_line_error(tmp_path: Path) -> None:
    deep = tmp_path / "deep.jsonl"
    nested = "[" * 100_000 + "]" * 100_000
    deep.write_text('{"seq":1,"stored_ns":1,"event":' + nested + "}\n")
    for extra in ((), ("--state",)):
        done = replay_file(deep, *extra)
        assert done.returncode == 1
        assert "Traceback" not in done.stderr
        assert "RecursionError" not in done.stderr
        lines = [line for line in (done.stderr + done.stdout).splitlines() if line.strip()]
        assert len(lines) == 1, lines
        assert "[malformed] line 1 of" in lines[0]


@pytest.mark.slow  # builds plans up to the bounds: seconds of CPU
def test_a_small_export_asking_for_huge_plans_stops_within_the_bounds(tmp_path: Path) -> None:
    job = new_job("heavy")
    records = [
        DatasetRegistered(
            job=job,
            source="sharding",
            dataset_id=f"d{d}",
            total_samples=1_000_000,
            shard_size=1,
            shuffle=True,
            seed=d,
        )
        for d in range(4)
    ] + [
        ShardPlanChanged(
            job=job,
            source="sharding",
            dataset_id=f"d{r % 4}",
            epoch=0,
            plan_version=r + 1,
            members=[f"w{i}" for i in range(r % 7 + 1)],
            membership_epoch=r + 1,
            reason="join",
        )
        for r in range(80)
    ]
    heavy = tmp_path / "heavy.jsonl"
    heavy.write_text(
        "".join(Record(n, n, event).to_json() + "\n" for n, event in enumerate(records, 1))
    )
    assert heavy.stat().st_size < 40_000
    done = replay_file(heavy, "--state")
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert "[too_large]" in lines[0]
    assert "8,000,000 shards" in lines[0]
    # The bound is a setting: with room for every plan it is the time bound that stops it.
    done = replay_file(heavy, "--state", "--max-planned-shards", "100000000", "--timeout", "1")
    assert done.returncode == 1
    assert "[deadline_exceeded]" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_committed_step_is_not_found_only_when_it_is_gone(tmp_path: Path) -> None:
    # The refusals above are about links and forged bytes; a plain missing key is NotFound.
    storage = LocalStorage(tmp_path)
    runner = LoopRunner("test-untrusted-missing")
    try:
        with pytest.raises(NotFound):
            runner.run(storage.read(shard_key("nobody", 1, 0)))
    finally:
        runner.close()
