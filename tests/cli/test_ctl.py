"""narwhalctl's own argument checks (the daemon side is tests/ops)."""

from __future__ import annotations

import pytest

from narwhal.cli import ctl


@pytest.mark.parametrize("timeout", ["-1", "0", "nan", "inf", "soon"])
def test_a_timeout_that_is_not_a_positive_number_is_a_usage_error(
    timeout: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # It used to reach socket.settimeout: a traceback (exit 1, "refused") or, for 0,
    # a non-blocking connect reported as a missing daemon.
    with pytest.raises(SystemExit) as exit_info:
        ctl.main(["--socket", "/nonexistent/ctl.sock", "--timeout", timeout, "state"])
    assert exit_info.value.code == ctl.EXIT_USAGE
    assert "argument --timeout:" in capsys.readouterr().err


def test_a_positive_timeout_reaches_the_socket(capsys: pytest.CaptureFixture[str]) -> None:
    assert ctl.main(["--socket", "/nonexistent/ctl.sock", "--timeout", "0.5", "state"]) == (
        ctl.EXIT_UNREACHABLE
    )
    assert "no control socket at /nonexistent/ctl.sock" in capsys.readouterr().err
