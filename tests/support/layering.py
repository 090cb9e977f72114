"""Reading the repository's imports with ``ast`` (nothing is imported), and the package rules' lists: shared by
``tests/unit/test_layering.py`` and the tests that keep other code pure (deploy/, bench/, tools/)."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

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
