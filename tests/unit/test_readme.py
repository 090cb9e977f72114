"""README.md stays true to the code: config reference, the two commands, CI, config paths."""

import re
from pathlib import Path

from app.config.args import reference_markdown

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
START = "<!-- config-reference:start -->"
END = "<!-- config-reference:end -->"


def _readme() -> str:
    return README.read_text()


def test_config_reference_matches_the_models():
    text = _readme()
    assert START in text and END in text, f"README.md must contain {START} and {END}"
    embedded = text.split(START, 1)[1].split(END, 1)[0].strip("\n")
    assert embedded == reference_markdown().strip("\n"), (
        "README.md's configuration reference is out of date: run `python -m app.config.args` and paste its output "
        f"between {START} and {END}"
    )


def test_readme_names_the_two_commands():
    text = _readme()
    assert "make serve" in text
    assert "make test" in text


def test_ci_runs_make_test():
    ci = REPO / ".ci" / "run"
    assert ci.is_file(), ".ci/run is missing"
    assert "make test" in ci.read_text()


def test_config_paths_in_readme_exist():
    paths = set(re.findall(r"configs/[\w./-]+?\.yaml", _readme()))
    assert paths, "README.md names no configs/*.yaml file"
    missing = sorted(p for p in paths if not (REPO / p).is_file())
    assert not missing, f"README.md names config files that do not exist: {missing}"
