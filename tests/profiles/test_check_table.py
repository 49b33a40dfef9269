"""narwhal-check's table: it fits a 100-column terminal and ends with a count of results."""

from __future__ import annotations

from narwhal.probe import format_table
from narwhal.probe._check import CheckRow

ROWS = [
    CheckRow("health", "prefill-engine-0", "pass", "200 in 0.004 s", "200"),
    CheckRow(
        "first-token",
        "prefill-engine-0 -> decode-engine-1",
        "fail",
        "p99 3.2 s over 24 crossed handoffs",
        "< 2.5 s (engine.first_token_timeout_s)",
        "from check and profile; raise engine.first_token_timeout_s above the measured "
        "p99 or find why the decode engine pulls the KV cache slowly",
    ),
    CheckRow("lease", "decode-engine-1", "warn", "verified >= 30 s", "> 12 s", "short"),
    CheckRow("profile", "fleet", "skip", "", "", "no profile store; run narwhal-profile"),
]


def test_the_table_fits_100_columns_and_wraps_long_cells_in_their_column() -> None:
    lines = format_table(ROWS).splitlines()
    assert max(len(line) for line in lines) <= 100, "\n".join(lines)
    # A row this long leaves no room for notes beside it: they go under their rows.
    assert lines[0].split() == ["check", "engine/pair", "result", "measured", "limit"]
    assert lines[1] == "    note"
    # Nothing is cut: every word of the long note is still there, in the note column.
    text = " ".join(lines)
    words = text.split()
    for word in ROWS[1].note.split():
        assert word in words
    assert "(engine.first_token_timeout_s)" in words


def test_short_notes_stay_beside_their_row() -> None:
    lines = format_table(ROWS[:1] + ROWS[2:]).splitlines()
    assert lines[0].split() == ["check", "engine/pair", "result", "measured", "limit", "note"]
    assert lines[2].split()[-1] == "short"


def test_the_table_ends_with_a_one_line_summary() -> None:
    assert format_table(ROWS).splitlines()[-1] == "4 checks: 1 pass, 1 fail, 1 warn, 1 skip"
