"""Fixtures for the deployment tests: a helm binary, and the chart rendered offline.

helm comes from scripts/helm.sh (cached under .venv/helm after the first run); nothing here
needs a Kubernetes cluster or a container engine.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.deploy.chart import Render, Rendered, helm_template


@pytest.fixture(scope="session")
def render(helm: Path) -> Render:
    """Render the chart with `--set` settings; the same settings are rendered once a session."""
    cache: dict[tuple[str, ...], Rendered] = {}

    def run(*settings: str) -> Rendered:
        if settings not in cache:
            done = helm_template(helm, settings)
            if done.returncode != 0:
                pytest.fail(f"helm template {' '.join(settings)} failed:\n{done.stderr}")
            objects = [o for o in yaml.safe_load_all(done.stdout) if o]
            cache[settings] = Rendered(objects)
        return cache[settings]

    return run
