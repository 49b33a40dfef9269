"""Reading the docs' Markdown the way the docs tests need: tables by heading, sentences,
headings' anchors as GitHub renders them, and links outside code."""

from __future__ import annotations

import re
import unicodedata
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


_FENCE = re.compile(r"^\s*(```|~~~)")
_CODE_SPAN = re.compile(r"(`+).*?\1")
_INLINE_LINK = re.compile(
    r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)"
)
_REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)")
_HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.IGNORECASE)
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")


def pages(root: Path = REPO) -> list[Path]:
    """The documents a reader is sent to: README.md, docs/, and the benchmarks' command
    reference, which links into docs/benchmarks.md by heading."""
    bench = root / "tools" / "bench" / "README.md"
    return [root / "README.md", *sorted((root / "docs").rglob("*.md")), bench]


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    lines = []
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces
    to hyphens (letters, digits, `_` and `-` are kept)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = text.replace("`", "").strip().lower()
    kept = (c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return "".join(kept).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors a page offers: its headings' slugs (a repeated one gets -1, -2, ...)
    and explicit `<a name=...>`/`<a id=...>` targets."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in _prose_lines(text):
        heading = _HEADING.match(line)
        if heading:
            base = slug(heading.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
        found.update(_HTML_ANCHOR.findall(line))
    return found


def links(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every inline or reference-definition link in prose."""
    found: list[tuple[int, str]] = []
    for number, line in _prose_lines(text):
        prose = _CODE_SPAN.sub("", line)
        found.extend((number, target) for target in _INLINE_LINK.findall(prose))
        reference = _REFERENCE.match(prose)
        if reference:
            found.append((number, reference.group(1)))
    return found


def doc_paths() -> list[Path]:
    return sorted(DOCS.glob("*.md"))
