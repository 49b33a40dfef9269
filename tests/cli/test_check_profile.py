"""narwhal-check and narwhal-profile: options and destinations are checked before anything
is measured, and a write that fails afterwards is an error message, not a traceback."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from narwhal.cli import _common, check as check_cli, profile as profile_cli
from narwhal.profiles import StoreBusy, lock_store

# Nothing listens on port 9: a check of this fleet fails every row within a second.
_DOWN = {"engines": [{"id": "p0", "url": "http://127.0.0.1:9"}]}


def write_config(tmp_path: Path, **sections: Any) -> str:
    path = tmp_path / "narwhal.json"
    path.write_text(json.dumps({**_DOWN, **sections}))
    return str(path)


@pytest.fixture
def blocked(tmp_path: Path) -> Path:
    """A destination no one can write, root included: its parent is a file."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    return blocker / "out.json"


def test_check_refuses_a_json_destination_it_cannot_write_before_checking(
    tmp_path: Path, blocked: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_config(tmp_path)
    assert check_cli.main(["--config", config, "--json", str(blocked), "--quiet"]) == 2
    captured = capsys.readouterr()
    assert (
        captured.err
        == f"narwhal-check: --json: cannot write {blocked}: {blocked.parent} is not a directory\n"
    )
    assert captured.out == ""  # nothing was checked


def test_check_refuses_to_record_into_a_store_it_cannot_write_before_checking(
    tmp_path: Path, blocked: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_config(tmp_path, profiles={"path": str(blocked)})
    assert check_cli.main(["--config", config, "--record", "--quiet"]) == 2
    assert capsys.readouterr().err == (
        f"narwhal-check: --record: cannot write {blocked}: {blocked.parent} is not a directory\n"
    )


def test_a_json_write_that_fails_after_the_check_is_reported_not_raised(
    tmp_path: Path, blocked: Path, capsys: pytest.CaptureFixture[str], monkeypatch: Any
) -> None:
    # The destination went away while the check ran (the up-front test passed).
    monkeypatch.setattr(check_cli, "unwritable", lambda path: None)
    config = write_config(tmp_path)
    argv = ["--config", config, "--json", str(blocked), "--no-lease", "--quiet"]
    assert check_cli.main(argv) == 1
    captured = capsys.readouterr()
    assert captured.out.startswith("check ")
    assert f"narwhal-check: --json: cannot write {blocked}: not a directory\n" in captured.err


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("--handoff-samples", "-1"),
        ("--lease-max-s", "0"),
        ("--lease-poll-s", "0"),
        ("--lease-poll-s", "-0.05"),
        ("--lease-max-s", "nan"),
    ],
)
def test_check_options_out_of_range_are_usage_errors(
    option: str, value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A zero poll period was a busy loop of requests to the producer; -1 samples ran none.
    with pytest.raises(SystemExit) as exit_info:
        check_cli.main(["--config", write_config(tmp_path), option, value])
    assert exit_info.value.code == 2
    assert f"argument {option}:" in capsys.readouterr().err


def test_profile_refuses_an_output_it_cannot_write_before_measuring(
    tmp_path: Path, blocked: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_config(tmp_path)
    assert profile_cli.main(["--config", config, "--out", str(blocked), "--quiet"]) == 2
    assert capsys.readouterr().err == (
        f"narwhal-profile: cannot write {blocked}: {blocked.parent} is not a directory; "
        "nothing was measured\n"
    )


def test_unwritable_creates_the_directory_as_the_writer_would(tmp_path: Path) -> None:
    target = tmp_path / "runs" / "profiles.json"
    assert _common.unwritable(str(target)) is None
    assert target.parent.is_dir()
    assert list(target.parent.iterdir()) == []  # the probe file is gone
    assert _common.unwritable(str(tmp_path)) == f"{tmp_path} is a directory"


def test_a_second_writer_is_refused_while_the_store_is_locked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A narwhal-profile run holds the store: another sweep would load the engines it
    # measures, and a narwhal-check --record would write back the store it read before the
    # sweep ended, throwing the new profiles away. Both are refused before measuring.
    store = tmp_path / "profiles.json"
    store.write_text("{}")
    config = write_config(tmp_path, profiles={"path": str(store)})
    with lock_store(store, holder="narwhal-profile"):
        assert profile_cli.main(["--config", config, "--quiet"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"narwhal-profile: {store} is locked by narwhal-profile (pid ")
        assert err.endswith(f"({store}.lock); wait for it to finish; nothing was measured\n")
        assert check_cli.main(["--config", config, "--record", "--quiet"]) == 2
        captured = capsys.readouterr()
        assert captured.err.startswith(
            f"narwhal-check: --record: {store} is locked by narwhal-profile (pid "
        )
        assert captured.out == ""  # nothing was checked
    assert store.read_text() == "{}"
    # Released with its holder: the next writer takes it.
    with (
        lock_store(store, holder="narwhal-check --record"),
        pytest.raises(StoreBusy, match=r"locked by narwhal-check --record \(pid "),
        lock_store(store, holder="narwhal-profile"),
    ):
        pass
