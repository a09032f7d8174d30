"""The allow-list unpicklers: what torch and DCP write reads back the same; anything that names
another global is refused before it is called (a marker file would prove otherwise)."""

from __future__ import annotations

import os
import pickle
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from strata.errors import Forbidden, StrataError
from strata.torch.dcp import ItemLocation, load_metadata
from strata.torch.rendezvous import ForbiddenRendezvousState, checked_state, validated_state
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState


class Marker:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.path}",))


def rendezvous_state() -> _RendezvousState:
    state = _RendezvousState()
    first, second = _NodeDesc("host-a", 10, 0), _NodeDesc("host-b", 11, 1)
    state.round = 3
    state.complete = True
    state.deadline = datetime(2026, 11, 27, 12, 0)
    state.participants = {first: 0, second: 1}
    state.wait_list = {second}
    state.redundancy_list = {first}
    state.last_heartbeats = {first: datetime.now(UTC), second: datetime.now(UTC) - timedelta(1)}
    return state


def test_a_rendezvous_state_torch_wrote_reads_back_equal() -> None:
    state = rendezvous_state()
    checked = checked_state(pickle.dumps(state))
    assert vars(checked) == vars(state)
    assert vars(pickle.loads(validated_state(pickle.dumps(state)))) == vars(state)


@pytest.mark.parametrize(
    "payload",
    [
        lambda marker: Marker(marker),
        lambda marker: {"round": 1},
        lambda marker: [rendezvous_state(), Marker(marker)],
        lambda marker: b"not a pickle",
    ],
)
def test_anything_else_in_the_state_key_is_forbidden(payload: Any, tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    value = payload(marker)
    raw = value if isinstance(value, bytes) else pickle.dumps(value)
    with pytest.raises(ForbiddenRendezvousState) as caught:
        checked_state(raw)
    assert caught.value.code == "forbidden"
    assert not marker.exists()


def test_a_state_with_a_field_of_the_wrong_type_is_forbidden() -> None:
    state = rendezvous_state()
    state.participants = {_NodeDesc("host", 1, 0): "zero"}  # type: ignore[dict-item]
    with pytest.raises(ForbiddenRendezvousState, match="not a well-formed"):
        checked_state(pickle.dumps(state))


def dcp_metadata() -> Metadata:
    state = {"w": torch.ones(4, 3), "h": torch.ones(2).bfloat16(), "step": 3, "opt": {"lr": 0.1}}
    planner = DefaultSavePlanner()
    planner.set_up_planner(state, None, True)
    plans, metadata = planner.create_global_plan([planner.create_local_plan()])
    metadata.storage_data = {
        item.index: ItemLocation(0, 64 * n, 48, "xxh128:" + "0" * 32, torch.float32, (4, 3))
        for n, item in enumerate(plans[0].items)
    }
    return metadata


def test_dcp_metadata_reads_back_equal() -> None:
    metadata = dcp_metadata()
    assert load_metadata(pickle.dumps(metadata)) == metadata


def test_dcp_metadata_naming_another_global_is_forbidden(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    with pytest.raises(Forbidden, match="system"):
        load_metadata(pickle.dumps(Marker(marker)))
    metadata = dcp_metadata()
    metadata.planner_data = Marker(marker)
    with pytest.raises(Forbidden):
        load_metadata(pickle.dumps(metadata))
    assert not marker.exists()


def test_dcp_metadata_with_a_location_that_is_not_strata_is_refused() -> None:
    metadata = dcp_metadata()
    index = next(iter(metadata.storage_data))
    metadata.storage_data[index] = ItemLocation(0, -5, 48, "xxh128:" + "0" * 32)
    with pytest.raises(StrataError, match="not Strata's") as caught:
        load_metadata(pickle.dumps(metadata))
    assert caught.value.code == "dcp_format"
    with pytest.raises(StrataError, match="cannot be read") as caught:
        load_metadata(b"\x80\x05truncated")
    assert caught.value.code == "dcp_format"
