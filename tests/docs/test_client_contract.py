"""docs/client-contract.md lists exactly the error codes the daemon can emit, with the
statuses the source gives them, and its stream table names only codes of that list."""

from __future__ import annotations

import ast
import re
import textwrap

import pytest

from narwhal._codes import ErrorCode
from narwhal._errors import NarwhalError
from narwhal.serving._failure import FAILURE_POLICY, classify_status

from .markdown import code_spans, read, table
from .sources import REPO, UnreadableSource, error_codes

PAGE = "client-contract.md"


def _codes_table() -> dict[str, dict[str, str]]:
    rows = table(read(PAGE), "Error codes").rows
    return {code_spans(row["Code"])[0]: row for row in rows}


def _statuses(cell: str) -> set[int]:
    return {int(number) for number in re.findall(r"\b[1-5]\d\d\b", cell)}


def test_the_table_lists_every_code_the_daemon_can_emit() -> None:
    emitted = error_codes()
    documented = _codes_table()
    missing = {code: use.sites[0] for code, use in emitted.items() if code not in documented}
    assert not missing, f"emitted, not in docs/{PAGE} (code: first site): {missing}"


def test_the_table_names_no_code_the_daemon_cannot_emit() -> None:
    extra = set(_codes_table()) - set(error_codes())
    assert not extra, f"docs/{PAGE} lists codes nothing emits: {sorted(extra)}"


def test_each_code_has_the_statuses_the_source_gives_it() -> None:
    documented = _codes_table()
    wrong = {
        code: (sorted(use.statuses), documented[code]["Status"])
        for code, use in error_codes().items()
        if code in documented and not use.statuses <= _statuses(documented[code]["Status"])
    }
    assert not wrong, f"code: (statuses in the source, the page's Status cell): {wrong}"


def test_terminal_stream_events_are_codes_of_the_table_with_their_statuses() -> None:
    documented = _codes_table()
    for row in table(read(PAGE), "Streams").rows:
        for code in code_spans(row["Terminal event `code`"]):
            assert code in documented, code
            assert _statuses(row["`status`"]) <= _statuses(documented[code]["Status"]), code


# ------------------------------------------------------------------ the collector


def _codes_in(source: str) -> dict[str, set[int]]:
    tree = ast.parse(textwrap.dedent(source))
    return {
        code: use.statuses
        for code, use in error_codes([(REPO / "narwhal" / "example.py", tree)]).items()
    }


ERRORS = """
    class ErrorCode(enum.StrEnum):
        INTERNAL_ERROR = "internal_error"
        OVERLOADED = "overloaded"
        QUEUE_FULL = "queue_full"
        HEAD_TOO_LARGE = "head_too_large"
        BAD_ENCODING = "bad_encoding"
        ENGINE_FAILED = "engine_failed"
        ENGINE_HTTP = "engine_http_<status>"
        HANDOFF_EXPIRED = "handoff_expired"
    class NarwhalError(Exception):
        status = 500
        default_code = ErrorCode.INTERNAL_ERROR
    class Refused(NarwhalError):
        status = 429
        default_code = ErrorCode.OVERLOADED
"""


def test_the_collector_follows_members_defaults_tables_rows_and_helpers() -> None:
    found = _codes_in(
        ERRORS
        + """
    TABLE = {431: ErrorCode.HEAD_TOO_LARGE, 501: ErrorCode.BAD_ENCODING}
    FAILED = ErrorCode.ENGINE_FAILED
    def _failed(engine, phase, code, *, status=502): ...
    class Rule:
        code: ErrorCode
        status: int | None
    POLICY = {
        1: Rule(ErrorCode.HANDOFF_EXPIRED, 503),
        2: Rule(ErrorCode.ENGINE_HTTP, FROM_ENGINE),
        3: Rule(ErrorCode.ENGINE_HTTP, 429),
    }
    def refuse(status):
        raise Refused("full", code=ErrorCode.QUEUE_FULL)
        raise Refused("plain")
        raise _failed(engine, "decode", FAILED, status=504)
        raise _failed(engine, "decode", ErrorCode.ENGINE_HTTP.with_status(status))
        raise NarwhalError("head", code=TABLE[431])
    """
    )
    assert found == {
        "queue_full": {429},
        "overloaded": {429},
        "engine_failed": {504},
        "engine_http_<status>": {502, 429},
        "handoff_expired": {503},
        "head_too_large": {500},
    }


@pytest.mark.parametrize("code", ["'queue_full'", "f'engine_http_{status}'"])
def test_the_collector_refuses_a_code_written_as_a_string(code: str) -> None:
    with pytest.raises(UnreadableSource, match=r"example\.py:\d+: .* written as a string"):
        _codes_in(ERRORS + f"    Refused('x', code={code})\n")


def test_the_collector_refuses_a_code_the_enum_does_not_have() -> None:
    with pytest.raises(UnreadableSource, match=r"`ErrorCode\.QUEUE_EMPTY` is not a member"):
        _codes_in(ERRORS + "    Refused('x', code=ErrorCode.QUEUE_EMPTY)\n")


def test_the_collector_refuses_a_code_it_cannot_read() -> None:
    with pytest.raises(UnreadableSource, match=r"example\.py:\d+: .*`pick\(\)`"):
        _codes_in(ERRORS + "    Refused('x', code=pick())\n")


def test_every_member_of_the_enum_is_emitted_or_an_error_class_default() -> None:
    def classes(cls: type[NarwhalError]) -> list[type[NarwhalError]]:
        return [cls, *(sub for child in cls.__subclasses__() for sub in classes(child))]

    defaults = {cls.default_code for cls in classes(NarwhalError)}
    idle = set(ErrorCode) - set(error_codes()) - defaults
    assert not idle, f"members of ErrorCode that nothing emits: {sorted(idle)}"


def test_the_retries_column_is_the_failure_policys() -> None:
    """What the page says Narwhal retries is what serving/_failure.py's table says."""
    documented = _codes_table()
    wrong = {
        f"{kind.name} ({rule.code})": documented[rule.code]["Narwhal retries"]
        for kind, rule in FAILURE_POLICY.items()
        if rule.code is not ErrorCode.ENGINE_HTTP
        and documented[rule.code]["Narwhal retries"] != ("yes" if rule.retry else "no")
    }
    assert not wrong, f"kind (code): the page's cell, against the table: {wrong}"
    # An engine's status passed on is retried for the statuses its row lists.
    retried = {
        status
        for status in range(100, 600)
        if status != 200
        and FAILURE_POLICY[kind := classify_status(status)].retry
        and FAILURE_POLICY[kind].code is ErrorCode.ENGINE_HTTP
    }
    cell = documented[ErrorCode.ENGINE_HTTP]["Narwhal retries"]
    listed = set()
    for low, high in re.findall(r"\b([1-5]\d\d)(?:-([1-5]\d\d))?\b", cell):
        listed |= set(range(int(low), int(high or low) + 1))
    assert retried == listed, cell
