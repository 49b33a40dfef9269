"""Structured logs: one JSON object per line, with the event's fields at top level."""

from __future__ import annotations

import json
import logging
import sys
import time

# Attributes every LogRecord has; anything else came from `extra=` and is ours to emit.
_STANDARD = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    # Every request logs a line, so the formatter is on the request path: the encoder
    # is built once (json.dumps with default= builds one per call) and the timestamp
    # text is reused within its second.
    def __init__(self) -> None:
        super().__init__()
        self._encoder = json.JSONEncoder(default=str)
        self._second = -1
        self._time = ""

    def format(self, record: logging.LogRecord) -> str:
        second = int(record.created)
        if second != self._second:
            self._time = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
            self._second = second
        entry: dict[str, object] = {
            "ts": round(record.created, 6),
            "time": self._time,
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update(
            (key, value)
            for key, value in record.__dict__.items()
            if key not in _STANDARD and not key.startswith("_")
        )
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return self._encoder.encode(entry)


def configure(level: str, *, worker: int | None = None) -> None:
    """Log JSON lines at `level` to stderr; a worker process's lines carry its index
    (`worker`), the daemon's none."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    if worker is not None:
        handler.addFilter(_Worker(worker))
    root = logging.getLogger("narwhal")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


class _Worker(logging.Filter):
    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index

    def filter(self, record: logging.LogRecord) -> bool:
        record.worker = self.index
        return True
