"""The README and the docs stay true to the code: config reference, the two commands, CI, config paths."""

import re
from pathlib import Path

from app.config.args import reference_markdown

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
# The reference is generated from the models (`python -m app.config.args`); it lives in its own doc, linked from the README.
CONFIG_REFERENCE = REPO / "docs" / "configuration.md"
START = "<!-- config-reference:start -->"
END = "<!-- config-reference:end -->"
README_MAX_LINES = 200  # the front door: what it is, the commands, the diagrams, the words; the rest is in docs/


def _readme() -> str:
    return README.read_text()


def _docs() -> dict[Path, str]:
    """README.md and every doc under docs/ (docs/results holds measurements, not prose)."""
    paths = [README, *sorted((REPO / "docs").rglob("*.md"))]
    return {p: p.read_text() for p in paths if "results" not in p.relative_to(REPO).parts}


def test_config_reference_matches_the_models():
    text = CONFIG_REFERENCE.read_text()
    name = CONFIG_REFERENCE.relative_to(REPO)
    assert START in text and END in text, f"{name} must contain {START} and {END}"
    embedded = text.split(START, 1)[1].split(END, 1)[0].strip("\n")
    assert embedded == reference_markdown().strip("\n"), (
        f"{name}'s configuration reference is out of date: run `python -m app.config.args` and paste its output "
        f"between {START} and {END}"
    )


def test_the_config_reference_has_one_home():
    """A second copy would go stale unseen: only docs/configuration.md is checked against the models."""
    copies = sorted(str(p.relative_to(REPO)) for p, text in _docs().items() if START in text)
    assert copies == [str(CONFIG_REFERENCE.relative_to(REPO))], f"config reference markers found in {copies}"


def test_readme_names_the_two_commands():
    text = _readme()
    assert "make serve" in text
    assert "make test" in text


def test_readme_stays_a_front_door():
    lines = len(_readme().splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines (at most {README_MAX_LINES}): move the detail into docs/ and link to it"
    )


def test_ci_runs_make_test():
    ci = REPO / ".ci" / "run"
    assert ci.is_file(), ".ci/run is missing"
    assert "make test" in ci.read_text()


def test_config_paths_in_readme_exist():
    paths = set(re.findall(r"configs/[\w./-]+?\.yaml", _readme()))
    assert paths, "README.md names no configs/*.yaml file"
    missing = sorted(p for p in paths if not (REPO / p).is_file())
    assert not missing, f"README.md names config files that do not exist: {missing}"


def test_config_paths_in_docs_exist():
    missing = sorted(
        f"{doc.relative_to(REPO)}: {p}"
        for doc, text in _docs().items()
        for p in set(re.findall(r"configs/[\w./-]+?\.yaml", text))
        if not (REPO / p).is_file()
    )
    assert not missing, f"docs name config files that do not exist: {missing}"
