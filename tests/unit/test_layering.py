"""Import layering, read from the source with ``ast`` (nothing is imported).

* ``connector/`` never imports ``app`` (vLLM loads it inside engine processes);
* only ``connector/ray_backend.py`` imports Ray; the vLLM-side connectors never do;
* the pure modules (config, codec, ports, env) import neither Ray, vLLM nor torch,
  directly or through another module of this repository.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("connector", "app")
HEAVY = {"ray", "vllm", "torch"}
PURE = [
    "connector/params.py", "connector/ports.py", "connector/engine_env.py",
    "app/args.py", "app/llm_configs.py", "app/routing.py", "app/conversations.py",
]
VLLM_SIDE = [
    "connector/vllm_connectors.py", "connector/push_deadline.py", "connector/push_reuse.py", "connector/nixl_progress.py",
    "connector/pull_history.py",
]
RAY_ALLOWED_IN_CONNECTOR = {"connector/ray_backend.py"}


@dataclass(frozen=True)
class Import:
    file: str  # relative to the repo
    line: int
    module: str  # absolute dotted name

    @property
    def top(self) -> str:
        return self.module.split(".")[0]

    def __str__(self) -> str:
        return f"{self.file}:{self.line} imports {self.module!r}"


def module_name(rel: str) -> str:
    parts = list(Path(rel).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of_source(source: str, rel: str) -> list[Import]:
    """Every import in ``source`` (module level or not), relative ones made absolute.

    ``importlib.import_module("x")`` and ``__import__("x")`` with a literal name count too.
    """
    tree = ast.parse(source, filename=rel)
    package = module_name(rel).split(".")
    if not rel.endswith("__init__.py"):
        package = package[:-1]
    found: list[Import] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [Import(rel, node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                if node.module:
                    found.append(Import(rel, node.lineno, ".".join([*base, node.module])))
                else:  # from . import a, b
                    found += [Import(rel, node.lineno, ".".join([*base, a.name])) for a in node.names]
            else:
                found.append(Import(rel, node.lineno, node.module or ""))
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
            first = node.args[0]
            if name in ("import_module", "__import__") and isinstance(first, ast.Constant) and isinstance(first.value, str):
                found.append(Import(rel, node.lineno, first.value))
    return found


def imports_of(rel: str) -> list[Import]:
    return imports_of_source((REPO / rel).read_text(), rel)


def python_files(package: str) -> list[str]:
    return sorted(str(p.relative_to(REPO)) for p in (REPO / package).rglob("*.py"))


CONNECTOR_FILES = python_files("connector")
ALL_FILES = CONNECTOR_FILES + python_files("app")


def _module_to_file() -> dict[str, str]:
    return {module_name(rel): rel for rel in ALL_FILES}


def repo_closure(rel: str) -> list[Import]:
    """Imports of ``rel`` and of every repository module it pulls in (with their packages)."""
    modules = _module_to_file()
    seen: set[str] = set()
    todo = [rel]
    out: list[Import] = []

    def enqueue(dotted: str) -> None:
        parts = dotted.split(".")
        # Importing a.b.c runs a/__init__, a/b/__init__ (or a/b.py), ... too.
        for i in range(1, len(parts) + 1):
            name = ".".join(parts[:i])
            if name in modules and modules[name] not in seen:
                todo.append(modules[name])

    enqueue(module_name(rel))
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        for imp in imports_of(current):
            out.append(imp)
            enqueue(imp.module)
    return out


# --------------------------------------------------------------------------- the scanner itself


def test_scanner_finds_every_kind_of_import():
    source = "\n".join(
        [
            "import os, ray.serve",
            "from vllm.envs import x",
            "from . import params",
            "from .ports import Role",
            "from .. import app",
            "def f():",
            "    import torch",
            "    importlib.import_module('ray.util')",
            "    __import__('vllm')",
            "    return 1",
        ]
    )
    found = [i.module for i in imports_of_source(source, "connector/thing.py")]
    assert sorted(found) == sorted(
        ["os", "ray.serve", "vllm.envs", "connector.params", "connector.ports", "app", "torch", "ray.util", "vllm"]
    )


def test_scanner_sees_the_known_heavy_imports():
    """Guards against a scanner that silently finds nothing."""
    assert "ray" in {i.top for i in imports_of("connector/ray_backend.py")}
    assert "vllm" in {i.top for i in imports_of("connector/vllm_connectors.py")}
    assert "connector" in {i.top for i in imports_of("app/llm_configs.py")}
    assert "connector/ray_backend.py" in CONNECTOR_FILES and "app/args.py" in ALL_FILES


# --------------------------------------------------------------------------- rules


@pytest.mark.parametrize("rel", CONNECTOR_FILES)
def test_connector_never_imports_app(rel):
    bad = [str(i) for i in imports_of(rel) if i.top == "app"]
    assert not bad, "connector/ must not depend on app/: " + "; ".join(bad)


@pytest.mark.parametrize("rel", CONNECTOR_FILES)
def test_only_ray_backend_imports_ray_in_connector(rel):
    if rel in RAY_ALLOWED_IN_CONNECTOR:
        assert any(i.top == "ray" for i in imports_of(rel)), f"{rel} was expected to be the Ray-side backend"
        return
    bad = [str(i) for i in imports_of(rel) if i.top == "ray"]
    assert not bad, "only connector/ray_backend.py may import ray: " + "; ".join(bad)


@pytest.mark.parametrize("rel", VLLM_SIDE)
def test_vllm_connectors_do_not_import_ray(rel):
    bad = [str(i) for i in repo_closure(rel) if i.top in ("ray", "app")]
    assert not bad, "vLLM-side connectors run in engine processes: " + "; ".join(bad)


@pytest.mark.parametrize("rel", PURE)
def test_pure_modules_import_no_heavy_package_directly(rel):
    bad = [str(i) for i in imports_of(rel) if i.top in HEAVY]
    assert not bad, f"{rel} must stay pure (no {sorted(HEAVY)}): " + "; ".join(bad)


@pytest.mark.parametrize("rel", PURE)
def test_pure_modules_pull_in_no_heavy_package_through_the_repo(rel):
    bad = [str(i) for i in repo_closure(rel) if i.top in HEAVY]
    assert not bad, f"{rel} pulls in a heavy package through another module: " + "; ".join(bad)
