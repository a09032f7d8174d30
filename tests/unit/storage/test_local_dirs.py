"""Local storage under a directory that does not exist yet, as a fresh STRATA_DATA_DIR is."""

from __future__ import annotations

import asyncio
from pathlib import Path

from strata.storage.local import LocalStorage


def test_a_root_whose_parents_are_missing_is_created_on_the_first_write(tmp_path: Path) -> None:
    root = tmp_path / "not" / "there" / "checkpoints"
    storage = LocalStorage(str(root))
    written = asyncio.run(storage.write("job/step-000000000001/rank-00000.bin", b"state"))
    assert written.bytes == 5
    assert asyncio.run(storage.read("job/step-000000000001/rank-00000.bin")) == b"state"
