from __future__ import annotations

import argparse
import functools
import math
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Awaitable, Callable
from typing import ParamSpec

import trio

from .. import __version__
from .._errors import os_reason

P = ParamSpec("P")


def closed_pipe_is_quiet(main: Callable[P, int]) -> Callable[P, int]:
    """A command's `main` that ends quietly (status 0) when its reader goes away.

    `narwhalctl state | head` closes the pipe after ten lines; the next write raised
    BrokenPipeError, shown as a traceback, and so did the interpreter's last flush of
    stdout. The reader chose to stop reading, which is no error of the command's. A write
    inside trio arrives wrapped in an exception group: only a group of nothing but closed
    pipes is taken for one.
    """

    @functools.wraps(main)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> int:
        try:
            return main(*args, **kwargs)
        except BrokenPipeError:
            pass
        except BaseExceptionGroup as group:
            if group.split(BrokenPipeError)[1] is not None:
                raise
        # Python flushes stdout again at exit: point it at /dev/null so that flush of
        # what is still buffered fails quietly too.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 0

    return wrapper


def add_version(parser: argparse.ArgumentParser) -> None:
    """`--version`: the program and the installed Narwhal version, exit 0."""
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")


def not_implemented(command: str, issue: int) -> int:
    """Placeholder for a command whose issue has not landed: a clear message, exit 2."""
    print(f"{command}: not implemented yet (tracked in issue {issue})", file=sys.stderr)
    return 2


def unwritable(path: str) -> str | None:
    """Why a file cannot be written at `path`, or None. Blocking.

    The tools that write after minutes of measurement ask first, so that a read-only
    directory costs a usage error rather than the measurements. The directory is created
    as the writer would create it; a probe file is made and removed in it.
    """
    if os.path.isdir(path):
        return f"{path} is a directory"
    directory = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(directory, exist_ok=True)
    except FileExistsError:
        return f"cannot write {path}: {directory} is not a directory"
    except OSError as exc:
        return f"cannot write {path}: {os_reason(exc)}"
    try:
        fd, probe = tempfile.mkstemp(prefix=".narwhal-write-check.", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return f"cannot write {path}: {os_reason(exc)}"
    if os.path.exists(path) and not os.access(path, os.W_OK):
        return f"cannot write {path}: permission denied"
    return None


def positive_seconds(text: str) -> float:
    """argparse type: a finite number of seconds above zero."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text} must be a positive number of seconds")
    return value


def count(text: str) -> int:
    """argparse type: an integer of at least zero."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} must be at least 0")
    return value


async def interruptible(job: Callable[[], Awaitable[int]], on_signal: Callable[[str], int]) -> int:
    """Run `job`; SIGINT or SIGTERM cancels it and returns ``on_signal(name)`` instead.

    Both signals end a measurement the same way, with one line that says what was kept,
    instead of a traceback (SIGINT) or a silent exit (SIGTERM). A job shields its writes:
    a signal that arrives during one lets it finish, and the job's own code is returned.
    """
    if threading.current_thread() is not threading.main_thread():
        return await job()  # signals reach only the main thread (tests run commands in others)
    received = ""
    code: int | None = None
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                nonlocal received
                async for signum in signals:
                    received = signal.Signals(signum).name
                    nursery.cancel_scope.cancel()
                    return

            nursery.start_soon(watch)
            code = await job()
            nursery.cancel_scope.cancel()
    return code if code is not None else on_signal(received)


def signal_exit(name: str) -> int:
    """The shell's exit status for a process ended by signal `name` (128 + number)."""
    return 128 + int(signal.Signals[name])
