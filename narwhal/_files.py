"""Reading the files Narwhal is pointed at: regular files only, within a size and a time bound.

Owns `read_file`, the one way Narwhal reads a file: its configuration, the engines' API
key files, the profile store, the model's tokenizer, narwhal-sim's timing profile; and
`read_bounded`, which gives its failure as the message a setting's problem starts with.

Invariants:
- Only a regular file is read, opened non-blocking: a FIFO opened to read waits for a
  writer, forever if none comes (a reload of an `api_key_file` that was one hung, and
  every later reload and the shutdown behind it), and a device may never end.
- At most `limit` bytes are read: a larger file is refused, not read into memory.
- Within `timeout_s`: the open and the reads run in a daemon thread, waited for that
  long. A call on a stalled network or FUSE filesystem can block uninterruptibly; the
  caller gets its error in time, and the thread ends when the filesystem answers.

Errors: what `open` raises (FileNotFoundError, IsADirectoryError, ValueError for a NUL
in the path...), and `FileRefused`, an OSError whose strerror names the rule broken and
its limit ("it is a named pipe, not a regular file", "larger than 4096 bytes", "not read
within 5 s"). Callers name the file, and the setting, before it.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import threading

from ._errors import os_reason

# Local files are read in microseconds; a stalled filesystem is not waited for longer.
READ_TIMEOUT_S = 5.0
_CHUNK = 1 << 16
_KINDS = (
    (stat.S_ISFIFO, "a named pipe"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


class FileRefused(OSError):
    """A file `read_file` will not read: not a regular file, or not read in time."""


class FileTooLarge(FileRefused):
    """A file over the size limit of what it should hold."""


def read_file(
    path: str | os.PathLike[str], *, limit: int, timeout_s: float = READ_TIMEOUT_S
) -> bytes:
    """The content of the regular file at `path`, at most `limit` bytes, read within
    `timeout_s`. Blocking: from async code call it through `trio.to_thread.run_sync`."""
    outcome: list[bytes | BaseException] = []

    def read() -> None:
        try:
            outcome.append(_read(path, limit))
        except BaseException as exc:  # raised again in the caller's thread
            outcome.append(exc)

    worker = threading.Thread(target=read, name=f"narwhal read {os.fspath(path)}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise FileRefused(errno.ETIMEDOUT, f"not read within {timeout_s:g} s", os.fspath(path))
    (result,) = outcome
    if isinstance(result, BaseException):
        raise result
    return result


def read_bounded(path: str, limit: int) -> tuple[bytes | None, str | None]:
    """The content of the regular file at `path` if it holds at most `limit` bytes
    (`read_file`'s bounds), or why not: a message that names the file, for a setting's
    problem."""
    shown = json.dumps(path)
    try:
        return read_file(path, limit=limit), None
    except FileNotFoundError:
        return None, f"{shown}: no such file"
    except IsADirectoryError:
        return None, f"{shown}: it is a directory, not a regular file"
    except FileRefused as exc:
        return None, f"{shown}: {exc.strerror}"
    except OSError as exc:
        return None, f"{shown}: cannot read file: {os_reason(exc)}"
    except ValueError:
        return None, f"{shown}: a path cannot contain a NUL character"


def _read(path: str | os.PathLike[str], limit: int) -> bytes:
    name = os.fspath(path)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), name)
        if not stat.S_ISREG(mode):
            kind = next((kind for test, kind in _KINDS if test(mode)), "an unknown kind of file")
            raise FileRefused(errno.EINVAL, f"it is {kind}, not a regular file", name)
        # Ignored for regular files by most filesystems; one that honours it would
        # answer a read that must wait with EAGAIN instead of waiting.
        os.set_blocking(fd, True)
        parts: list[bytes] = []
        size = 0
        while size <= limit:
            chunk = os.read(fd, min(_CHUNK, limit + 1 - size))
            if not chunk:
                return b"".join(parts)
            parts.append(chunk)
            size += len(chunk)
        raise FileTooLarge(errno.EFBIG, f"larger than {limit} bytes", name)
    finally:
        os.close(fd)
