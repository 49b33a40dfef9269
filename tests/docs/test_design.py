"""The code cites docs/design.md by anchor, and every anchor it cites exists; no comment
cites the unshipped manual's numbered sections; the reference pages' table cells stay
short. (Links are checked for every page by test_links.py.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from .markdown import anchors, read, sentences, tables
from .sources import PACKAGE, REPO

# `docs/design.md#a`, and further anchors of the same citation: `docs/design.md#a, #b`.
_CITATION = re.compile(r"docs/design\.md((?:#[a-z0-9-]+)(?:,\s+#[a-z0-9-]+)*)")
_MANUAL = re.compile(r"\b[Mm]anual (?:chapter |ch\. )?\d|§\s?\d|engine-protocols|shared/notes")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
PAGES = (
    "configuration.md",
    "client-contract.md",
    "observability.md",
    "architecture.md",
    "design.md",
)


def _sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _citations() -> dict[str, list[str]]:
    """Anchor -> where the code cites it."""
    cited: dict[str, list[str]] = {}
    for path in _sources():
        text = path.read_text(encoding="utf-8")
        for match in _CITATION.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            for anchor in re.findall(r"#([a-z0-9-]+)", match.group(1)):
                cited.setdefault(anchor, []).append(f"{path.relative_to(REPO)}:{line}")
    return cited


def test_every_anchor_the_code_cites_is_in_the_design_page() -> None:
    present = anchors(read("design.md"))
    missing = {anchor: sites[0] for anchor, sites in _citations().items() if anchor not in present}
    assert not missing, f"cited, not in docs/design.md: {missing}"


def test_the_code_cites_the_design_page() -> None:
    assert len(_citations()) >= 10


def test_no_comment_cites_a_document_that_does_not_ship() -> None:
    found = [
        f"{path.relative_to(REPO)}:{number}: {line.strip()}"
        for path in _sources()
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1)
        if _MANUAL.search(line)
    ]
    assert not found, "cite docs/design.md#anchor instead:\n" + "\n".join(found)


@pytest.mark.parametrize("page", [page for page in PAGES if page != "configuration.md"])
def test_table_cells_stay_within_two_sentences(page: str) -> None:
    """(The generated reference has its own test, which says where the rest goes.)"""
    long = [
        f"{table.heading}: {cell[:60]}..."
        for table in tables(read(page))
        for row in table.rows
        for cell in row.values()
        if len(sentences(cell)) > 2
    ]
    assert not long, f"docs/{page}: {long}"
