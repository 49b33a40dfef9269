"""read_file: regular files only, at most `limit` bytes, within `timeout_s`."""

from __future__ import annotations

import re
import threading
from functools import partial
from pathlib import Path

import pytest
import trio

from narwhal import _files
from narwhal._files import FileRefused, FileTooLarge, read_file

from .support import fifo


def test_a_regular_file_is_read_up_to_its_limit(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x" * 100_000)
    assert read_file(path, limit=100_000) == b"x" * 100_000
    with pytest.raises(FileTooLarge, match=r"^\[Errno 27\] larger than 99999 bytes: '.*/f'$"):
        read_file(path, limit=99_999)


def test_a_file_that_grows_past_its_limit_is_refused_however_it_reports_its_size() -> None:
    # /proc files report a size of 0; what is read counts.
    assert read_file("/proc/self/status", limit=1 << 20).startswith(b"Name:")
    with pytest.raises(FileTooLarge):
        read_file("/proc/self/status", limit=10)


async def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    with fifo(tmp_path / "pipe") as path:
        read = partial(read_file, path, limit=10)
        with trio.fail_after(5), pytest.raises(FileRefused) as info:
            await trio.to_thread.run_sync(read, abandon_on_cancel=True)
    assert info.value.strerror == "it is a named pipe, not a regular file"
    assert info.value.filename == path


@pytest.mark.parametrize(
    ("path", "kind"), [("/dev/zero", "a character device"), ("/dev/null", "a character device")]
)
def test_a_device_is_refused(path: str, kind: str) -> None:
    with pytest.raises(FileRefused, match=rf"^\[Errno 22\] it is {kind}, not a regular file"):
        read_file(path, limit=10)


def test_open_errors_are_open_s(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        read_file(tmp_path / "absent", limit=10)
    with pytest.raises(IsADirectoryError, match=r"^\[Errno 21\] Is a directory"):
        read_file(tmp_path, limit=10)
    with pytest.raises(ValueError, match="null"):
        read_file("a\0b", limit=10)


def test_a_read_that_does_not_end_is_given_up_at_the_time_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A file of a stalled network filesystem: the read blocks and cannot be interrupted.
    stalled = threading.Event()
    release = threading.Event()

    def stall(path: object, limit: int) -> bytes:
        stalled.set()
        release.wait()
        return b""

    monkeypatch.setattr(_files, "_read", stall)
    path = tmp_path / "key"
    try:
        message = rf"^\[Errno 110\] not read within 0.05 s: '{re.escape(str(path))}'$"
        with pytest.raises(FileRefused, match=message):
            read_file(path, limit=10, timeout_s=0.05)
        assert stalled.is_set()
    finally:
        release.set()
