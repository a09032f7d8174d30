"""The container image's Dockerfile, checked without a container engine.

The instructions are parsed and checked for what matters in a cluster: pinned bases, a non-root
user matching the chart, exec-form entry point, sources that exist and are not left out of the
build context, and the dashboard landing where the gateway looks for it.
"""

from __future__ import annotations

import json
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from tests.deploy.chart import CHART, REPO

DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"


@dataclass(frozen=True)
class Instruction:
    keyword: str
    arguments: str


@dataclass
class Stage:
    base: str
    name: str
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [i.arguments for i in self.instructions if i.keyword == keyword]


def _instructions(text: str) -> list[Instruction]:
    found: list[Instruction] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):  # a comment inside a continued instruction
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        keyword, _, arguments = line.partition(" ")
        found.append(Instruction(keyword.upper(), " ".join(arguments.split())))
    assert not pending, "the Dockerfile ends inside a continued line"
    return found


def _arg_defaults(instructions: list[Instruction]) -> dict[str, str]:
    defaults = {}
    for instruction in instructions:
        if instruction.keyword == "ARG" and "=" in instruction.arguments:
            name, _, value = instruction.arguments.partition("=")
            defaults[name] = value
    return defaults


def _expand(text: str, variables: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: variables.get(m[1] or m[2], m[0]), text)


@pytest.fixture(scope="module")
def instructions() -> list[Instruction]:
    return _instructions(DOCKERFILE.read_text())


@pytest.fixture(scope="module")
def stages(instructions: list[Instruction]) -> list[Stage]:
    defaults = _arg_defaults(
        instructions[
            : next(i for i, instruction in enumerate(instructions) if instruction.keyword == "FROM")
        ]
    )
    found: list[Stage] = []
    for instruction in instructions:
        if instruction.keyword == "FROM":
            match = re.fullmatch(r"(\S+) AS (\S+)", instruction.arguments, re.IGNORECASE)
            assert match, f"FROM {instruction.arguments}: every stage needs a name (AS ...)"
            found.append(Stage(_expand(match[1], defaults), match[2]))
        elif found:
            found[-1].instructions.append(instruction)
    return found


def _resolved(stages: list[Stage], stage: Stage) -> Stage:
    """`stage` with the instructions of the stages it is built FROM before its own, and the
    image it starts from at the root."""
    by_name = {s.name: s for s in stages}
    if stage.base not in by_name:
        return stage
    parent = _resolved(stages, by_name[stage.base])
    return Stage(parent.base, stage.name, [*parent.instructions, *stage.instructions])


def _final(stages: list[Stage]) -> Stage:
    """The default target (the last stage), as built: its own and its parents' instructions."""
    return _resolved(stages, stages[-1])


def _json_form(arguments: str) -> list[str]:
    value = json.loads(arguments)
    assert isinstance(value, list)
    return [str(v) for v in value]


def _chart_defaults() -> dict[str, object]:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert isinstance(values, dict)
    return values


def test_build_is_multi_stage_from_pinned_bases(stages: list[Stage]) -> None:
    names = [stage.name for stage in stages]
    assert len(names) == len(set(names)) >= 3
    assert {"dashboard", "builder", "runtime", "example"} <= set(names)
    assert names[-1] == "runtime", "a build without --target must give the services' image"
    for stage in stages:
        if stage.base in names:
            continue
        tag = stage.base.partition(":")[2]
        assert tag, f"{stage.name}: base {stage.base} has no tag"
        assert "latest" not in tag, stage.base
    by_name = {stage.name: stage for stage in stages}
    assert by_name["builder"].base.startswith("python:3.11-slim")
    assert _final(stages).base == by_name["builder"].base  # the venv's interpreter is the same
    assert by_name["dashboard"].base.startswith("node:20")


def test_no_instruction_uses_latest_or_fetches_from_the_network(
    instructions: list[Instruction],
) -> None:
    for instruction in instructions:
        assert ":latest" not in instruction.arguments, instruction
        if instruction.keyword == "ADD":
            assert not re.search(r"https?://", instruction.arguments), instruction
        if instruction.keyword == "RUN":
            assert not re.search(r"\b(curl|wget) ", instruction.arguments), instruction
            assert "chmod 777" not in instruction.arguments


def test_builder_installs_a_wheel_of_the_repository_into_a_venv(stages: list[Stage]) -> None:
    builder = next(stage for stage in stages if stage.name == "builder")
    runs = " && ".join(builder.all("RUN"))
    assert "pip wheel --no-deps" in runs
    assert "python -m venv /opt/strata" in runs
    # By file, so the wheel just built is the one installed, whatever an index holds.
    assert re.search(r'pip install "\$\{wheel\}\[', runs), runs
    assert "/wheels/strata_ctl-*.whl" in runs
    extras = _arg_defaults(builder.instructions)["STRATA_EXTRAS"].split(",")
    assert "server" in extras, "the image runs the services: it needs the server extra"
    runtime_copies = _final(stages).all("COPY")
    assert "--from=builder /opt/strata /opt/strata" in runtime_copies


def test_runtime_runs_as_the_non_root_user_of_the_chart(stages: list[Stage]) -> None:
    final = _final(stages)
    users = final.all("USER")
    assert users, "the runtime stage never leaves root"
    uid, _, gid = users[-1].partition(":")
    # Numeric, so the kubelet can verify runAsNonRoot without reading /etc/passwd.
    assert uid.isdigit(), uid
    assert gid.isdigit(), gid
    assert int(uid) != 0
    assert int(gid) != 0
    keywords = [i.keyword for i in final.instructions]
    last_user = len(keywords) - 1 - keywords[::-1].index("USER")
    assert "RUN" not in keywords[last_user:], "RUN after USER would need root to have run first"
    chart = _chart_defaults()
    security = chart["securityContext"]
    assert isinstance(security, dict)
    assert int(uid) == security["runAsUser"]
    assert int(gid) == security["runAsGroup"]


def test_writable_paths_are_tmp_and_data_only(stages: list[Stage]) -> None:
    final = _final(stages)
    env = " ".join(final.all("ENV"))
    assert "HOME=/tmp" in env, "caches must land on the /tmp emptyDir under a read-only root"
    assert "PYTHONDONTWRITEBYTECODE=1" in env
    owned = [r for r in final.all("RUN") if "chown" in r]
    assert owned
    for run in owned:
        for target in re.findall(r"chown (?:-R )?\S+ (\S+)", run):
            assert target.startswith(("/data", "/tmp")), target


def test_entrypoint_is_the_strata_cli_in_exec_form(stages: list[Stage]) -> None:
    final = _final(stages)
    (entrypoint,) = final.all("ENTRYPOINT")
    (command,) = final.all("CMD")
    assert _json_form(entrypoint) == ["strata"]
    assert _json_form(command) == ["serve", "gateway"]
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert "strata" in scripts
    exposed = {int(p) for e in final.all("EXPOSE") for p in e.split()}
    coordinator = _chart_defaults()["coordinator"]
    assert isinstance(coordinator, dict)
    assert {coordinator["healthPort"], coordinator["service"]["httpPort"]} <= exposed


def test_the_wheel_carries_the_dashboard_the_gateway_serves(stages: list[Stage]) -> None:
    from strata.services.gateway.assets import dashboard_candidates

    # setup.py copies dashboard/dist (relative to the build directory) into the wheel as
    # strata/dashboard/dist, the first place the gateway looks.
    assert dashboard_candidates()[0].parts[-3:] == ("strata", "dashboard", "dist")
    builder = next(stage for stage in stages if stage.name == "builder")
    (workdir,) = builder.all("WORKDIR")
    (copy,) = [i for i in builder.instructions if i.arguments.startswith("--from=dashboard")]
    source, destination = copy.arguments.split()[1:]
    assert source == "/src/dashboard/dist"
    assert (Path(workdir) / destination).as_posix().rstrip("/") == f"{workdir}/dashboard/dist"
    (wheel,) = [i for i in builder.instructions if "pip wheel" in i.arguments]
    order = builder.instructions
    assert order.index(copy) < order.index(wheel), "the dashboard must be there before the build"
    # Nothing copies it beside the installed package any more: one place, the wheel.
    assert not [c for c in _final(stages).all("COPY") if c.startswith("--from=dashboard")]


def _glob(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern as a regex: `**` spans directories, `*` and `?` do not."""
    regex = ""
    for piece in re.split(r"(\*\*/?|\*|\?)", pattern.strip("/")):
        if piece.startswith("**"):
            regex += "(?:.*/)?" if piece.endswith("/") else ".*"
        elif piece == "*":
            regex += "[^/]*"
        elif piece == "?":
            regex += "[^/]"
        else:
            regex += re.escape(piece)
    return re.compile(regex)


def _ignored(path: str, patterns: list[str]) -> bool:
    # A pattern that matches a directory leaves out everything below it; the last match wins.
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        if any(_glob(pattern.removeprefix("!")).fullmatch(p) for p in prefixes):
            ignored = not negate
    return ignored


def test_context_sources_exist_and_are_not_ignored(instructions: list[Instruction]) -> None:
    patterns = [
        line.strip()
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for heavy in (".git", ".venv", "dashboard/node_modules", "dashboard/dist"):
        assert _ignored(heavy, patterns), f".dockerignore lets {heavy} into the context"
    for instruction in instructions:
        if instruction.keyword != "COPY" or instruction.arguments.startswith("--from"):
            continue
        *sources, _ = instruction.arguments.split()
        for source in sources:
            path = source.rstrip("/")
            assert (REPO / path).exists(), f"COPY {source}: not in the repository"
            assert not _ignored(path, patterns), f"COPY {source}: excluded by .dockerignore"


def test_the_example_target_adds_cpu_torch_for_the_charts_default_workers(
    stages: list[Stage],
) -> None:
    by_name = {stage.name: stage for stage in stages}
    example = _resolved(stages, by_name["example"])
    runtime = _final(stages)
    # The same base, user and environment as the services' image; only the venv differs.
    assert example.base == runtime.base
    assert example.all("USER")[-1] == runtime.all("USER")[-1]
    assert example.all("ENV") == runtime.all("ENV")
    (copy,) = [c for c in by_name["example"].all("COPY") if c.startswith("--from=")]
    source_stage = copy.split()[0].removeprefix("--from=")
    installs = " ".join(_resolved(stages, by_name[source_stage]).all("RUN"))
    # The CPU wheel index: a plain `pip install torch` pulls gigabytes of CUDA packages.
    assert "--index-url https://download.pytorch.org/whl/cpu" in installs
    defaults = _arg_defaults(by_name[source_stage].instructions)
    assert re.fullmatch(r"\d+\.\d+\.\d+", defaults["TORCH_VERSION"]), "torch must be pinned"
    assert '"torch==${TORCH_VERSION}"' in installs
    assert "import torch, strata.demo.worker" in installs  # the build fails if the demo cannot run
    # The chart's workers default to this image: the coordinator's repository, tag "-example",
    # and they run the demo job with the image's python.
    workers = _chart_defaults()["workers"]
    assert isinstance(workers, dict)
    assert workers["image"]["repository"] == ""
    template = (CHART / "templates" / "_helpers.tpl").read_text()
    assert '"%s-example"' in template
    assert (
        '["python", "-m", "strata.demo.worker"]'
        in (CHART / "templates" / "workers.yaml").read_text()
    )
