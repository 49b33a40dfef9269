"""Every relative link in README.md, docs/ and tools/bench/README.md resolves: the file
exists, and an anchor (`page.md#section`, `#section`) names a heading of that page, as
GitHub renders it.

Links to the web (`https:`, `mailto:`) are not fetched. Links inside fenced code blocks
and inline code are not links. An anchor into a file that is not Markdown is not checked
(GitHub's `#L10` line anchors).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from .markdown import REPO, anchors, links, pages


def broken_links(page: Path, root: Path = REPO) -> list[str]:
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
                resolved.relative_to(root.resolve())
            except ValueError:
                problems.append(f"{where}:{number}: {target} points outside the repository")
                continue
            if not resolved.exists():
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
    assert broken_links(readme, tmp_path) == [
        "README.md:6: docs/gone.md: no such file",
        "README.md:6: docs/ops.md#drain: no heading '#drain'",
        "README.md:6: #nowhere: no heading '#nowhere'",
        "README.md:7: ../elsewhere.md points outside the repository",
        "README.md:11: docs/ref.md: no such file",
        "README.md:12: docs/later.md: no such file",
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
