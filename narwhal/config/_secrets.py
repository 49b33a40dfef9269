"""Credentials the configuration names by file: the admin token and the clients' API keys.

Owns: reading such a file (bounded) and parsing it, one token or one key per line, into
`Secret`s. Problems are returned as text that names the file but never quotes its
content (a key on a wrong line is named by its line number).

Invariants: files are read by `narwhal._files.read_file` (a regular file only, opened
without blocking, at most `limit` bytes, within its time bound), as every file Narwhal
reads is.
"""

from __future__ import annotations

import json

from .._files import read_bounded
from ._model import Secret
from ._rules import credential_problem

# A token is one short line; a bigger file is the wrong file.
TOKEN_FILE_LIMIT = 4096
# Enough for MAX_CLIENT_KEYS keys of the longest length the rules take.
KEYS_FILE_LIMIT = 1 << 20
# Each request compares its key with every configured one (in constant time): this
# bounds that work, about 60 ns a key.
MAX_CLIENT_KEYS = 1000


def read_token(path: str) -> tuple[Secret | None, str | None]:
    """The one-line token in the file at `path` (one trailing newline ignored), or why it
    cannot be used."""
    raw, problem = read_bounded(path, TOKEN_FILE_LIMIT)
    if raw is None:
        return None, problem
    if raw.endswith(b"\r\n"):
        raw = raw[:-2]
    elif raw.endswith(b"\n"):
        raw = raw[:-1]
    problem = credential_problem(raw)
    if problem is not None:
        return None, f"{json.dumps(path)}: the token {problem}; expected one line, the token"
    return Secret(raw.decode("ascii")), None


def read_keys(path: str) -> tuple[tuple[Secret, ...], str | None]:
    """The keys in the file at `path`, one per line (blank lines and `#` comments
    skipped), or why they cannot be used."""
    raw, problem = read_bounded(path, KEYS_FILE_LIMIT)
    if raw is None:
        return (), problem
    shown = json.dumps(path)
    keys: list[Secret] = []
    for number, line in enumerate(raw.split(b"\n"), start=1):
        line = line.removesuffix(b"\r")
        if not line.strip() or line.startswith(b"#"):
            continue
        problem = credential_problem(line)
        if problem is not None:
            return (), f"{shown}: line {number}: the key {problem}"
        keys.append(Secret(line.decode("ascii")))
    if not keys:
        return (), (
            f"{shown}: holds no key; expected one per line (to ask clients for none, set "
            "listen.api_keys_file to null)"
        )
    return tuple(keys), None
