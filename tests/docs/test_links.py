"""Every relative link in README.md and docs/ resolves: the file exists, and an anchor
(`page.md#section`, `#section`) names a heading of that page, as GitHub renders it.

Links to the web (`https:`, `mailto:`) are not fetched. Links inside fenced code blocks
and inline code are not links. An anchor into a file that is not Markdown is not checked
(GitHub's `#L10` line anchors).
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Pages the docsref branch writes (issue 32). Until it is merged, a link to one of them
# is accepted while the page is absent; once the page exists its links are checked like
# any other, and test_pending_pages_are_still_absent asks for this set to be emptied.
PENDING = frozenset(
    {
        "docs/architecture.md",
        "docs/client-contract.md",
        "docs/configuration.md",
        "docs/design.md",
        "docs/observability.md",
    }
)

_FENCE = re.compile(r"^\s*(```|~~~)")
_CODE_SPAN = re.compile(r"(`+).*?\1")
_INLINE_LINK = re.compile(
    r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)"
)
_REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)")
_HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.IGNORECASE)
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")


def pages(root: Path = REPO) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


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


def broken_links(page: Path, root: Path = REPO, pending: frozenset[str] = PENDING) -> list[str]:
    """One line per link of `page` that does not resolve, saying why."""
    text = page.read_text(encoding="utf-8")
    where = page.relative_to(root)
    problems = []
    for number, target in links(text):
        if not target or re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):
            continue  # a scheme: the web, mail
        path_part, _, anchor = target.partition("#")
        if path_part:
            resolved = (page.parent / path_part).resolve()
            try:
                name = resolved.relative_to(root.resolve()).as_posix()
            except ValueError:
                problems.append(f"{where}:{number}: {target} points outside the repository")
                continue
            if not resolved.exists():
                if name not in pending:
                    problems.append(f"{where}:{number}: {target}: no such file")
                continue
        else:
            resolved = page
        markdown = resolved.suffix == ".md" and resolved.is_file()
        if anchor and markdown and anchor not in anchors(resolved.read_text(encoding="utf-8")):
            problems.append(f"{where}:{number}: {target}: no heading '#{anchor}'")
    return problems


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_resolves(page: Path) -> None:
    assert broken_links(page) == []


def test_pending_pages_are_still_absent() -> None:
    # Once the docsref branch is merged, its pages exist: empty PENDING so that a link to
    # one of them is an error again when the page goes.
    present = sorted(name for name in PENDING if (REPO / name).exists())
    assert present == [], f"remove {present} from PENDING in {Path(__file__).name}"


def test_a_missing_file_a_missing_anchor_and_a_link_out_of_the_tree_are_reported(
    tmp_path: Path,
) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "ops.md").write_text("# Operations\n\n## Drain an engine\n")
    readme = tmp_path / "README.md"
    readme.write_text(
        "# Narwhal\n\n"
        "## Quick start B: real vLLM P/D\n\n"
        "See [ops](docs/ops.md#drain-an-engine) and [here](#quick-start-b-real-vllm-pd).\n"
        "[gone](docs/gone.md), [typo](docs/ops.md#drain), [self](#nowhere).\n"
        "[out](../elsewhere.md), [web](https://example.com/x#y), `[code](no.md)`\n"
        "```\n[fenced](no.md)\n```\n"
        "[ref]: docs/ref.md\n"
        "[later](docs/later.md)\n"
    )
    assert broken_links(readme, tmp_path, pending=frozenset({"docs/later.md"})) == [
        "README.md:6: docs/gone.md: no such file",
        "README.md:6: docs/ops.md#drain: no heading '#drain'",
        "README.md:6: #nowhere: no heading '#nowhere'",
        "README.md:7: ../elsewhere.md points outside the repository",
        "README.md:11: docs/ref.md: no such file",
    ]


@pytest.mark.parametrize(
    ("heading", "anchor"),
    [
        ("Quick start B: real vLLM P/D", "quick-start-b-real-vllm-pd"),
        ("9. The `narwhalctl` commands", "9-the-narwhalctl-commands"),
        ("Reload (SIGHUP, `narwhalctl reload`)", "reload-sighup-narwhalctl-reload"),
        ("Symptom → event → action", "symptom--event--action"),
        ("[Linked](x.md) heading", "linked-heading"),
    ],
)
def test_anchors_are_githubs(heading: str, anchor: str) -> None:
    assert anchor in anchors(f"# {heading}\n")


def test_a_repeated_heading_gets_a_numbered_anchor() -> None:
    assert anchors("## Run\n\n## Run\n\n## Run\n") == {"run", "run-1", "run-2"}
