"""`strata demo --kill-one --no-keep`, as CI runs it: a real PyTorch DDP job on the whole stack
loses a worker midway, recovers from the latest committed checkpoint with a replacement, finishes
with one model (the same parameters on every rank, every sample once per epoch), and exits 0."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from strata.config import Env

pytestmark = [pytest.mark.nats, pytest.mark.slow]

DEMO_TIMEOUT_S = 400


def test_demo_with_a_killed_worker_recovers_finishes_and_exits_0(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    env = {**os.environ, Env.LOG_FORMAT: "json", "COLUMNS": "200"}
    finished = subprocess.run(
        [
            sys.executable,
            "-m",
            "strata",
            "demo",
            "--workers",
            "3",
            "--epochs",
            "2",
            "--kill-one",
            "--no-keep",
            "--nats-port",
            "0",
            "--http-port",
            "0",
            "--data-dir",
            str(data_dir),
        ],
        capture_output=True,
        text=True,
        timeout=DEMO_TIMEOUT_S,
        env=env,
    )
    out = finished.stdout + finished.stderr
    assert finished.returncode == 0, out[-6000:]
    assert re.search(r"job demo-\S+: finished", out), out[-3000:]
    assert re.search(r"replacement worker \d", out), out[-3000:]
    assert re.search(r"│\s*\d+\s*│\s*\d+\s*│.*│\s*killed\s*│", out), out[-3000:]
    assert len(re.findall(r"│\s*done\s*│", out)) == 3, out[-3000:]
    recovered = re.search(
        r"time to recover \(kill -> first round past the checkpoint\): ([\d.]+)s", out
    )
    assert recovered is not None, out[-3000:]
    assert float(recovered.group(1)) < 120
    assert "latest committed checkpoint: round" in out
    # One model, trained by every rank with DDP: one loss, the same parameters everywhere.
    model = re.search(
        r"model \(DDP over gloo, 3 ranks\): final loss ([\d.]+) .*parameters identical on every "
        r"rank: (\w+) .*every sample trained exactly once per epoch: (\w+)",
        out.replace("\n", " "),
    )
    assert model is not None, out[-3000:]
    assert float(model.group(1)) < 0.69, "the model learned nothing (chance is ln 2)"
    assert model.group(2) == "yes", out[-3000:]
    assert model.group(3) == "yes", out[-3000:]
    dashboard = re.search(r"dashboard http://127\.0\.0\.1:(\d+)/", out)
    assert dashboard is not None, out[:2000]
    assert int(dashboard.group(1)) > 0

    # What the summary claims is on disk: committed steps, each with one shard per rank.
    steps = sorted((data_dir / "checkpoints").glob("demo-*/step-*"))
    assert steps, "no committed checkpoint on disk"
    for step in steps:
        assert (step / "MANIFEST.json").is_file()
        assert sorted(f.name for f in step.glob("rank-*")) == [
            "rank-00000.bin",
            "rank-00001.bin",
            "rank-00002.bin",
        ]
