from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short temporary directory: AF_UNIX paths are limited to 107 bytes, and pytest's
    tmp_path for a long test name can exceed that."""
    path = Path(tempfile.mkdtemp(prefix="nw-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
