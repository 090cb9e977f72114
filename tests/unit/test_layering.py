"""Import layering, read from the source with ``ast`` (nothing is imported).

* ``connector/`` never imports ``app`` (vLLM loads it inside engine processes);
* only ``connector/ray_backend.py`` imports Ray; the vLLM-side connectors never do;
* the pure modules (config, codec, ports, env, the routing decisions, what travels with a request) import
  neither Ray, vLLM nor torch, directly or through another module of this repository;
* ``app/`` is split by role, each package's ``__init__`` saying what it may import: the roles (``ingress/``,
  ``decode/``, ``prefill/``) import none of one another; the shared packages (``config/``, ``routing/``,
  ``request/``, ``replica/``) import no role; ``config/`` imports only ``config/`` and ``routing/`` of ``app``;
  nothing in ``app/`` outside ``tools/`` imports ``tools/`` (nor does ``connector/``); only the composition
  roots and the model's resolution sit at the top of ``app/``;
* ``app/request/envelope.py`` imports nothing of ``app``: everything else reads the envelope from it.
"""

from __future__ import annotations

import re

import pytest

from tests.support.layering import (
    ALL_FILES,
    APP_FILES,
    app_package,
    CONNECTOR_FILES,
    files_of,
    HEAVY,
    imported_package,
    imports_of,
    imports_of_source,
    PURE,
    RAY_ALLOWED_IN_CONNECTOR,
    REPO,
    repo_closure,
    ROLES,
    SERVE_ROUTERS,
    SHARED,
    TOOLS,
    TOP_OF_APP,
    VLLM_SIDE,
)


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


def test_the_envelope_imports_nothing_of_app():
    """The routers, the roles and the timeline all read the envelope: it sits below them."""
    bad = [str(i) for i in imports_of("app/request/envelope.py") if i.top == "app"]
    assert not bad, "app/request/envelope.py imports nothing of app: " + "; ".join(bad)


@pytest.mark.parametrize("rel", [rel for rel in ALL_FILES if app_package(rel) != TOOLS])
def test_serving_code_never_imports_tools(rel):
    bad = [str(i) for i in imports_of(rel) if imported_package(i.module) == TOOLS]
    assert not bad, f"{rel}: tools/ holds user commands; the served app never imports them: " + "; ".join(bad)


@pytest.mark.parametrize("rel", files_of("config", "routing", "request"))
def test_decisions_never_pull_in_vllm(rel):
    """The Serve routers may import Ray's request router; nothing in these packages reaches vLLM."""
    bad = [str(i) for i in repo_closure(rel) if i.top in ("vllm", "torch")]
    assert not bad, f"{rel} pulls in vLLM or torch: " + "; ".join(bad)


@pytest.mark.parametrize("rel", ["bench/results.py", "bench/profiles.py", "bench/engine_metrics.py", "bench/__init__.py"])
def test_bench_core_modules_import_no_heavy_package(rel):
    bad = [str(i) for i in imports_of(rel) if i.top in HEAVY]
    assert not bad, f"{rel} must stay light: " + "; ".join(bad)


def test_no_test_module_imports_another_or_a_conftest():
    """Shared test code lives in tests/support/ or in the integration helper modules (apps, cases, cluster...),
    never in a test module or a conftest (pytest imports those itself)."""
    shares = re.compile(r"^\s*(?:from|import)\s+tests\.(?:[\w.]*\.)?(?:test_\w+|conftest)\b", re.MULTILINE)
    found = [str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("*.py") if shares.search(p.read_text())]
    assert not found, f"test modules or conftests imported by: {found}"
