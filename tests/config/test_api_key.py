"""Engine API keys: read from the file the configuration names, never shown."""

from __future__ import annotations

import json
import pathlib
import subprocess
from functools import partial

import pytest
import trio

from narwhal._records import to_json
from narwhal.config import ConfigError, config_to_dict, diff, load_config, load_config_file

from ..support import fifo
from .helpers import document, engine, run_validate

KEY = "sk-narwhal-0123456789abcdef"


def _key_file(tmp_path: pathlib.Path, content: bytes | str, name: str = "key") -> str:
    path = tmp_path / name
    if isinstance(content, str):
        content = content.encode()
    path.write_bytes(content)
    return str(path)


def _messages(doc: dict[str, object]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(doc)
    return info.value.messages


def test_without_a_key_file_no_engine_has_a_key() -> None:
    config = load_config(document())
    assert [spec.api_key for spec in config.engines] == [None, None]
    assert config.engines[0].api_key_text() is None


@pytest.mark.parametrize("content", [KEY, KEY + "\n", KEY + "\r\n"])
def test_the_global_key_reaches_every_engine_without_its_newline(
    tmp_path: pathlib.Path, content: str
) -> None:
    path = _key_file(tmp_path, content)
    config = load_config(document(engine={"api_key_file": path}))
    assert [spec.api_key_text() for spec in config.engines] == [KEY, KEY]


def test_only_one_trailing_newline_is_stripped(tmp_path: pathlib.Path) -> None:
    path = _key_file(tmp_path, KEY + "\n\n")
    [message] = _messages(document(engine={"api_key_file": path}))
    assert message.startswith(f"engine.api_key_file: {json.dumps(path)}: the key holds a ")


def test_an_engine_override_takes_precedence(tmp_path: pathlib.Path) -> None:
    shared = _key_file(tmp_path, "shared-key\n", "shared")
    own = _key_file(tmp_path, "own-key\n", "own")
    doc = document(engine={"api_key_file": shared})
    doc["engines"] = [engine(0, "prefill", api_key_file=own), engine(1, "decode")]
    config = load_config(doc)
    assert [spec.api_key_text() for spec in config.engines] == ["own-key", "shared-key"]


def test_an_engine_may_have_a_key_without_a_global_one(tmp_path: pathlib.Path) -> None:
    own = _key_file(tmp_path, KEY)
    doc = document()
    doc["engines"] = [engine(0, "prefill"), engine(1, "decode", api_key_file=own)]
    config = load_config(doc)
    assert [spec.api_key_text() for spec in config.engines] == [None, KEY]


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"", "the file is empty; expected the engines' API key"),
        (b"\n", "the file is empty; expected the engines' API key"),
        (b"x" * 4097, "larger than 4096 bytes; expected one line, the key"),
    ],
)
def test_empty_or_oversized_files_are_refused(
    tmp_path: pathlib.Path, content: bytes, reason: str
) -> None:
    path = _key_file(tmp_path, content)
    assert _messages(document(engine={"api_key_file": path})) == [
        f"engine.api_key_file: {json.dumps(path)}: {reason}"
    ]


@pytest.mark.parametrize(
    "content",
    [
        b"abc\r\nx-injected: 1",  # header injection
        b"abc\ndef",
        b"abc def",
        b"abc\tdef",
        b" abc",
        b"abc\x00",
        b"abc\x7f",
        "clé".encode(),
        b"\xff\xfe",
    ],
)
def test_keys_that_cannot_go_in_a_header_are_refused_without_being_shown(
    tmp_path: pathlib.Path, content: bytes
) -> None:
    path = _key_file(tmp_path, content)
    [message] = _messages(document(engine={"api_key_file": path}))
    assert message == (
        f"engine.api_key_file: {json.dumps(path)}: the key holds a character that cannot be "
        "sent in an HTTP header (space, line break, control or non-ASCII character); "
        "expected one line of printable ASCII"
    )


def test_missing_and_unreadable_files_name_the_field(tmp_path: pathlib.Path) -> None:
    doc = document(engine={"api_key_file": str(tmp_path)})
    doc["engines"] = [engine(0, "prefill"), engine(1, "decode", api_key_file="/nonexistent/key")]
    assert _messages(doc) == [
        f"engine.api_key_file: {json.dumps(str(tmp_path))}: cannot read file: is a directory",
        'engines[1].api_key_file: "/nonexistent/key": no such file',
    ]


async def test_a_fifo_is_refused_not_waited_for(tmp_path: pathlib.Path) -> None:
    # Opening a FIFO to read waits for a writer: validation, and a reload, hung forever.
    with fifo(tmp_path / "key") as path:
        load = partial(load_config, document(engine={"api_key_file": path}))
        with trio.fail_after(5), pytest.raises(ConfigError) as info:
            await trio.to_thread.run_sync(load, abandon_on_cancel=True)
    assert info.value.messages == [
        f"engine.api_key_file: {json.dumps(path)}: cannot read file: it is a named pipe, not a "
        "regular file"
    ]


def test_a_device_is_not_a_key_file() -> None:
    # /dev/zero was read up to the size limit; /dev/stdin would have waited on a terminal.
    assert _messages(document(engine={"api_key_file": "/dev/zero"})) == [
        'engine.api_key_file: "/dev/zero": cannot read file: it is a character device, not '
        "a regular file"
    ]


def test_key_problems_are_reported_with_the_other_problems(tmp_path: pathlib.Path) -> None:
    doc = document(engine={"api_key_file": str(tmp_path / "absent")})
    doc["serving"] = {"max_attempts": 9}
    assert [m.split(":", 1)[0] for m in _messages(doc)] == [
        "serving.max_attempts",
        "engine.api_key_file",
    ]


def test_the_key_itself_is_not_a_configuration_key() -> None:
    doc = document()
    doc["engines"] = [engine(0, "prefill", api_key=KEY), engine(1, "decode")]
    messages = _messages(doc)
    assert messages == ["engines[0].api_key: unknown key; did you mean 'api_key_file'?"]
    assert KEY not in "\n".join(messages)


def test_the_key_is_redacted_in_reprs_and_absent_from_the_effective_config(
    tmp_path: pathlib.Path,
) -> None:
    path = _key_file(tmp_path, KEY)
    config = load_config(document(engine={"api_key_file": path}))
    assert KEY not in repr(config)
    assert KEY not in str(config.engines[0].api_key)
    assert "api_key=<redacted>" in repr(config.engines[0])
    effective = json.dumps(config_to_dict(config))
    assert KEY not in effective
    assert config_to_dict(config)["engine"]["api_key_file"] == path
    # The effective config loads back to the same configuration, key re-read.
    assert load_config(config_to_dict(config)) == config


def test_a_rotated_key_is_a_redacted_reload_change(tmp_path: pathlib.Path) -> None:
    path = _key_file(tmp_path, "old-key")
    old = load_config(document(engine={"api_key_file": path}))
    _key_file(tmp_path, "new-key")
    new = load_config(document(engine={"api_key_file": path}))
    assert [spec.api_key_text() for spec in new.engines] == ["new-key", "new-key"]
    plan = diff(old, new)
    assert plan.summary() == [
        'engines[e0].api_key: "<redacted>" -> "<redacted>"',
        'engines[e1].api_key: "<redacted>" -> "<redacted>"',
    ]
    assert plan.engines_reconfigured == ("e0", "e1")
    assert plan.engines_replaced == ()
    rendered = json.dumps(to_json(plan.report()))
    assert "old-key" not in rendered
    assert "new-key" not in rendered
    assert diff(new, load_config(document(engine={"api_key_file": path}))).empty


def test_adding_a_key_file_is_a_change_too(tmp_path: pathlib.Path) -> None:
    path = _key_file(tmp_path, KEY)
    plan = diff(load_config(document()), load_config(document(engine={"api_key_file": path})))
    assert [str(change) for change in plan.changes[:2]] == [
        'engines[e0].api_key: null -> "<redacted>"',
        'engines[e1].api_key: null -> "<redacted>"',
    ]
    assert [(c.path, c.new) for c in plan.changes[2:]] == [("engine.api_key_file", path)]
    assert KEY not in json.dumps(to_json(plan.report()))


def _validate(tmp_path: pathlib.Path, key_path: str) -> subprocess.CompletedProcess[str]:
    """`narwhal validate` on a config whose engine.api_key_file is `key_path`."""
    path = tmp_path / "narwhal.json"
    path.write_text(json.dumps(document(engine={"api_key_file": key_path})))
    return run_validate(path)


def test_validate_prints_the_file_but_not_the_key(tmp_path: pathlib.Path) -> None:
    key_path = _key_file(tmp_path, KEY + "\n")
    proc = _validate(tmp_path, key_path)
    assert proc.returncode == 0, proc.stderr
    assert KEY not in proc.stdout + proc.stderr
    assert json.loads(proc.stdout)["engine"]["api_key_file"] == key_path


def test_validate_refuses_a_bad_key_file_without_showing_it(tmp_path: pathlib.Path) -> None:
    key_path = _key_file(tmp_path, KEY + "\nsecond line")
    proc = _validate(tmp_path, key_path)
    assert proc.returncode == 1
    assert f"engine.api_key_file: {json.dumps(key_path)}: the key holds" in proc.stderr
    assert KEY not in proc.stdout + proc.stderr


def test_load_config_file_reads_the_key(tmp_path: pathlib.Path) -> None:
    key_path = _key_file(tmp_path, KEY)
    path = tmp_path / "narwhal.json"
    path.write_text(json.dumps(document(engine={"api_key_file": key_path})))
    assert load_config_file(path).engines[1].api_key_text() == KEY


def test_narwhalctl_finds_the_socket_without_reading_the_key(tmp_path: pathlib.Path) -> None:
    # An operator's narwhalctl may not read the service's credential; it needs no key.
    from narwhal.cli import ctl

    path = tmp_path / "narwhal.json"
    doc = document(engine={"api_key_file": str(tmp_path / "unreadable-by-operator")})
    doc["ctl"] = {"socket": str(tmp_path / "n.sock")}
    path.write_text(json.dumps(doc))
    args = ctl._parser().parse_args(["--config", str(path), "state"])
    assert ctl.socket_candidates(args) == [(str(tmp_path / "n.sock"), f"ctl.socket of {path}")]
    config = load_config_file(path, api_keys=False)
    assert [spec.api_key for spec in config.engines] == [None, None]
    with pytest.raises(ConfigError):
        load_config_file(path)
