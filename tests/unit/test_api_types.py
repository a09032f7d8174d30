"""The dashboard's API types are generated from the gateway's OpenAPI document, and kept so.

`dashboard/src/api/types.ts` is what `scripts/gen_api_types.py` makes of the document the gateway
serves at `/openapi.json`; a change to the read model's documents (`readmodel.views`) or the
gateway's answers that is not regenerated fails here (and in `make schemas-check`).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]


gen = load_script("gen_api_types")


def test_the_committed_types_are_what_the_openapi_document_generates() -> None:
    text = gen.render(gen.openapi_document())
    assert (ROOT / "dashboard" / "src" / "api" / "types.ts").read_text(encoding="utf-8") == text, (
        "dashboard/src/api/types.ts is stale: run scripts/gen_api_types.py"
    )


def test_every_document_the_dashboard_reads_has_an_interface() -> None:
    text = gen.render(gen.openapi_document())
    for name in ("Dashboard", "WorkerView", "JobList", "EventPage", "Metrics", "RecentEvent"):
        assert f"export interface {name} {{" in text
    assert 'export const WORKER_VIEW_STATUS = ["idle", "loading", "training",' in text
    assert "HTTPValidationError" not in text  # only successful answers are the dashboard's


def test_check_fails_on_a_stale_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stale = tmp_path / "types.ts"
    stale.write_text("export interface Dashboard {}\n", encoding="utf-8")
    assert gen.main(["--check", "--out", str(stale)]) == 1
    assert "is stale" in capsys.readouterr().err
    assert gen.main(["--out", str(stale)]) == 0
    assert gen.main(["--check", "--out", str(stale)]) == 0
