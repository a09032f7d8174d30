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
    # Members inherited from the SDK's own layers count too (`strata.aio.Worker` is built on them).
    layers = [k for k in cls.__mro__ if k.__module__.startswith("strata")]
    members = {name: member for k in reversed(layers) for name, member in vars(k).items()}
    for name, member in members.items():
        if name.startswith("_"):
            continue
        target = member.fget if isinstance(member, property) else member
        if callable(target) and not inspect.getdoc(target):
            missing.append(name)
    assert not missing, f"{cls.__qualname__} lacks docstrings on {missing}"
    assert inspect.getdoc(cls)
