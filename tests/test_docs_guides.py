"""The guides stay guides: README.md and docs/*.md say how to use a part and what its options and
metrics mean. Measured runs are dated records under docs/benchmarks/, which a guide links to;
so no guide embeds a commit hash or a time of day, and none grows past about 500 lines."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.test_docs_links import REPO, without_code

# About 500 lines: a guide longer than this wants splitting, or its measurements a record.
MAX_GUIDE_LINES = 520
# A short commit hash or a longer one: hexadecimal, 7 to 40 digits, with a letter and a digit.
COMMIT = re.compile(r"(?<![\w./-])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![\w-])")
# A time of day (13:05, 05:42:10); a duration in a command (`--time 24:00:00`) is code.
HOUR = re.compile(r"(?<![\w:.])([01]?\d|2[0-3]):[0-5]\d(:[0-5]\d)?(?![\w:])")


def guides() -> list[Path]:
    return sorted([REPO / "README.md", *(REPO / "docs").glob("*.md")])


def dated_details(markdown: str) -> list[str]:
    """The commit hashes and times of day in `markdown`'s prose (code spans and blocks aside:
    a command's `--time 24:00:00` is no hour)."""
    prose = without_code(markdown)
    return [m.group(0) for m in COMMIT.finditer(prose)] + [m.group(0) for m in HOUR.finditer(prose)]


def test_the_checker_finds_hashes_and_hours_and_spares_code():
    text = (
        "Measured at 85f7671 and 3e25bff, 2026-12-02 05:42 UTC (13:05:10 the rerun).\n"
        "`--time 24:00:00` and\n```\nsbatch --time 01:00:00\n```\n"
        "Not hashes: deadbeef, 1234567, a 0.0003 rate, ratio 1:2, the 3e-4 rate, fine_qwen3_e128.\n"
    )
    assert dated_details(text) == ["85f7671", "3e25bff", "05:42", "13:05:10"]


@pytest.mark.parametrize("guide", guides(), ids=lambda page: str(page.relative_to(REPO)))
def test_a_guide_embeds_no_commit_hash_or_hour(guide):
    assert dated_details(guide.read_text()) == [], "move the measurement to docs/benchmarks/"


@pytest.mark.parametrize("guide", guides(), ids=lambda page: str(page.relative_to(REPO)))
def test_a_guide_stays_short(guide):
    assert len(guide.read_text().splitlines()) <= MAX_GUIDE_LINES
