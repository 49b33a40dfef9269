"""narwhalctl's own argument checks (the daemon side is tests/ops)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from narwhal._records import to_json
from narwhal.cli import ctl
from narwhal.config import diff, load_config
from narwhal.supervisor._reload import ReloadResult


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
    assert "(--socket): /nonexistent/ctl.sock: no such file" in capsys.readouterr().err


def test_json_output_says_the_daemon_is_unreachable(capsys: pytest.CaptureFixture[str]) -> None:
    # A script reading stdout got nothing at all.
    assert ctl.main(["--socket", "/nonexistent/ctl.sock", "--json", "state"]) == (
        ctl.EXIT_UNREACHABLE
    )
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is False
    assert out["error"]["code"] == "daemon_unreachable"
    assert "/nonexistent/ctl.sock: no such file" in out["error"]["message"]
    assert out["error"]["tried"] == [
        {"path": "/nonexistent/ctl.sock", "source": "--socket", "reason": "missing"}
    ]


def test_config_is_read_for_its_control_socket_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # `systemctl reload` runs `narwhalctl --config FILE reload`: a file the daemon would
    # reject must still reach the daemon, which reports every problem. It used to be
    # checked in full here, so the daemon never heard of it (exit 2, usage error).
    path = tmp_path / "narwhal.json"
    socket = tmp_path / "ctl.sock"
    path.write_text(json.dumps({"serving": {"max_connections": 0}, "ctl": {"socket": str(socket)}}))
    assert ctl.main(["--config", str(path), "reload"]) == ctl.EXIT_UNREACHABLE
    assert f"(ctl.socket of {path}): {socket}: no such file" in capsys.readouterr().err
    # ... but a control socket it cannot use is a usage error naming the field.
    path.write_text(json.dumps({"ctl": {"socket": ""}, "bogus": 1}))
    with pytest.raises(SystemExit) as exit_info:
        ctl.main(["--config", str(path), "reload"])
    assert exit_info.value.code == ctl.EXIT_USAGE
    assert capsys.readouterr().err == (
        f'narwhalctl: cannot use --config {path}:\n  ctl.socket: "" must not be empty\n'
    )


def test_the_socket_is_looked_for_where_the_operator_named_it_else_at_the_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "narwhal.json"
    config.write_text(json.dumps({"ctl": {"socket": "ctl.sock"}}))
    monkeypatch.chdir("/")

    def tried(*argv: str, **environ: str) -> list[tuple[str, str]]:
        return ctl.socket_candidates(ctl._parser().parse_args([*argv, "state"]), environ)

    env = {"NARWHAL_CTL_SOCKET": "/e/ctl.sock", "NARWHAL_CONFIG": "/nonexistent.json"}
    assert tried("--socket", "s.sock", **env) == [("/s.sock", "--socket")]
    assert tried("--config", str(config), **env) == [
        (f"{tmp_path}/ctl.sock", f"ctl.socket of {config}")
    ]
    assert tried(**env) == [("/e/ctl.sock", "$NARWHAL_CTL_SOCKET")]
    assert tried(NARWHAL_CONFIG=str(config)) == [
        (f"{tmp_path}/ctl.sock", f"ctl.socket of {config}")
    ]
    assert tried() == [
        ("/run/narwhal/narwhal.sock", "the packaged default"),
        ("/runs/narwhal.sock", "runs/narwhal.sock in the current directory"),
    ]
    # The packaged default is the example config's, which the systemd unit and the
    # container image use.
    packaged = json.loads((Path(__file__).parents[2] / "conf" / "narwhal.json").read_text())
    assert packaged["ctl"]["socket"] == ctl.PACKAGED_SOCKET


def test_a_reload_counts_applied_changes_apart_from_those_that_need_a_restart() -> None:
    running = load_config({"engines": [{"id": "a", "url": "http://127.0.0.1:9"}]})
    new = load_config(
        {
            "engines": [{"id": "a", "url": "http://127.0.0.1:9"}],
            "listen": {"port": 9000},
            "controller": {"enabled": False},
        }
    )
    result = ReloadResult(True, "/etc/narwhal/narwhal.json", plan=diff(running, new))
    # It read "reloaded ...: 2 change(s)" though nothing was applied.
    assert ctl._human("reload", to_json(result.report())).splitlines() == [
        "reloaded /etc/narwhal/narwhal.json: 0 change(s) applied, 2 need a restart",
        "  listen.port: 8000 -> 9000 (needs a restart; the running value stays in force)",
        "  controller.enabled: true -> false (needs a restart; the running value stays in force)",
    ]
    applied = load_config(
        {"engines": [{"id": "a", "url": "http://127.0.0.1:9"}], "slo": {"ttft_s": 1.0}}
    )
    result = ReloadResult(True, "n.json", plan=diff(running, applied))
    assert ctl._human("reload", to_json(result.report())).splitlines() == [
        "reloaded n.json: 1 change(s) applied",
        "  slo.ttft_s: 0.5 -> 1.0",
    ]
