"""engine.tokenizer_path: read by the loader, its problems named by the setting."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from narwhal.config import ConfigError, diff, load_config, load_config_file

from ..tokenizer.model import write_model
from .helpers import document


def test_a_missing_tokenizer_is_a_problem_of_the_setting(tmp_path: Path) -> None:
    missing = tmp_path / "nothing"
    with pytest.raises(ConfigError) as info:
        load_config(document(engine={"tokenizer_path": str(missing)}))
    assert info.value.messages == [
        f"engine.tokenizer_path: {json.dumps(str(missing))}: no such file"
    ]
    with pytest.raises(ConfigError) as info:
        load_config(document(engine={"tokenizer_path": ""}))
    assert info.value.messages == ['engine.tokenizer_path: "" must not be empty']


def test_a_relative_path_is_taken_from_the_config_files_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_model(tmp_path / "etc" / "model")
    path = tmp_path / "etc" / "narwhal.json"
    path.write_text(json.dumps(document(engine={"tokenizer_path": "model"})))
    monkeypatch.chdir(tmp_path)
    config = load_config_file(path)
    assert config.engine.tokenizer_path == str(tmp_path / "etc" / "model")
    assert config.engine.tokenizer is not None
    assert config.engine.tokenizer.path == str(tmp_path / "etc" / "model" / "tokenizer.json")
    # The same files again are no change; a caller that reads no files gets none.
    assert diff(config, load_config_file(path)).empty
    assert load_config_file(path, api_keys=False).engine.tokenizer is None
