"""CHANGELOG.md is release notes: an [Unreleased] section, dated versions newest first, short
entries, and a newest release that is the latest `v*` git tag.

A clone without tags (a shallow CI checkout, a tarball) is legitimate: the tag comparison is
skipped there, and the tag reading is tested on a throwaway repository instead.
"""

from __future__ import annotations

import datetime
import pathlib
import re
import shutil
import subprocess

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
CHANGELOG = REPO / "CHANGELOG.md"
RELEASE = re.compile(r"^## \[(\d+)\.(\d+)\.(\d+)\] - (\d{4}-\d{2}-\d{2})$")
VERSION_TAG = re.compile(r"^v(\d+)\.(\d+)\.(\d+)$")
MAX_ENTRY_LINES = 3

Version = tuple[int, int, int]


def _sections(text: str) -> list[tuple[int, str]]:
    """The `## ` headings with their line numbers."""
    return [
        (number, line) for number, line in enumerate(text.splitlines(), 1) if line.startswith("## ")
    ]


def _releases(text: str) -> list[tuple[Version, datetime.date]]:
    releases = []
    for _, heading in _sections(text):
        if match := RELEASE.match(heading):
            major, minor, patch, date = match.groups()
            version = (int(major), int(minor), int(patch))
            releases.append((version, datetime.date.fromisoformat(date)))
    return releases


def _entries(text: str) -> list[tuple[int, list[str]]]:
    """Each `- ` bullet with the indented lines that continue it, by its first line's number."""
    entries: list[tuple[int, list[str]]] = []
    open_entry = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("- "):
            entries.append((number, [line]))
            open_entry = True
        elif open_entry and line.startswith("  ") and line.strip():
            entries[-1][1].append(line)
        else:
            open_entry = False
    return entries


def _latest_version_tag(repo: pathlib.Path) -> Version | None:
    """The highest `vX.Y.Z` tag reachable from HEAD; None when there is none."""
    proc = subprocess.run(
        ["git", "-C", str(repo), "tag", "--merged", "HEAD", "--list", "v*"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    versions = [
        (int(m[1]), int(m[2]), int(m[3]))
        for tag in proc.stdout.split()
        if (m := VERSION_TAG.match(tag))
    ]
    return max(versions, default=None)


def test_the_first_section_is_unreleased_and_every_other_is_a_dated_version() -> None:
    sections = _sections(CHANGELOG.read_text())
    assert sections, "CHANGELOG.md has no `## ` section"
    assert sections[0][1] == "## [Unreleased]"
    bad = [f"line {n}: {heading}" for n, heading in sections[1:] if not RELEASE.match(heading)]
    assert not bad, "not `## [X.Y.Z] - YYYY-MM-DD`: " + "; ".join(bad)
    assert len(sections) > 1, "no released version under [Unreleased]"


def test_released_versions_are_newest_first() -> None:
    releases = _releases(CHANGELOG.read_text())
    versions = [version for version, _ in releases]
    assert versions == sorted(set(versions), reverse=True), versions
    dates = [date for _, date in releases]
    assert dates == sorted(dates, reverse=True), dates


def test_no_entry_is_longer_than_three_lines() -> None:
    long = [
        f"line {number} ({len(lines)} lines): {lines[0][:60]}"
        for number, lines in _entries(CHANGELOG.read_text())
        if len(lines) > MAX_ENTRY_LINES
    ]
    assert not long, "release notes, not history:\n" + "\n".join(long)


def test_an_entry_ends_at_a_blank_line_a_heading_or_the_next_entry() -> None:
    text = "## [Unreleased]\n- one\n  two\n- three\n\n  not a continuation\n### X\n- four\n"
    assert _entries(text) == [(2, ["- one", "  two"]), (4, ["- three"]), (8, ["- four"])]


@pytest.mark.skipif(
    not (REPO / ".git").exists() or shutil.which("git") is None,
    reason="not a git checkout, or no git",
)
def test_the_newest_release_is_the_latest_version_tag() -> None:
    tag = _latest_version_tag(REPO)
    if tag is None:
        pytest.skip("no v* tag reachable from HEAD: a clone without tags is legitimate")
    newest = _releases(CHANGELOG.read_text())[0][0]
    assert newest == tag, (
        f"CHANGELOG's newest release is {'.'.join(map(str, newest))}, "
        f"the latest tag v{'.'.join(map(str, tag))}"
    )


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_the_latest_version_tag_is_compared_by_version_and_reachable_from_head(
    tmp_path: pathlib.Path,
) -> None:
    def git(*args: str) -> None:
        subprocess.run(
            ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", *args],
            capture_output=True,
            timeout=30,
            check=True,
        )

    git("init", "-q", "-b", "main")
    git("commit", "-q", "--allow-empty", "-m", "one")
    assert _latest_version_tag(tmp_path) is None
    for tag in ("v0.9.0", "v0.10.0", "v1.0.0rc1", "release-2"):
        git("tag", tag)
    git("checkout", "-q", "-b", "later")
    git("commit", "-q", "--allow-empty", "-m", "two")
    git("tag", "v0.11.0")
    git("checkout", "-q", "main")
    assert _latest_version_tag(tmp_path) == (0, 10, 0)
