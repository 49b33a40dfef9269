"""diff(old, new) -> ReloadPlan: what a reload changes and how it applies."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs

from narwhal._records import to_json
from narwhal.config import RESTART_REQUIRED, Config, diff, keep_running, load_config


def config(**sections: Any) -> Config:
    document: dict[str, Any] = {
        "engines": [
            {"id": "p0", "url": "http://127.0.0.1:9001", "role": "prefill"},
            {"id": "d0", "url": "http://127.0.0.1:9002", "role": "decode"},
        ]
    }
    document.update(sections)
    return load_config(document)


def test_identical_configs_give_an_empty_plan() -> None:
    plan = diff(config(), config())
    assert plan.empty
    assert plan.summary() == []


def test_settings_apply_in_place_with_dotted_paths() -> None:
    plan = diff(
        config(),
        config(serving={"max_connections": 64, "request_timeout_s": 30.0}, log={"level": "debug"}),
    )
    assert plan.summary() == [
        'log.level: "info" -> "debug"',
        "serving.max_connections: 512 -> 64",
        "serving.request_timeout_s: 600.0 -> 30.0",
    ]
    assert plan.restart_required == ()
    assert not plan.engines_added
    assert not plan.engines_removed


def test_turning_the_controller_on_or_off_needs_a_restart() -> None:
    plan = diff(config(), config(controller={"enabled": False}))
    assert [c.path for c in plan.restart_required] == ["controller.enabled"]
    assert plan.changes == ()


def test_listen_and_ctl_socket_need_a_restart() -> None:
    plan = diff(config(), config(listen={"port": 9999}, ctl={"socket": "/run/n.sock"}))
    assert [c.path for c in plan.restart_required] == ["listen.port", "ctl.socket"]
    assert plan.changes == ()
    assert plan.summary() == [
        "listen.port: 8000 -> 9999 (needs a restart; the running value stays in force)",
        'ctl.socket: "runs/narwhal.sock" -> "/run/n.sock" (needs a restart; the running value '
        "stays in force)",
    ]


def test_engines_added_removed_replaced_reconfigured_by_id() -> None:
    old = load_config(
        {
            "engines": [
                {"id": "p0", "url": "http://127.0.0.1:9001", "role": "prefill"},
                {"id": "p1", "url": "http://127.0.0.1:9003", "role": "prefill"},
                {"id": "d0", "url": "http://127.0.0.1:9002", "role": "decode"},
                {"id": "d1", "url": "http://127.0.0.1:9004", "role": "decode"},
            ]
        }
    )
    new = load_config(
        {
            "engines": [
                {"id": "p0", "url": "http://127.0.0.1:9001", "role": "decode"},
                {"id": "d0", "url": "http://127.0.0.1:9012", "role": "decode"},
                {
                    "id": "d1",
                    "url": "http://127.0.0.1:9004",
                    "role": "decode",
                    "decode_concurrency": 8,
                },
                {"id": "p2", "url": "http://127.0.0.1:9005", "role": "prefill"},
            ]
        }
    )
    plan = diff(old, new)
    assert plan.engines_added == ("p2",)
    assert plan.engines_removed == ("p1",)
    assert plan.engines_replaced == ("d0",)
    assert plan.engines_reconfigured == ("p0", "d1")
    assert plan.role_changes == (("p0", "prefill", "decode"),)
    assert plan.summary() == [
        'engines[p2]: null -> "added"',
        'engines[p1]: "present" -> "removed"',
        'engines[p0].role: "prefill" -> "decode"',
        'engines[d0].url: "http://127.0.0.1:9002" -> "http://127.0.0.1:9012"',
        "engines[d1].decode_concurrency: null -> 8",
    ]
    assert to_json(plan.report())["role_changes"] == [
        {"engine": "p0", "from": "prefill", "to": "decode"}
    ]


def test_long_values_are_shortened_in_summaries() -> None:
    plan = diff(config(), config(profiles={"path": "x" * 200}))
    (line,) = plan.summary()
    assert line.startswith('profiles.path: "runs/profiles.json" -> "xxxx')
    assert line.endswith("...")
    assert len(line) < 150


def test_keep_running_keeps_every_restart_required_setting_and_takes_the_rest() -> None:
    running = config()
    new = config(
        listen={"host": "0.0.0.0", "port": 9999},
        admin={"host": "0.0.0.0", "port": 9998},
        ctl={"socket": "/run/n.sock"},
        controller={"enabled": False, "advisory": True},
        serving={"max_connections": 64, "workers": 4},
        cluster={
            "endpoints": ["http://127.0.0.1:2379"],
            "prefix": "/other/",
            "replica_id": "r2",
            "lease_ttl_s": 30,
            "request_timeout_s": 1.0,
            "isolated_share": 0.25,
        },
    )
    kept = keep_running(new, running)
    assert [c.path for c in diff(running, new).restart_required] == list(RESTART_REQUIRED)
    assert diff(running, kept).restart_required == ()
    assert kept.listen == running.listen
    assert kept.admin == running.admin
    assert kept.ctl == running.ctl
    assert kept.controller.enabled is True
    assert kept.controller.advisory is True
    assert kept.serving.max_connections == 64
    assert kept.serving.workers == 1
    assert kept.cluster == attrs.evolve(running.cluster, isolated_share=0.25)


def test_changed_credentials_apply_and_read_redacted(tmp_path: Path) -> None:
    """Inline or read from a file, a changed admin token or client key list applies on
    reload (it is not restart-required) and is named without its value."""
    keys = tmp_path / "keys"
    keys.write_text("key-one\n")
    running = config(admin={"token": "token-one"}, listen={"api_keys_file": str(keys)})
    keys.write_text("key-one\nkey-two\n")
    new = config(admin={"token": "token-two"}, listen={"api_keys_file": str(keys)})
    plan = diff(running, new)
    assert plan.restart_required == ()
    assert plan.summary() == [
        'listen.api_keys_file: ["<redacted>"] -> ["<redacted>", "<redacted>"]',
        'admin.token: "<redacted>" -> "<redacted>"',
    ]
    assert "token-" not in repr(plan)
    assert "key-" not in repr(plan)
    assert diff(
        new, config(admin={"token": "token-two"}, listen={"api_keys_file": str(keys)})
    ).empty


def test_a_changed_inline_key_list_is_one_redacted_change() -> None:
    plan = diff(config(listen={"api_keys": ["a-key"]}), config(listen={"api_keys": ["b-key", "c"]}))
    assert plan.summary() == ['listen.api_keys: ["<redacted>"] -> ["<redacted>", "<redacted>"]']
