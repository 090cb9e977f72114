"""The upgrade check (connector/upgrade_check.py): reads a release's source, never imports it, and names each
seam that is gone, changed shape or signature, or whose override would no longer be called."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from connector.seams import SEAMS, Seam
from connector.upgrade_check import Release, _installed, check, main, seam_problem

PINNED = {
    "fakelib/__init__.py": "from .engine import Engine\n",
    "fakelib/base.py": """
        class Base:
            def __init__(self):
                self.queue = {}

            def step(self, req_id, handle):
                return set()
    """,
    "fakelib/engine.py": """
        from fakelib.base import Base

        class Engine(Base):
            LIMIT = 4

            def poll(self):
                return self.step("r", None)
    """,
    "fakelib/runner.py": """
        def run(engine):
            return engine.poll()
    """,
}


def _tree(root: Path, files: dict[str, str]) -> Release:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return Release(root, root.name)


def _seam(target: str, attribute: str, kind: str, **kw) -> Seam:
    # Files of this repository that define `poll` and `step` again would make them overridden hooks; these
    # name one that defines neither unless a test says so.
    return Seam("vllm", target, attribute, kind, kw.pop("used_by", ("connector/seams.py",)), "test", **kw)


SEAM_LIST = [
    _seam("fakelib.engine:Engine", "step", "method"),  # through a base class in another module
    _seam("fakelib:Engine", "poll", "method"),  # a class re-exported by the package
    _seam("fakelib.engine:Engine", "queue", "instance"),
    _seam("fakelib.engine:Engine", "LIMIT", "attribute"),
    _seam("fakelib.runner", "run", "import"),
    _seam("fakelib.engine:Engine", "poll", "behaviour", snippet='self.step("r", None)', checked_by="x"),
]


def test_a_release_identical_to_the_pinned_one_has_no_findings(tmp_path):
    pinned = _tree(tmp_path / "pinned", PINNED)
    assert check(pinned, pinned, "vllm", SEAM_LIST) == []


@pytest.mark.parametrize("change, expected", [
    ({"fakelib/engine.py": PINNED["fakelib/engine.py"].replace("class Engine", "class Motor")}, "gone: no class Engine"),
    ({"fakelib/base.py": PINNED["fakelib/base.py"].replace("self.queue = {}", "pass")}, "no `self.queue = ...`"),
    ({"fakelib/engine.py": PINNED["fakelib/engine.py"].replace('"r", None', '"r", None, True')}, "changed shape"),
    ({"fakelib/runner.py": "def go(engine):\n    return engine.poll()\n"}, "gone: no run on fakelib.runner"),
])
def test_what_a_release_removed_or_reshaped_is_named(tmp_path, change, expected):
    candidate = _tree(tmp_path / "candidate", {**PINNED, **change})
    findings = check(candidate, _tree(tmp_path / "pinned", PINNED), "vllm", SEAM_LIST)
    assert findings and all(expected in f.problem for f in findings), findings


def test_a_changed_signature_is_named_unless_only_optional_parameters_came_to_a_method_we_only_call(tmp_path):
    pinned = _tree(tmp_path / "pinned", PINNED)
    added = {"fakelib/base.py": PINNED["fakelib/base.py"].replace("req_id, handle)", "req_id, handle, failed=None)")}
    assert check(_tree(tmp_path / "added", {**PINNED, **added}), pinned, "vllm", SEAM_LIST) == []
    # An override of it would be called with the new argument: named.
    def step(self, req_id, handle):  # this file defines `step` again, as an override in connector/ would
        return set()

    ours = _seam("fakelib.engine:Engine", "step", "method", used_by=("tests/unit/connector/test_upgrade_check.py",))
    findings = check(_tree(tmp_path / "added2", {**PINNED, **added}), pinned, "vllm", [ours])
    assert [f.problem for f in findings] == [
        "signature changed: `(self, req_id, handle)` is now `(self, req_id, handle, failed=None)`"]
    returns = {"fakelib/base.py": PINNED["fakelib/base.py"].replace("handle):", "handle) -> tuple[set, set]:")}
    findings = check(_tree(tmp_path / "returns", {**PINNED, **returns}), pinned, "vllm", SEAM_LIST)
    assert [f.problem for f in findings] == ["signature changed: `(self, req_id, handle)` is now "
                                             "`(self, req_id, handle) -> tuple[set, set]`"]


def test_an_override_whose_callers_went_away_is_named_though_the_method_still_exists(tmp_path):
    """vLLM 0.32 kept the worker's get_finished and stopped calling it: our deadlines would silently stop."""
    def poll(self):  # noqa: F811 - this file defines `poll` again: an overridden hook, like connector/push_deadline.py
        return None

    hook = _seam("fakelib.engine:Engine", "poll", "method", used_by=("tests/unit/connector/test_upgrade_check.py",))
    pinned = _tree(tmp_path / "pinned", PINNED)
    moved = {"fakelib/runner.py": "def run(engine):\n    return engine.results()\n"}
    findings = check(_tree(tmp_path / "candidate", {**PINNED, **moved}), pinned, "vllm", [hook], "fakelib")
    assert len(findings) == 1 and findings[0].problem.startswith("no longer called from fakelib.runner")
    assert "our override would never run" in findings[0].problem
    # A facade that hands the call on under the same name is no caller of its own.
    facade = {"fakelib/runner.py": "class Facade:\n    def poll(self):\n        return self.engine.poll()\n"}
    findings = check(_tree(tmp_path / "facade", {**PINNED, **facade}), pinned, "vllm", [hook], "fakelib")
    assert len(findings) == 1 and "no longer called" in findings[0].problem


def test_every_listed_seam_reads_the_same_from_source_as_installed():
    """The installed releases are the pinned ones: read from their source, every seam of vLLM and Ray holds (the
    import-based checks in test_seams.py agree), so a finding against another release is that release's."""
    for library in ("vllm", "ray"):
        installed = _installed(library)
        assert installed is not None, f"{library}: the installed release is not the pinned one"
        problems = [(s.where, p) for s in SEAMS if s.library == library and (p := seam_problem(installed, s))]
        assert problems == [], problems


def test_the_command_reads_an_unpacked_release_and_exits_1_on_findings(tmp_path, capsys):
    source = _tree(tmp_path / "release", {"vllm/__init__.py": ""})
    out = tmp_path / "report.md"
    assert main(["--source", str(source.root), "--library", "vllm", "--out", str(out)]) == 1
    text = out.read_text()
    assert text == capsys.readouterr().out and "| `NixlPushConnector.connector_scheduler` | instance | gone: module" in text
