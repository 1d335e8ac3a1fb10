"""The user's pages (README.md and offline_docs/*.md) speak of the product, not of its development: no issue
numbers. A reader on an air-gapped site has no issue tracker; what a page says must stand on its own."""

from __future__ import annotations

import re
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent
PAGES = [CHECKOUT / "README.md", *sorted((CHECKOUT / "offline_docs").glob("*.md"))]
ISSUE = re.compile(r"\bissues?\s*#?\d+|\(#\d+\)", re.IGNORECASE)


def issue_numbers(text: str) -> list[str]:
    """Each line of `text` that names an issue by its number."""
    return [line.strip() for line in text.splitlines() if ISSUE.search(line)]


def test_the_pattern_sees_issue_numbers_and_nothing_else() -> None:
    assert issue_numbers("Served packed (issue 42).\nSee issues 42, 44.\nfixed in #12 (#12)\nIssue #7") == [
        "Served packed (issue 42).", "See issues 42, 44.", "fixed in #12 (#12)", "Issue #7"]  # fmt: skip
    assert issue_numbers("the issuer and its subject\n42 issues\nan issue of scale, 2 bytes") == []


def test_user_pages_name_no_issue_numbers() -> None:
    assert len(PAGES) > 10, PAGES
    found = {page.name: lines for page in PAGES if (lines := issue_numbers(page.read_text(encoding="utf-8")))}
    assert not found, found
