"""Every public method and property of the SDK's classes says what it does."""

from __future__ import annotations

import inspect

import pytest
import strata
import strata.aio
from strata.torch import ShardSampler

PUBLIC = [
    strata.Worker,
    strata.aio.Worker,
    strata.CheckpointManager,
    strata.aio.CheckpointManager,
    strata.DatasetRegistry,
    strata.aio.DatasetRegistry,
    ShardSampler,
]


@pytest.mark.parametrize("cls", PUBLIC, ids=lambda cls: f"{cls.__module__}.{cls.__qualname__}")
def test_every_public_member_has_a_docstring(cls: type) -> None:
    missing = []
    for name, member in vars(cls).items():
        if name.startswith("_"):
            continue
        target = member.fget if isinstance(member, property) else member
        if callable(target) and not inspect.getdoc(target):
            missing.append(name)
    assert not missing, f"{cls.__qualname__} lacks docstrings on {missing}"
    assert inspect.getdoc(cls)
