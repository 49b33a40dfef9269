"""The admin listener's settings and the credentials Narwhal's own listeners ask for:
`admin.token`/`admin.token_file` and `listen.api_keys`/`listen.api_keys_file`.

Every problem names its setting and the limit, never the credential; files are read
only when regular and small, without blocking on a FIFO."""

from __future__ import annotations

import json
import os
import pathlib

import pytest
import trio

from narwhal.config import config_to_dict, load_config

from .helpers import document, problems, run_validate

TOKEN = "admin-token-0123456789"
KEY = "sk-client-0123456789abcdef"


def _file(tmp_path: pathlib.Path, content: bytes | str, name: str = "secret") -> str:
    path = tmp_path / name
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    return str(path)


def test_by_default_the_admin_listener_is_on_loopback_and_asks_nothing() -> None:
    config = load_config(document())
    assert (config.admin.host, config.admin.port) == ("127.0.0.1", 8001)
    assert config.admin.bearer_token() is None
    assert config.listen.client_keys() == ()
    assert config.serving.expose_engine_details is False


def test_inline_credentials_are_taken_and_never_rendered() -> None:
    config = load_config(document(admin={"token": TOKEN}, listen={"api_keys": [KEY, "k2"]}))
    token = config.admin.bearer_token()
    assert token is not None
    assert token.reveal() == TOKEN
    assert [key.reveal() for key in config.listen.client_keys()] == [KEY, "k2"]
    rendered = json.dumps(config_to_dict(config)) + repr(config)
    assert TOKEN not in rendered
    assert KEY not in rendered
    assert config_to_dict(config)["admin"]["token"] == "<redacted>"


def test_credentials_from_files_are_read(tmp_path: pathlib.Path) -> None:
    token = _file(tmp_path, TOKEN + "\n", "token")
    keys = _file(tmp_path, f"# clients\n{KEY}\r\n\n  \nk2\n", "keys")
    config = load_config(
        document(admin={"token_file": token}, listen={"api_keys": ["k0"], "api_keys_file": keys})
    )
    assert config.admin.bearer_token() is not None
    assert config.admin.bearer_token().reveal() == TOKEN  # type: ignore[union-attr]
    assert [key.reveal() for key in config.listen.client_keys()] == ["k0", KEY, "k2"]
    assert TOKEN not in json.dumps(config_to_dict(config))


@pytest.mark.parametrize(
    ("section", "value", "message"),
    [
        ("admin", {"token": ""}, "admin.token: the credential is empty"),
        (
            "admin",
            {"token": "two words"},
            "admin.token: the credential holds a character that cannot be sent in an HTTP "
            "header (space, line break, control or non-ASCII character); expected printable "
            "ASCII",
        ),
        (
            "admin",
            {"token": "x" * 1025},
            "admin.token: the credential is 1025 characters long; at most 1024",
        ),
        (
            "admin",
            {"token": 12345},
            "admin.token: expected a string or null, got a number (not shown: a credential)",
        ),
        ("listen", {"api_keys": ["ok", "caf\u00e9"]}, "listen.api_keys[1]: the credential holds"),
        (
            "listen",
            {"api_keys": "one-key"},
            'listen.api_keys: expected a list, got "one-key"',
        ),
        ("admin", {"port": 70000}, "admin.port: 70000 is outside 0..65535"),
        ("admin", {"host": " "}, 'admin.host: " " must not be empty'),
        ("admin", {"token_file": ""}, 'admin.token_file: "" must not be empty'),
    ],
)
def test_each_problem_names_the_setting_and_its_limit(
    section: str, value: dict[str, object], message: str
) -> None:
    found = problems(document(**{section: value}))
    assert len(found) == 1, found
    assert found[0].startswith(message), found
    assert "12345" not in found[0]


def test_one_admin_token_at_a_time(tmp_path: pathlib.Path) -> None:
    token = _file(tmp_path, TOKEN)
    assert problems(document(admin={"token": TOKEN, "token_file": token})) == [
        "admin.token_file: set, and so is admin.token; the admin listener takes one token: "
        "keep the file and drop admin.token"
    ]


@pytest.mark.parametrize(
    ("listen", "admin", "clash"),
    [
        ({"port": 8000}, {"port": 8000}, True),
        ({"host": "0.0.0.0", "port": 9000}, {"host": "127.0.0.1", "port": 9000}, True),
        ({"host": "10.0.0.1", "port": 9000}, {"host": "127.0.0.1", "port": 9000}, False),
        ({"port": 0}, {"port": 0}, False),
        ({"port": 8000}, {"port": 8001}, False),
    ],
)
def test_the_admin_listener_needs_its_own_port(
    listen: dict[str, object], admin: dict[str, object], clash: bool
) -> None:
    doc = document(listen=listen, admin=admin)
    if not clash:
        load_config(doc)
        return
    [message] = problems(doc)
    assert message.startswith(f"admin.port: {admin['port']} is listen.port too, on ")


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"", "the token is empty; expected one line, the token"),
        (b"\n", "the token is empty; expected one line, the token"),
        (TOKEN.encode() + b"\nsecond", "the token holds a character that cannot be sent"),
        (b"x" * 4097, "larger than 4096 bytes"),
    ],
)
def test_a_bad_token_file_is_refused_without_quoting_it(
    tmp_path: pathlib.Path, content: bytes, reason: str
) -> None:
    path = _file(tmp_path, content)
    [message] = problems(document(admin={"token_file": path}))
    assert message.startswith(f"admin.token_file: {json.dumps(path)}: {reason}"), message
    assert TOKEN not in message


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"", "holds no key; expected one per line (to ask clients for none, set "),
        (b"# only a comment\n\n", "holds no key; expected one per line"),
        (f"{KEY}\nkey with spaces\n".encode(), "line 2: the key holds a character"),
        (b"k" * 1025 + b"\n", "line 1: the key is 1025 characters long; at most 1024"),
        (b"k\n" * (1 << 19) + b"k", "larger than 1048576 bytes"),
    ],
)
def test_a_bad_keys_file_is_refused_naming_the_line(
    tmp_path: pathlib.Path, content: bytes, reason: str
) -> None:
    path = _file(tmp_path, content)
    [message] = problems(document(listen={"api_keys_file": path}))
    assert message.startswith(f"listen.api_keys_file: {json.dumps(path)}: {reason}"), message
    assert KEY not in message


def test_at_most_a_thousand_keys(tmp_path: pathlib.Path) -> None:
    path = _file(tmp_path, "".join(f"key-{n}\n" for n in range(1000)))
    load_config(document(listen={"api_keys_file": path}))
    [message] = problems(document(listen={"api_keys_file": path, "api_keys": ["one-more"]}))
    assert message == (
        "listen.api_keys: 1001 keys with listen.api_keys_file's; at most 1000 in all"
    )


def test_missing_and_non_regular_files_are_refused(tmp_path: pathlib.Path) -> None:
    missing = str(tmp_path / "missing")
    directory = str(tmp_path)
    found = problems(document(admin={"token_file": missing}, listen={"api_keys_file": directory}))
    assert found == [
        f"listen.api_keys_file: {json.dumps(directory)}: it is a directory, not a regular file",
        f"admin.token_file: {json.dumps(missing)}: no such file",
    ]


async def test_a_fifo_is_refused_at_once_rather_than_waited_on(tmp_path: pathlib.Path) -> None:
    # Opening a FIFO for reading blocks until a writer comes: a reload would hang.
    fifo = tmp_path / "token"
    os.mkfifo(fifo)
    with trio.fail_after(5):
        found = await trio.to_thread.run_sync(
            problems, document(admin={"token_file": str(fifo)}), abandon_on_cancel=True
        )
    assert found == [
        f"admin.token_file: {json.dumps(str(fifo))}: it is a named pipe, not a regular file"
    ]


def test_validate_shows_no_credential(tmp_path: pathlib.Path) -> None:
    keys = _file(tmp_path, KEY, "keys")
    path = tmp_path / "narwhal.json"
    path.write_text(json.dumps(document(admin={"token": TOKEN}, listen={"api_keys_file": keys})))
    proc = run_validate(path)
    assert proc.returncode == 0, proc.stderr
    assert TOKEN not in proc.stdout
    assert KEY not in proc.stdout
    assert json.loads(proc.stdout)["admin"]["token"] == "<redacted>"
