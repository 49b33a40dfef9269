"""Relative file paths in a configuration, taken from the folder of its file.

Owns: `config_folder(path)` and `resolve_paths(config, folder)`, which the loader applies
to every configuration read from a file, before any rule checks it (so the socket-length
rule judges the path that is bound) and before anything opens a path: the daemon at
start and at each reload, narwhalctl, narwhal-profile, narwhal-check and the demo all see
the same absolute paths, whatever their working directory. A default counts as written
in the file: `ctl.socket` unset in /etc/narwhal/narwhal.json is
/etc/narwhal/runs/narwhal.sock for every one of them.

Invariants: only fields marked `PATH` in the model change; an absolute path stays as
written; a value its own rule rejects (empty, NUL) is left for that rule to name; nothing
in a value is normalised (`../state` keeps its `..`, which the kernel resolves after
following the config's folder if that is a symlink, as `normpath` would not). A
configuration without a file (`load_config` of a document) keeps its relative paths,
which the working directory then resolves.
"""

from __future__ import annotations

import os
from typing import Any, TypeVar, cast

import attrs

from ._model import PATH, RESOLVED, Secret

Node = TypeVar("Node", bound=attrs.AttrsInstance)


def config_folder(path: str | os.PathLike[str]) -> str:
    """The absolute folder of the configuration file at `path` (relative to the working
    directory now). `abspath` tidies `--config ../conf/x.json`; the working directory it
    starts from is a real path, so only a symlink named inside `path` itself, then `..`,
    could mislead it."""
    return os.path.dirname(os.path.abspath(os.fspath(path)))


def resolve_paths(node: Node, folder: str) -> Node:
    """`node` (a `Config` or one of its sections) with every relative path field joined
    to `folder`."""
    changes: dict[str, object] = {}
    for field in attrs.fields(type(node)):
        if field.metadata.get(RESOLVED):
            continue
        value = getattr(node, field.name)
        if field.metadata.get(PATH):
            if _relative(value):
                changes[field.alias or field.name] = os.path.join(folder, value)
        elif _is_section(value):
            changes[field.alias or field.name] = resolve_paths(value, folder)
        elif isinstance(value, tuple) and any(_is_section(item) for item in value):
            changes[field.alias or field.name] = tuple(
                resolve_paths(item, folder) for item in value
            )
    if not changes:
        return node
    # The attrs plugin cannot see that a bound TypeVar is an attrs class.
    return cast(Node, attrs.evolve(cast(Any, node), **changes))


def _relative(value: object) -> bool:
    return (
        isinstance(value, str)
        and bool(value.strip())
        and "\0" not in value
        and not os.path.isabs(value)
    )


def _is_section(value: object) -> bool:
    return attrs.has(type(value)) and not isinstance(value, Secret)
