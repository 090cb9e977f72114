"""Every relative link in the repository's markdown resolves: to a file that exists and, for ``#anchor``
links into markdown, to a heading there. Docs move (the README's detail went to docs/); a link that
silently points nowhere is how a reader gets lost."""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import unquote

import pytest

REPO = Path(__file__).resolve().parents[2]
SKIP_DIRS = {".git", ".venv", ".tools", "node_modules", ".pytest_cache"}

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
INLINE_CODE = re.compile(r"`+[^`]*`+")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.IGNORECASE)


def _markdown_files() -> list[Path]:
    """The repository's own markdown: installed packages and caches are pruned, not walked (.venv is large)."""
    found = []
    for root, dirs, files in os.walk(REPO):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
        found += [Path(root) / f for f in files if f.endswith(".md")]
    return sorted(found)


def _prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks (a `# comment` in a shell block is not a heading)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation removed, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)  # \w is Unicode-aware, as GitHub's is
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor GitHub makes in a markdown file: heading slugs (repeats get -1, -2, ...) and HTML anchors."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    for line in _prose_lines(path.read_text()):
        found.update(HTML_ANCHOR.findall(line))
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(path: Path) -> list[str]:
    """The link targets in a markdown file's prose (inline links, images and reference definitions)."""
    targets = []
    for line in _prose_lines(path.read_text()):
        stripped = INLINE_CODE.sub("", line)
        targets += INLINE_LINK.findall(stripped)
        match = REFERENCE_DEF.match(stripped)
        if match:
            targets.append(match.group(1))
    return targets


def _is_relative(target: str) -> bool:
    return not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE) and not target.startswith("//")


def broken_links(path: Path, root: Path = REPO) -> list[str]:
    broken = []
    for target in links(path):
        if not _is_relative(target):
            continue
        file_part, _, anchor = target.partition("#")
        dest = path if not file_part else (path.parent / unquote(file_part)).resolve()
        where = f"{path.relative_to(root)}: ({target})"
        if not dest.exists():
            broken.append(f"{where}: no such file")
        elif anchor and dest.suffix == ".md" and unquote(anchor).lower() not in anchors(dest):
            broken.append(f"{where}: no heading with anchor #{anchor} in {os.path.relpath(dest, root)}")
    return broken


MARKDOWN = _markdown_files()


def test_the_docs_are_found():
    names = {str(p.relative_to(REPO)) for p in MARKDOWN}
    assert "README.md" in names and any(n.startswith("docs/") for n in names), names


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(path):
    broken = broken_links(path)
    assert not broken, "broken links:\n" + "\n".join(broken)


@pytest.mark.parametrize(
    "heading, expected",
    [
        ("How a request flows", "how-a-request-flows"),
        ("Push mode (`mode: push`, the default)", "push-mode-mode-push-the-default"),
        ("When the handoff fails: the fallback ladder", "when-the-handoff-fails-the-fallback-ladder"),
        ("One machine: `make serve-cluster`", "one-machine-make-serve-cluster"),
        ("Upgrading vLLM or Ray", "upgrading-vllm-or-ray"),
        ("Conversations (`conversation_id`)", "conversations-conversation_id"),
        ("Time by module", "time-by-module"),
    ],
)
def test_slug_is_githubs(heading, expected):
    assert slug(heading) == expected


def test_a_broken_link_and_a_missing_anchor_are_caught(tmp_path):
    (tmp_path / "a.md").write_text("# Title\n\n```sh\n# not a heading\n```\n\n## Same\n\n## Same\n")
    doc = tmp_path / "b.md"
    doc.write_text(
        "[ok](a.md) [ok](a.md#title) [ok](a.md#same-1) [ok](#here)\n\n# Here\n\n"
        "[gone](missing.md) [no anchor](a.md#not-a-heading) `[code](nowhere.md)` [web](https://example.com)\n"
    )
    broken = broken_links(doc, root=tmp_path)
    assert len(broken) == 2, broken
    assert "missing.md" in broken[0] and "not-a-heading" in broken[1]
