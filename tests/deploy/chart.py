"""Rendering the Helm chart offline: `helm template` and the objects it produces."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "charts" / "strata"
RELEASE = "strata"
NAMESPACE = "ml-training"


@dataclass(frozen=True)
class Rendered:
    """One `helm template` run: the objects, and lookups by kind and name."""

    objects: list[dict[str, Any]]

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def get(self, kind: str, name: str) -> dict[str, Any]:
        for o in self.of_kind(kind):
            if o["metadata"]["name"] == name:
                return o
        names = [o["metadata"]["name"] for o in self.of_kind(kind)]
        raise KeyError(f"no {kind} {name!r} rendered (there are: {names})")

    def workloads(self) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] in ("Deployment", "StatefulSet", "Job")]


Render = Callable[..., Rendered]


def helm_template(
    helm: Path, settings: Sequence[str] = (), chart: Path = CHART, extra: Sequence[str] = ()
) -> subprocess.CompletedProcess[str]:
    command = [str(helm), "template", RELEASE, str(chart), "--namespace", NAMESPACE]
    for setting in settings:
        command += ["--set", setting]
    return subprocess.run(
        [*command, *extra], capture_output=True, text=True, timeout=60, check=False
    )
