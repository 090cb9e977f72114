"""The seams list (connector/seams.py): every private Ray Serve LLM, vLLM and Starlette name we
touch is an entry there; each is resolved here against the installed packages, the list is
well formed and pinned to the installed versions, and scans of app/ and connector/ fail a new
private use without an entry (or a walk up the call stack to find upstream objects).

An upgrade that moves any of these fails here, in seconds, instead of at runtime inside a replica.
The entries' closer checks (``checked_by``) are mostly in test_upstream_probes.py. Nothing is
started: Ray modules are imported, never ``ray.init``.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
import ray
import vllm

from connector import seams
from connector.upgrade_check import assigned_on_self
from tests.support.source import class_source

REPO = Path(__file__).resolve().parents[3]
SOURCE_FILES = sorted(str(p.relative_to(REPO)) for package in ("app", "connector") for p in (REPO / package).rglob("*.py"))
UPSTREAM_PACKAGES = ("vllm", "ray", "starlette")
PRIVATE_NAME = re.compile(r"_[a-z]\w*")
PRIVATE_MODULE = re.compile(r"(ray\.llm\._internal|ray\.serve\._private|vllm)\.[\w.]+")


# --------------------------------------------------------------------------- versions


def test_pinned_versions():
    assert ray.__version__ == "2.60.0"
    assert vllm.__version__ == seams.PINNED["vllm"], vllm.__version__


# --------------------------------------------------------------------------- the seams list (connector/seams.py)
# Every private upstream name we touch is an entry there; each is resolved here against the
# installed packages, and a new private use without an entry fails the scans below.


def _resolve(target: str):
    module, _, qualname = target.partition(":")
    obj = importlib.import_module(module)
    for part in filter(None, qualname.split(".")):
        obj = getattr(obj, part)
    return obj


def _class_sources(cls):
    """The source of ``cls`` and of each of its bases."""
    return [class_source(klass) for klass in getattr(cls, "__mro__", (cls,)) if klass is not object]


def _has_attribute(cls, name: str) -> bool:
    """A class attribute, property, enum member, or an annotated (dataclass, pydantic) field."""
    if hasattr(cls, name):
        return True
    if any(name in vars(klass).get("__annotations__", {}) for klass in getattr(cls, "__mro__", ())):
        return True
    fields = getattr(cls, "model_fields", None)
    return isinstance(fields, dict) and name in fields


def _seam_problem(seam: seams.Seam) -> str | None:
    """None if the seam is as listed, else what changed (completes "<where> ...")."""
    try:
        obj = _resolve(seam.target)
    except (ImportError, AttributeError) as exc:
        return f"cannot be reached: {seam.target} no longer resolves ({exc!r})"
    name = seam.attribute
    if seam.kind in ("import", "behaviour"):
        ok = hasattr(obj, name)
    elif seam.kind == "method":
        ok = callable(getattr(obj, name, None))
    elif seam.kind == "attribute":
        ok = _has_attribute(obj, name)
    elif seam.kind == "instance":
        ok = any(name in assigned_on_self(source) for source in _class_sources(obj))
    elif seam.kind == "global":
        ok = hasattr(sys.modules[obj.__module__], name)
    else:
        return f"has an unknown kind {seam.kind!r}"
    if not ok:
        return "is gone" if seam.kind != "instance" else f"is gone (no `self.{name} = ...` in {seam.target} or its bases)"
    if seam.snippet is not None and seam.snippet not in inspect.getsource(obj):
        return f"changed shape: {seam.target}'s source no longer contains {seam.snippet!r}"
    return None


@pytest.mark.parametrize("seam", seams.SEAMS, ids=lambda s: f"{s.library}:{s.where}")
def test_seam(seam):
    problem = _seam_problem(seam)
    assert problem is None, seam.changed(problem)


def test_seam_messages_say_what_changed_and_what_to_reread():
    seam = next(s for s in seams.SEAMS if s.attribute == "_is_hma_required")
    message = seam.changed("is gone")
    assert message.startswith(f"vllm {seams.PINNED['vllm']} seam changed: NixlBaseConnectorWorker._is_hma_required (instance")
    assert "Re-read connector/vllm_connectors.py" in message and "silently" in message
    gone = _seam_problem(seams.Seam("vllm", "vllm.v1.request:Request", "_no_such_name", "instance", ("x.py",), "test"))
    assert gone.startswith("is gone (no `self._no_such_name = ...` in vllm.v1.request:Request")
    moved = _seam_problem(seams.Seam("ray", "ray.serve:NoSuchClass", "x", "method", ("x.py",), "test"))
    assert "no longer resolves" in moved
    reshaped = _seam_problem(seams.Seam("vllm", "vllm.v1.request:Request", "arrival_time", "instance", ("x.py",), "test",
                                        snippet="no such text"))
    assert reshaped.startswith("changed shape")


def test_the_seams_module_is_pure_data():
    """Read by people and by tests: it must import nothing heavy (and connector/ never imports app)."""
    tree = ast.parse((REPO / "connector/seams.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert imported <= {"__future__", "dataclasses"}, f"connector/seams.py imports {sorted(imported)}"


def _test_exists(reference: str) -> bool:
    path, _, name = reference.partition("::")
    file = REPO / path
    return file.is_file() and re.search(rf"^def {re.escape(name)}\(", file.read_text(), re.M) is not None


def test_the_seams_list_is_well_formed():
    problems = []
    keys = [(s.target, s.attribute) for s in seams.SEAMS]
    problems += [f"listed twice: {k}" for k in sorted({k for k in keys if keys.count(k) > 1})]
    for seam in seams.SEAMS:
        if seam.kind not in seams.KINDS or seam.library not in seams.PINNED:
            problems.append(f"{seam.where}: kind {seam.kind!r} / library {seam.library!r} unknown")
        if not seam.used_by or not seam.why:
            problems.append(f"{seam.where}: say who uses it and why")
        if seam.checked_by and not _test_exists(seam.checked_by):
            problems.append(f"{seam.where}: checked_by names a test that does not exist: {seam.checked_by}")
        if seam.kind == "behaviour" and not seam.checked_by:
            problems.append(f"{seam.where}: a behaviour seam needs the test that checks it (checked_by)")
        for rel in seam.used_by:
            if not (REPO / rel).is_file():
                problems.append(f"{seam.where}: used_by names a missing file {rel}")
            elif seam.kind != "behaviour" and seam.attribute not in (REPO / rel).read_text():
                problems.append(f"{seam.where}: {rel} no longer mentions {seam.attribute!r}: drop it from used_by "
                                "(or the entry, if nothing uses it any more)")
    assert not problems, "connector/seams.py:\n" + "\n".join(problems)


def _scan(rel: str):
    """(names our code owns, private names it reads from others with their lines, private
    names each class of ours uses on self, private names read off upstream imports)."""
    tree = ast.parse((REPO / rel).read_text())
    upstream_imports = {
        alias.asname or alias.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
        and n.module.split(".")[0] in UPSTREAM_PACKAGES for alias in n.names
    }
    owned, read, by_class, off_upstream = set(), {}, {}, {}

    def string_attr(node):  # getattr(obj, "_x", ...), hasattr(...), setattr(...)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr", "setattr")
                and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
                and PRIVATE_NAME.fullmatch(node.args[1].value)):
            return node.args[1].value
        return None

    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            owned.add(node.name)
        if isinstance(node, ast.Attribute) and PRIVATE_NAME.fullmatch(node.attr):
            on_self = isinstance(node.value, ast.Name) and node.value.id == "self"
            if isinstance(node.ctx, ast.Store) and on_self:
                owned.add(node.attr)
            else:
                read.setdefault(node.attr, node.lineno)
            if isinstance(node.value, ast.Name) and node.value.id in upstream_imports:
                off_upstream.setdefault(node.attr, node.lineno)
        name = string_attr(node)
        if name:
            read.setdefault(name, node.lineno)
        if isinstance(node, ast.ClassDef):
            used = set()
            for sub in ast.walk(node):
                if (isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self"
                        and PRIVATE_NAME.fullmatch(sub.attr)):
                    used.add(sub.attr)
                if string_attr(sub) and isinstance(sub.args[0], ast.Name) and sub.args[0].id == "self":
                    used.add(string_attr(sub))
            for statement in node.body:
                if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    used.add(statement.name)
                targets = statement.targets if isinstance(statement, ast.Assign) else [getattr(statement, "target", None)]
                for target in targets:
                    if isinstance(target, ast.Name):
                        owned.add(target.id)
                        used.add(target.id)
            by_class[node.name] = {n for n in used if PRIVATE_NAME.fullmatch(n)}
    return owned, read, by_class, off_upstream


def _upstream_private_names() -> dict[str, set[str]]:
    """Every upstream private name our code uses -> where. Upstream: read off an upstream
    import; read off something and never defined by us; or used by a class of ours on
    ``self`` where an upstream base class defines it (overrides, inherited state)."""
    scans = {rel: _scan(rel) for rel in SOURCE_FILES}
    owned = set().union(*(scan[0] for scan in scans.values()))
    found: dict[str, set[str]] = {}
    names_of_class = {}
    for rel, (_, read, by_class, off_upstream) in scans.items():
        for name, line in read.items():
            if name not in owned:
                found.setdefault(name, set()).add(f"{rel}:{line}")
        for name, line in off_upstream.items():
            found.setdefault(name, set()).add(f"{rel}:{line}")
        module = rel[:-3].replace("/", ".")
        for cls_name, names in by_class.items():
            names_of_class[f"{module}.{cls_name}"] = (rel, names)
    for qualified in names_of_class:
        module, cls_name = qualified.rsplit(".", 1)
        cls = getattr(importlib.import_module(module), cls_name, None)
        if not isinstance(cls, type):
            continue
        ours = [k for k in cls.__mro__ if f"{k.__module__}.{k.__qualname__}" in names_of_class]
        theirs = [k for k in cls.__mro__ if k.__module__.split(".")[0] in UPSTREAM_PACKAGES]
        if not theirs:
            continue
        upstream_names = set().union(*(vars(k).keys() | assigned_on_self(class_source(k)) for k in theirs))
        for klass in ours:
            rel_of_klass, names = names_of_class[f"{klass.__module__}.{klass.__qualname__}"]
            for name in names & upstream_names:
                found.setdefault(name, set()).add(f"{rel_of_klass}:{klass.__name__}")
    return found


def test_every_upstream_private_name_we_use_is_a_listed_seam():
    found = _upstream_private_names()
    assert {"_body", "_is_hma_required", "_prefill_handle", "_read_blocks"} <= set(found), (
        f"the scanner is out of date: it found only {sorted(found)}"
    )
    listed = {s.attribute for s in seams.SEAMS}
    missing = {name: sorted(where) for name, where in found.items() if name not in listed}
    assert not missing, (
        "private names of vLLM/Ray/Starlette used without an entry in connector/seams.py (add one: target, kind, "
        "used_by, why; an upgrade that moves them must fail here, not at runtime):\n"
        + "\n".join(f"  {name}: {', '.join(where)}" for name, where in sorted(missing.items()))
    )


def test_every_private_upstream_module_we_import_is_a_listed_seam():
    listed = {(s.target.partition(":")[0], s.attribute) for s in seams.SEAMS}
    modules = {s.target.partition(":")[0] for s in seams.SEAMS}
    missing, seen = [], 0
    for rel in SOURCE_FILES:
        for node in ast.walk(ast.parse((REPO / rel).read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and PRIVATE_MODULE.fullmatch(node.module):
                for alias in node.names:
                    seen += 1
                    if (node.module, alias.name) not in listed and f"{node.module}.{alias.name}" not in modules:
                        missing.append(f"{rel}:{node.lineno} from {node.module} import {alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if PRIVATE_MODULE.fullmatch(alias.name):
                        seen += 1
                        if not any(m == alias.name or m.startswith(alias.name + ".") for m in modules):
                            missing.append(f"{rel}:{node.lineno} import {alias.name}")
    assert seen > 20, f"the import scan found only {seen} private imports: it is out of date"
    assert not missing, "private upstream imports without an entry in connector/seams.py:\n" + "\n".join(missing)


def test_nothing_finds_upstream_objects_up_the_call_stack():
    """Frame walks find whatever caller happens to match, and break silently when upstream calls us
    from elsewhere: upstream objects we need come from hooks or from a thread's listed seams."""
    walks = re.compile(r"sys\._getframe|inspect\.(stack|currentframe|getouterframes)|\.f_back\b|\.f_locals\b")
    found = [f"{rel}:{n}" for rel in SOURCE_FILES for n, line in enumerate((REPO / rel).read_text().splitlines(), 1)
             if walks.search(line)]
    assert not found, "frame walks: " + ", ".join(found)


def test_installed_versions_are_the_pinned_ones():
    wrong = []
    for library, pinned in seams.PINNED.items():
        if pinned is None:
            continue
        installed = {}
        for distribution in seams.DISTRIBUTIONS[library]:
            try:
                installed[distribution] = metadata.version(distribution)
            except metadata.PackageNotFoundError:
                pass
        assert installed, f"{library} is not installed (looked for {', '.join(seams.DISTRIBUTIONS[library])})"
        wrong += [f"{d} {v} is installed; connector/seams.py was read against {library} {pinned}"
                  for d, v in installed.items() if v.split("+")[0] != pinned]
    assert not wrong, (
        "\n".join(wrong) + "\nUpgrading? Run `pytest tests/unit/connector/test_seams.py`, re-read the files its failures name, "
        "then update PINNED in connector/seams.py and the pins in pyproject.toml (docs/upgrading.md)."
    )


def test_pyproject_pins_what_the_seams_were_read_against():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    requirements = list(project["dependencies"]) + [r for extra in project["optional-dependencies"].values() for r in extra]
    pins = {}
    for requirement in requirements:
        match = re.fullmatch(r"\s*([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?\s*==\s*([^\s;]+)\s*", requirement)
        if match:
            pins.setdefault(match.group(1).lower(), set()).add(match.group(2))
    for library, pinned in seams.PINNED.items():
        if pinned is None:
            continue
        versions = set().union(*(pins.get(d, set()) for d in seams.DISTRIBUTIONS[library]))
        assert versions == {pinned}, (
            f"pyproject.toml pins {library} to {sorted(versions) or 'nothing'}, connector/seams.py to {pinned}: "
            "they move together (docs/upgrading.md)"
        )
