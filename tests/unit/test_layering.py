"""Import layering, read from the source with ``ast`` (nothing is imported).

* ``connector/`` never imports ``app`` (vLLM loads it inside engine processes);
* only ``connector/ray_backend.py`` imports Ray; the vLLM-side connectors never do;
* the pure modules (config, codec, ports, env, the routing decisions, what travels with a request) import
  neither Ray, vLLM nor torch, directly or through another module of this repository;
* ``app/`` is split by role, each package's ``__init__`` saying what it may import: the roles (``ingress/``,
  ``decode/``, ``prefill/``) import none of one another; the shared packages (``config/``, ``routing/``,
  ``request/``, ``replica/``) import no role; ``config/`` imports only ``config/`` and ``routing/`` of ``app``;
  nothing in ``app/`` outside ``tools/`` imports ``tools/`` (nor does ``connector/``); only the composition
  roots and the model's resolution sit at the top of ``app/``.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("connector", "app")
HEAVY = {"ray", "vllm", "torch"}
ROLES = ("ingress", "decode", "prefill")
SHARED = ("config", "routing", "request", "replica")
TOOLS = "tools"
# The Serve request routers are routing/'s thin shell over Ray's request router; the rest of it is pure.
SERVE_ROUTERS = {"app/routing/decode_router.py", "app/routing/prefill_router.py"}
TOP_OF_APP = {"app/__init__.py", "app/builder.py", "app/aggregated.py", "app/model_source.py"}
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
APP_FILES = python_files("app")
ALL_FILES = CONNECTOR_FILES + APP_FILES


def app_package(rel: str) -> str | None:
    """``decode`` for ``app/decode/server.py``; None at the top of ``app/`` or outside it."""
    parts = Path(rel).parts
    return parts[1] if parts[0] == "app" and len(parts) > 2 else None


def imported_package(module: str) -> str | None:
    """``decode`` for ``app.decode.server``; None for ``app`` itself, a top module of ``app`` or outside it."""
    parts = module.split(".")
    return parts[1] if parts[0] == "app" and len(parts) > 1 and parts[1] in ROLES + SHARED + (TOOLS,) else None


def files_of(*packages: str) -> list[str]:
    return [rel for rel in APP_FILES if app_package(rel) in packages]


PURE = [
    "connector/params.py", "connector/ports.py", "connector/engine_env.py",
    *files_of("config", "request"),
    *(rel for rel in files_of("routing") if rel not in SERVE_ROUTERS),
]


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


def test_packages_are_read_from_paths():
    assert app_package("app/decode/server.py") == "decode" and app_package("app/builder.py") is None
    assert imported_package("app.routing.pipeline") == "routing" and imported_package("app.builder") is None
    assert imported_package("app") is None and imported_package("connector.params") is None


def test_scanner_sees_the_known_heavy_imports():
    """Guards against a scanner that silently finds nothing."""
    assert "ray" in {i.top for i in imports_of("connector/ray_backend.py")}
    assert "vllm" in {i.top for i in imports_of("connector/vllm_connectors.py")}
    assert "connector" in {i.top for i in imports_of("app/config/llm_configs.py")}
    assert "connector/ray_backend.py" in CONNECTOR_FILES and "app/config/args.py" in ALL_FILES


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


# --------------------------------------------------------------------------- app/'s packages


def test_every_app_module_has_a_package():
    """A new module goes where its role is; the top of app/ holds only what composes the app."""
    loose = [rel for rel in APP_FILES if app_package(rel) is None and rel not in TOP_OF_APP]
    unknown = sorted({app_package(rel) for rel in APP_FILES} - {None, *ROLES, *SHARED, TOOLS})
    assert not loose and not unknown, f"modules outside app/'s packages: {loose}; unknown packages: {unknown}"


def test_the_pure_list_is_not_empty():
    """Guards against a PURE built from paths that moved."""
    assert {"app/config/args.py", "app/routing/pipeline.py", "app/request/timeline.py"} <= set(PURE)
    assert not SERVE_ROUTERS & set(PURE) and all((REPO / rel).exists() for rel in SERVE_ROUTERS | TOP_OF_APP)


@pytest.mark.parametrize("rel", files_of(*ROLES))
def test_a_role_imports_no_other_role(rel):
    """ingress, decode and prefill talk through Serve's handles and the shared packages, never by import."""
    own = app_package(rel)
    bad = [str(i) for i in imports_of(rel) if imported_package(i.module) in set(ROLES) - {own}]
    assert not bad, f"{rel}: a role imports no other role: " + "; ".join(bad)


@pytest.mark.parametrize("rel", files_of(*SHARED))
def test_shared_packages_import_no_role(rel):
    bad = [str(i) for i in imports_of(rel) if imported_package(i.module) in ROLES + (TOOLS,)]
    assert not bad, f"{rel}: config/, routing/, request/ and replica/ serve every role and import none: " + "; ".join(bad)


@pytest.mark.parametrize("rel", files_of("config"))
def test_config_imports_only_config_and_routing(rel):
    bad = [str(i) for i in imports_of(rel)
           if i.top == "app" and imported_package(i.module) not in ("config", "routing")]
    assert not bad, f"{rel}: config/ imports only config/ and routing/ of app: " + "; ".join(bad)


@pytest.mark.parametrize("rel", [rel for rel in ALL_FILES if app_package(rel) != TOOLS])
def test_serving_code_never_imports_tools(rel):
    bad = [str(i) for i in imports_of(rel) if imported_package(i.module) == TOOLS]
    assert not bad, f"{rel}: tools/ holds user commands; the served app never imports them: " + "; ".join(bad)


@pytest.mark.parametrize("rel", files_of("config", "routing", "request"))
def test_decisions_never_pull_in_vllm(rel):
    """The Serve routers may import Ray's request router; nothing in these packages reaches vLLM."""
    bad = [str(i) for i in repo_closure(rel) if i.top in ("vllm", "torch")]
    assert not bad, f"{rel} pulls in vLLM or torch: " + "; ".join(bad)
