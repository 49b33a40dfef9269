"""Reading the docs' Markdown the way the docs tests need: tables by heading, sentences,
anchors."""

from __future__ import annotations

import re
from pathlib import Path

import attrs

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"

_CODE = re.compile(r"`[^`]*`")
_LINK = re.compile(r"\[([^\]]*)\]\([^)]*\)")
# A sentence ends at . ! or ? followed by a space and what can start one: a capital,
# a digit, a quote, inline code, or a parenthesis opening a sentence.
_BOUNDARY = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"']|CODE|\([A-Z])")
_CELL_SPLIT = re.compile(r"(?<!\\)\|")


@attrs.frozen
class Table:
    heading: str
    """The nearest heading above the table, without its #s."""
    columns: tuple[str, ...]
    rows: tuple[dict[str, str], ...]

    def column(self, name: str) -> list[str]:
        return [row[name] for row in self.rows]


def read(name: str) -> str:
    return (DOCS / name).read_text(encoding="utf-8")


def tables(text: str) -> list[Table]:
    """Every pipe table in `text`, cells stripped, `\\|` kept as written."""
    found: list[Table] = []
    heading = ""
    lines = text.splitlines()
    index = 0
    while index < len(lines):
        line = lines[index]
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        is_head = (
            line.startswith("|")
            and index + 1 < len(lines)
            and re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", lines[index + 1].strip()) is not None
        )
        if not is_head:
            index += 1
            continue
        columns = tuple(_cells(line))
        rows: list[dict[str, str]] = []
        index += 2
        while index < len(lines) and lines[index].startswith("|"):
            cells = _cells(lines[index])
            assert len(cells) == len(columns), f"{heading}: row {lines[index]!r} has {cells}"
            rows.append(dict(zip(columns, cells, strict=True)))
            index += 1
        found.append(Table(heading, columns, tuple(rows)))
    return found


def table(text: str, heading: str) -> Table:
    """The one table under `heading`."""
    (only,) = (t for t in tables(text) if t.heading == heading)
    return only


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in _CELL_SPLIT.split(line.strip())[1:-1]]


def code_spans(cell: str) -> list[str]:
    """The inline code in a cell, without backticks: "`a`, `b`" -> ["a", "b"]."""
    return [span.strip("`") for span in _CODE.findall(cell)]


def sentences(text: str) -> list[str]:
    """`text` cut into sentences. Inline code and link targets cannot end one."""
    plain = _CODE.sub("CODE", _LINK.sub(r"\1", text)).strip()
    return [part for part in _BOUNDARY.split(plain) if part.strip()] if plain else []


def anchors(text: str) -> set[str]:
    """Explicit `<a id="...">` anchors and GitHub's heading slugs."""
    found = set(re.findall(r'<a id="([^"]+)"', text))
    for line in text.splitlines():
        if line.startswith("#"):
            found.add(slug(line.lstrip("#").strip()))
    return found


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to -."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def doc_paths() -> list[Path]:
    return sorted(DOCS.glob("*.md"))
