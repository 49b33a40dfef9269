"""Relative paths in a configuration file are taken from the file's folder, whoever reads
it from wherever: the loader (so the daemon, a reload, narwhal-profile, narwhal-check),
narwhalctl --config and `narwhal validate`."""

from __future__ import annotations

import json
import pathlib

import pytest

from narwhal.config import load_config, load_config_file, load_ctl_socket

from .helpers import document, run_validate

TOKEN = "admin-token-0123456789"


def _layout(tmp_path: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """A config folder holding its files beside it, and another folder to run from."""
    folder = tmp_path / "etc"
    (folder / "secrets").mkdir(parents=True)
    (folder / "secrets" / "engine-key").write_text("sk-engine\n")
    (folder / "secrets" / "e0-key").write_text("sk-e0\n")
    (folder / "secrets" / "clients").write_text("sk-client\n")
    (folder / "secrets" / "token").write_text(TOKEN + "\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    doc = document(
        engine={"api_key_file": "secrets/engine-key"},
        listen={"api_keys_file": "secrets/clients"},
        admin={"token_file": "./secrets/token"},
        ctl={"socket": "ctl.sock"},
        profiles={"path": "../state/profiles.json"},
    )
    doc["engines"][0]["api_key_file"] = "secrets/e0-key"
    (folder / "narwhal.json").write_text(json.dumps(doc))
    return folder, elsewhere


def test_relative_paths_are_taken_from_the_config_files_folder(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder, elsewhere = _layout(tmp_path)
    monkeypatch.chdir(elsewhere)
    # Relative to the working directory, as the operator typed it.
    config = load_config_file("../etc/narwhal.json")
    base = str(folder)
    assert config.ctl.socket == f"{base}/ctl.sock"
    assert config.profiles.path == f"{base}/../state/profiles.json"
    assert config.engine.api_key_file == f"{base}/secrets/engine-key"
    assert config.engines[0].api_key_file == f"{base}/secrets/e0-key"
    assert config.listen.api_keys_file == f"{base}/secrets/clients"
    assert config.admin.token_file == f"{base}/./secrets/token"
    # ... and the files there are the ones read.
    assert [spec.api_key_text() for spec in config.engines] == ["sk-e0", "sk-engine"]
    assert [key.reveal() for key in config.listen.client_keys()] == ["sk-client"]
    token = config.admin.bearer_token()
    assert token is not None
    assert token.reveal() == TOKEN
    assert load_ctl_socket("../etc/narwhal.json") == f"{base}/ctl.sock"


def test_defaults_resolve_there_too_and_absolute_paths_stay(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "conf").mkdir()
    path = tmp_path / "conf" / "narwhal.json"
    path.write_text(json.dumps(document(profiles={"path": "/var/lib/narwhal/profiles.json"})))
    config = load_config_file("conf/narwhal.json")
    assert config.ctl.socket == f"{tmp_path}/conf/runs/narwhal.sock"
    assert config.profiles.path == "/var/lib/narwhal/profiles.json"


def test_a_configuration_without_a_file_keeps_paths_relative_to_the_working_directory() -> None:
    config = load_config(document(ctl={"socket": "here.sock"}))
    assert config.ctl.socket == "here.sock"
    assert config.profiles.path == "runs/profiles.json"


def test_the_socket_length_limit_applies_to_the_path_that_is_bound(
    tmp_path: pathlib.Path,
) -> None:
    # A short relative ctl.socket in a deep folder is a long path to bind: the kernel
    # would refuse it at start, far from its setting.
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    path = deep / "narwhal.json"
    path.write_text(json.dumps(document(ctl={"socket": "ctl.sock"})))
    with pytest.raises(Exception, match=r"^ctl\.socket: .+ bytes long; an AF_UNIX socket"):
        load_config_file(path)


def test_validate_prints_the_paths_the_daemon_uses(tmp_path: pathlib.Path) -> None:
    folder, elsewhere = _layout(tmp_path)
    proc = run_validate(pathlib.Path("../etc/narwhal.json"), cwd=elsewhere)
    assert proc.returncode == 0, proc.stderr
    effective = json.loads(proc.stdout)
    assert effective["ctl"]["socket"] == f"{folder}/ctl.sock"
    assert effective["engine"]["api_key_file"] == f"{folder}/secrets/engine-key"
