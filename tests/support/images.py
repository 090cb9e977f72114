"""The Dockerfiles' ARGs and base images and pyproject's extras and pins: read by the image tests
(tests/unit/test_images.py) and the manifest tests (tests/unit/test_k8s.py)."""

from __future__ import annotations

import re
import tomllib
from functools import cache
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "docker"
GPU_DOCKERFILE = DOCKER / "Dockerfile"
NEURON_DOCKERFILE = DOCKER / "Dockerfile.neuron"


def build_args(dockerfile: Path) -> dict[str, str]:
    """ARG defaults, by name (our Dockerfiles declare each name once)."""
    found = re.findall(r"^ARG\s+(\w+)(?:=(\S*))?", dockerfile.read_text(), flags=re.M)
    names = [name for name, _ in found]
    assert len(names) == len(set(names)), f"{dockerfile.name} declares an ARG twice: {names}"
    return dict(found)


def base_image(dockerfile: Path) -> str:
    """The final stage's FROM, with ARG defaults put in (what `docker build` uses without --build-arg)."""
    *_, image = re.findall(r"^FROM\s+(\S+)", dockerfile.read_text(), flags=re.M)
    args = build_args(dockerfile)
    return re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], image)


@cache
def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def extra(name: str) -> list[Requirement]:
    """One of pyproject.toml's extras, parsed."""
    return [Requirement(r) for r in pyproject()["project"]["optional-dependencies"][name]]


def exact_pins(requirements: list[Requirement]) -> dict[str, str]:
    """The ``==`` pins among ``requirements``: {canonical name: version}."""
    return {canonicalize_name(r.name): next(iter(r.specifier)).version
            for r in requirements if [s.operator for s in r.specifier] == ["=="]}
