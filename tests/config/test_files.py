"""load_config_file: reading and parsing, before the document checks."""

from __future__ import annotations

import json
import pathlib
from functools import partial

import pytest
import trio

from narwhal.config import ConfigError, load_config_file

from ..support import fifo
from .helpers import REPO, document


def _messages(path: pathlib.Path) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config_file(path)
    assert info.value.source == str(path)
    return info.value.messages


def test_valid_file_loads(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "ok.json"
    path.write_text(json.dumps(document()))
    assert load_config_file(path).engines[0].id == "e0"
    assert load_config_file(str(path)).engines[1].role == "decode"


@pytest.mark.parametrize("name", ["narwhal.json", "demo.json"])
def test_shipped_configs_load(name: str) -> None:
    config = load_config_file(REPO / "conf" / name)
    assert [spec.role for spec in config.engines] == ["prefill", "prefill", "decode", "decode"]


@pytest.mark.parametrize("name", ["vllm-pd.json", "sglang-pd.json"])
def test_the_real_engine_quick_start_configs_load(name: str) -> None:
    config = load_config_file(REPO / "conf" / name)
    assert [spec.role for spec in config.engines] == ["prefill", "decode"]
    assert {spec.dialect for spec in config.engines} == {name.split("-")[0]}


def test_missing_file_names_the_path(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "absent.json"
    assert _messages(path) == [f"{path}: no such file"]


def test_directory_is_not_a_file(tmp_path: pathlib.Path) -> None:
    assert _messages(tmp_path) == [f"{tmp_path}: cannot read file: is a directory"]


async def test_a_fifo_is_refused_not_waited_for(tmp_path: pathlib.Path) -> None:
    with fifo(tmp_path / "narwhal.json") as path:
        load = partial(load_config_file, path)
        with trio.fail_after(5), pytest.raises(ConfigError) as info:
            await trio.to_thread.run_sync(load, abandon_on_cancel=True)
    assert info.value.messages == [
        f"{path}: cannot read file: it is a named pipe, not a regular file"
    ]


def test_a_device_is_not_a_config_file() -> None:
    # /dev/null read as an empty document; /dev/zero was read until memory ran out.
    assert _messages(pathlib.Path("/dev/null")) == [
        "/dev/null: cannot read file: it is a character device, not a regular file"
    ]


def test_a_file_over_the_size_limit_is_refused_unread(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "huge.json"
    text = json.dumps(document())
    path.write_text(text + " " * (4 * 1024 * 1024 - len(text)))
    assert load_config_file(path).engines[0].id == "e0"  # 4 MiB exactly
    with path.open("a") as more:
        more.write(" ")
    assert _messages(path) == [f"{path}: cannot read file: larger than 4194304 bytes"]


def test_binary_file(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "bin.json"
    path.write_bytes(b'{"a": "\xff"}')
    assert _messages(path) == [f"{path}: not utf-8 text (invalid byte at offset 7)"]


def test_syntax_error_names_line_and_column(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{\n  "serving": {\n    "max_attempts": 2,\n  }\n}\n')
    assert _messages(path) == [
        f"{path}: invalid json at line 4 column 3: "
        "expecting property name enclosed in double quotes"
    ]


def test_empty_file(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "empty.json"
    path.write_text("")
    assert _messages(path) == [f"{path}: invalid json at line 1 column 1: expecting value"]


def test_nan_literal_is_rejected_at_its_field(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "nan.json"
    text = json.dumps(document(serving={"queue_timeout_s": 1.0}))
    path.write_text(text.replace("1.0", "NaN"))
    assert _messages(path) == ["serving.queue_timeout_s: expected a finite number, got NaN"]


def test_duplicate_keys_are_errors(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "dup.json"
    body = json.dumps(document())[1:-1]
    path.write_text(
        '{"serving": {"max_attempts": 2}, '
        + body
        + ', "serving": {"max_attempts": 1, "max_attempts": 1, "max_attempts": 1}}'
    )
    assert _messages(path) == [
        "serving: duplicate key; only its last value would be used",
        "serving.max_attempts: duplicate key; only its last value would be used",
    ]


def test_duplicate_keys_are_reported_with_other_problems(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "dup.json"
    body = json.dumps(document())[1:-1]
    path.write_text('{"slo": {"ttft_s": 1, "ttft_s": 0}, ' + body + "}")
    assert _messages(path) == [
        "slo.ttft_s: duplicate key; only its last value would be used",
        "slo.ttft_s: 0.0 must be positive",
    ]


def test_deep_nesting_is_an_error_not_a_crash(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "deep.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    assert _messages(path) == [f"{path}: invalid json: nested too deeply"]


def test_huge_integer_is_an_error_not_a_crash(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "huge.json"
    path.write_text('{"serving": {"retry_budget": ' + "9" * 5000 + "}}")
    [message] = _messages(path)
    assert message.startswith(f"{path}: invalid json: exceeds the limit (4300 digits)")
