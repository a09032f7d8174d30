"""The DCP shard layout of `strata.torch.dcp`, without storage or services: items packed by the
Writer's code come back through the Reader's, reads are grouped as intended, the footer says
where the metadata is."""

from __future__ import annotations

from typing import Any

import torch
from strata.torch.dcp import (
    _FOOTER,
    _RESERVE,
    ItemLocation,
    _apply,
    _Buffers,
    _footer,
    _pack,
    _runs,
    _Shard,
)
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner


def state() -> dict[str, Any]:
    generator = torch.Generator().manual_seed(3)
    return {
        "w": torch.randn(10, 7, generator=generator),
        "view": torch.arange(40, dtype=torch.int16).reshape(5, 8)[:, 2:5],  # not contiguous
        "b16": torch.randn(9, generator=generator).to(torch.bfloat16),
        "empty": torch.empty(0, 4),
        "meta": {"epoch": 4, "name": "run"},
    }


def packed(source: dict[str, Any], staged: _Shard | None = None) -> tuple[_Shard, Any, list[Any]]:
    planner = DefaultSavePlanner()
    planner.set_up_planner(source, None, True)
    plans, metadata = planner.create_global_plan([planner.create_local_plan()])
    plan = planner.finish_plan(plans[0])
    shard, results = _pack(plan.items, planner, 0, staged, _Buffers())
    metadata.storage_data = {result.index: result.storage_data for result in results}
    return shard, metadata, results


def load(shard: _Shard, metadata: Any) -> dict[str, Any]:
    target = {
        key: torch.zeros_like(value)
        if isinstance(value, torch.Tensor)
        else {"epoch": -1, "name": ""}
        for key, value in state().items()
    }
    planner = DefaultLoadPlanner()
    planner.set_up_planner(target, metadata, True)
    plan = planner.finish_plan(planner.create_global_plan([planner.create_local_plan()])[0])
    data = bytes(shard.blob[: shard.end])
    for item in plan.items:
        location = metadata.storage_data[item.storage_index]
        _apply(planner, item, location, data, location.offset)
    return target


def test_packed_items_load_back_exactly() -> None:
    shard, metadata, results = packed(state())
    loaded = load(shard, metadata)
    for key, value in state().items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(loaded[key], value), key
        else:
            assert loaded[key] == value
    offsets = [result.storage_data.offset for result in results]
    assert all(offset % 64 == 0 for offset in offsets), "items start at aligned offsets"


def test_staged_tensors_are_written_where_they_were_staged() -> None:
    source = state()
    staged = _Shard(bytearray(_RESERVE + 4096))
    copies = {key: staged.put(value)[1] for key, value in source.items() if key != "meta"}
    staged.staged_end = staged.end
    shard, metadata, results = packed({**copies, "meta": source["meta"]}, staged)
    assert shard is staged, "the staged buffer is the shard: no second copy"
    w = next(r.storage_data for r in results if r.index.fqn == "w")
    assert w.offset == 0, "the first staged tensor stays at the start"
    assert torch.equal(load(shard, metadata)["w"], source["w"])


def location(rank: int, offset: int, length: int) -> ItemLocation:
    return ItemLocation(rank, offset, length, "xxh128:" + "0" * 32)


def test_reads_group_adjacent_items_of_one_shard() -> None:
    items: list[Any] = [
        (object(), location(1, 0, 100)),
        (object(), location(0, 128, 64)),
        (object(), location(0, 0, 100)),
        (object(), location(0, 1 << 20, 10)),  # far away: a read of its own
    ]
    runs = list(_runs(items))
    assert [[loc.offset for _, loc in run] for run in runs] == [[0, 128], [1 << 20], [0]]
    assert [run[0][1].rank for run in runs] == [0, 0, 1]


def test_footer_says_where_the_metadata_is() -> None:
    encoded = b"metadata bytes"
    magic, offset, length, digest = _FOOTER.unpack(_footer(4096, encoded))
    assert magic.startswith(b"STRATADCP1")
    assert (offset, length) == (4096, len(encoded))
    assert len(digest) == 32
    assert _FOOTER.unpack(_footer(64, b""))[2] == 0
