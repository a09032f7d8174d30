"""torchrun's default rendezvous id (`none`, all `accelerate launch` can give) is the job in
STRATA_JOB to Strata's backend, never one rendezvous shared by every job launched without an id."""

from __future__ import annotations

import pytest
from strata.config import Env
from strata.errors import ConfigError
from strata.torch.rendezvous import _check_run_id


def test_the_default_id_is_the_job_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(Env.JOB, "resnet-7")
    assert _check_run_id("none") == "resnet-7"
    assert _check_run_id("other-job") == "other-job"


def test_the_default_id_without_a_job_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(Env.JOB, raising=False)
    with pytest.raises(ConfigError, match="STRATA_JOB"):
        _check_run_id("none")
