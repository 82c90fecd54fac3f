"""Every way the project sends a reader to its docs resolves.

- Markdown links `[text](target)` (and images) in README.md, docs/ and examples/: a relative
  target names a file or folder that exists, and its `#anchor` is the slug GitHub gives one of
  that page's headings. External (http, https, mailto) links are not followed.
- Prose references in the docs, the examples and the package's sources: `docs/NAME.md` names a
  page that exists, and `(NAME.md, Section)` (the form comments and docstrings use; Section
  capitalised) names the start of one of that page's headings.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"(`+)(.+?)\1", re.DOTALL)
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.+?)\s*#*\s*$", re.MULTILINE)
# [text](target) or [text](target "title"); the text may hold one level of brackets.
LINK = re.compile(r"\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)
PAGE_PATH = re.compile(r"(?<![\w./-])(docs/[\w./-]*\w\.md)\b")
# `(... NAME.md, Section words)`, capitalised as the heading: how comments and docstrings name a
# section (`(NAME.md, since replaced)` is a remark, not a section).
PAGE_SECTION = re.compile(r"(?<![\w./-])([\w./-]*\w\.md), ([A-Z][\w' -]*\w)\)")


def markdown_pages() -> list[Path]:
    pages = [REPO / "README.md", *(REPO / "docs").rglob("*.md"), *(REPO / "examples").rglob("*.md")]
    return sorted(pages)


def prose_files() -> list[Path]:
    files = list(markdown_pages())
    for folder, patterns in (
        ("megatron_rl", ("*.py",)),
        ("examples", ("*.yaml", "*.py", "*.sbatch", "*.sh")),
        ("scripts", ("*.sh", "*.py")),
    ):
        for pattern in patterns:
            files += (REPO / folder).rglob(pattern)
    return sorted(set(files))


def without_code(markdown: str) -> str:
    """The markdown with fenced blocks dropped and each inline code span one word (a link
    written as code is no link; a link whose text is code still is)."""
    return INLINE_CODE.sub("code", FENCE.sub("", markdown))


def heading_text(raw: str) -> str:
    """A heading as GitHub renders it to text: code spans, links and emphasis reduced."""
    text = INLINE_CODE.sub(lambda match: match.group(2), raw)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"<[^>]+>", "", text).strip()


def github_slug(text: str) -> str:
    """GitHub's anchor of a heading's rendered text: lower case, punctuation other than `-` and
    `_` dropped, each space a `-`."""
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def headings(markdown: str) -> list[str]:
    """The rendered text of every heading outside code blocks, in order."""
    return [heading_text(match.group(2)) for match in HEADING.finditer(FENCE.sub("", markdown))]


def anchors(markdown: str) -> set[str]:
    """Every heading's anchor; a repeated slug gets -1, -2, ... as on GitHub."""
    found: set[str] = set()
    for text in headings(markdown):
        slug = base = github_slug(text)
        repeat = 0
        while slug in found:
            repeat += 1
            slug = f"{base}-{repeat}"
        found.add(slug)
    return found


def broken_links(page: Path, repo: Path) -> list[str]:
    """One line per markdown link of `page` that does not resolve."""
    broken = []
    for match in LINK.finditer(without_code(page.read_text())):
        target = match.group(1)
        if not target or EXTERNAL.match(target):
            continue
        path_part, _, anchor = target.partition("#")
        linked = (page.parent / path_part).resolve() if path_part else page
        where = f"{page.relative_to(repo)}: ({target})"
        if not linked.exists():
            broken.append(f"{where}: no file {path_part}")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked.read_text()):
            broken.append(f"{where}: no heading of {linked.relative_to(repo)} has the anchor")
    return broken


def flattened(path: Path) -> str:
    """The file's text with line breaks (and a comment's continuing `#`) made single spaces, so
    that a reference wrapped over two lines reads as one."""
    return re.sub(r"\s*\n\s*(#+\s+)?", " ", path.read_text())


def broken_prose_references(path: Path, repo: Path) -> list[str]:
    """One line per `docs/NAME.md` that names no page, and per `(NAME.md, Section)` whose page
    has no heading starting with Section (case aside)."""
    text = flattened(path)
    where = path.relative_to(repo)
    broken = [
        f"{where}: {name}: no such page"
        for name in PAGE_PATH.findall(text)
        if not (repo / name).exists()
    ]
    for name, section in PAGE_SECTION.findall(text):
        page = next(
            (candidate for candidate in (repo / name, path.parent / name) if candidate.is_file()),
            None,
        )
        if page is None:
            broken.append(f"{where}: {name}, {section}: no such page")
            continue
        wanted = section.lower()
        if not any(
            title.lower() == wanted or title.lower().startswith(wanted + " ")
            for title in headings(page.read_text())
        ):
            broken.append(f"{where}: {name}, {section}: no heading of {name} starts so")
    return broken


def test_the_slug_is_githubs():
    assert github_slug("Other families: DeepSeek-V3 and GLM-4.5") == (
        "other-families-deepseek-v3-and-glm-45"
    )
    assert github_slug(heading_text("`model`: The policy, loaded into Megatron-Core.")) == (
        "model-the-policy-loaded-into-megatron-core"
    )
    assert github_slug("gspo_token") == "gspo_token"
    assert github_slug("Checkpoints, resume, export") == "checkpoints-resume-export"


def test_the_checker_finds_what_is_broken(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "guide.md").write_text(
        "# Guide\n\n## Metrics\n\n## Metrics\n\n```bash\n# Not a heading\n```\n\n"
        "[ok](#metrics-1) [ok](../README.md) [web](https://example.com/#x) `[code](nowhere.md)`\n"
        "[bad](#metrics-2) [bad](#not-a-heading) [gone](missing.md) [bad](guide.md#guide-1)\n"
    )
    (tmp_path / "README.md").write_text(
        "See (docs/guide.md, Metrics) and docs/gone.md (docs/guide.md, since removed).\n"
    )
    (tmp_path / "code.py").write_text(
        "# (docs/guide.md, Failures and\n#     recovery); (docs/guide.md, docs/README.md)\n"
    )
    assert broken_links(tmp_path / "docs" / "guide.md", tmp_path) == [
        "docs/guide.md: (#metrics-2): no heading of docs/guide.md has the anchor",
        "docs/guide.md: (#not-a-heading): no heading of docs/guide.md has the anchor",
        "docs/guide.md: (missing.md): no file missing.md",
        "docs/guide.md: (guide.md#guide-1): no heading of docs/guide.md has the anchor",
    ]
    assert broken_prose_references(tmp_path / "README.md", tmp_path) == [
        "README.md: docs/gone.md: no such page"
    ]
    assert broken_prose_references(tmp_path / "code.py", tmp_path) == [
        "code.py: docs/README.md: no such page",
        "code.py: docs/guide.md, Failures and recovery: no heading of docs/guide.md starts so",
    ]


@pytest.mark.parametrize("page", markdown_pages(), ids=lambda page: str(page.relative_to(REPO)))
def test_every_markdown_link_resolves(page):
    assert broken_links(page, REPO) == []


def test_every_prose_reference_to_the_docs_resolves():
    broken = [line for path in prose_files() for line in broken_prose_references(path, REPO)]
    assert broken == []
