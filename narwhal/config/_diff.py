"""What a configuration reload changes: a pure `diff(old, new) -> ReloadPlan`.

The plan sorts every difference into what the supervisor does with it:

- settings that apply in place (`changes`): limits are resized where they live (the
  admission gate, phase limiters, connection pools, the retry budget), recovery and
  monitor settings are read afresh, and request timeouts apply to requests that arrive
  after the reload, because each request snapshots the config at ingress;
- settings that need a restart (`restart_required`): the HTTP listen address, the admin
  listener's, the control socket path and `controller.enabled` (the controller and its
  demand history are built at start). The running values stay in force and the plan
  says so;
- engines, matched by id: `engines_added` get a first health probe and then placement;
  `engines_removed` leave placement at once and keep their resident requests until
  those finish, then their pools close; `engines_replaced` changed `url` or `dialect`,
  so the old instance retires like a removed one and a new one takes its id;
  `engines_reconfigured` changed other fields, applied to the live engine in place.
  A changed configured `role` is listed in `role_changes`: the live role follows it
  unless an operator pinned the engine. A changed engine API key (its file now holds
  another key) reconfigures the engine; its change reads `<redacted> -> <redacted>`, as
  does a changed admin token or client key list (inline or read from its file), which
  applies to the next request. New files under an unchanged `engine.tokenizer_path`
  are a change of it, shown by their digests: the new tokenizer counts the next request.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import attrs

from .._records import key
from ._load import config_to_dict
from ._model import SECRET, Config, Secret

RESTART_REQUIRED = (
    "listen.host",
    "listen.port",
    "admin.host",
    "admin.port",
    "ctl.socket",
    "serving.workers",
    "controller.enabled",
    # A replica's identity and its membership's terms: another value is another member.
    "cluster.endpoints",
    "cluster.prefix",
    "cluster.replica_id",
    "cluster.lease_ttl_s",
    "cluster.request_timeout_s",
)
# An engine whose endpoint or wire format changed is a different engine to talk to.
_REPLACING_FIELDS = ("url", "dialect")
ReloadEffect = Literal["applies", "restart", "new engine"]


def reload_effect(path: str) -> ReloadEffect:
    """What a reload does with a change of the field at `path` (`engines[].url` for an
    engine's): apply it, keep the running value until a restart, or retire the engine
    for a new instance (an engine whose id changed is another engine: removed, added).
    The configuration reference prints it; a test checks it against `diff`."""
    if path in RESTART_REQUIRED:
        return "restart"
    field = path.removeprefix("engines[].")
    if field != path and field in (*_REPLACING_FIELDS, "id"):
        return "new engine"
    return "applies"


_SHOW_LIMIT = 60


def _show(value: object) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= _SHOW_LIMIT else text[: _SHOW_LIMIT - 3] + "..."


def _redacted(secret: Secret | None) -> str | None:
    return None if secret is None else str(secret)


@attrs.frozen
class Change:
    path: str
    old: object
    new: object

    def __str__(self) -> str:
        return f"{self.path}: {_show(self.old)} -> {_show(self.new)}"


@attrs.frozen(kw_only=True)
class RoleChange:
    engine: str
    old: str = attrs.field(metadata=key("from"))
    new: str = attrs.field(metadata=key("to"))


@attrs.frozen(kw_only=True)
class PlanReport:
    changes: tuple[str, ...]
    restart_required: tuple[str, ...]
    engines_added: tuple[str, ...]
    engines_removed: tuple[str, ...]
    engines_replaced: tuple[str, ...]
    engines_reconfigured: tuple[str, ...]
    role_changes: tuple[RoleChange, ...]


@attrs.frozen
class ReloadPlan:
    changes: tuple[Change, ...] = ()
    restart_required: tuple[Change, ...] = ()
    engines_added: tuple[str, ...] = ()
    engines_removed: tuple[str, ...] = ()
    engines_replaced: tuple[str, ...] = ()
    engines_reconfigured: tuple[str, ...] = ()
    role_changes: tuple[tuple[str, str, str], ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.changes or self.restart_required)

    def summary(self) -> list[str]:
        """One line per difference, for the log and narwhalctl."""
        lines = [str(change) for change in self.changes]
        lines.extend(
            f"{change} (needs a restart; the running value stays in force)"
            for change in self.restart_required
        )
        return lines

    def report(self) -> PlanReport:
        """What narwhalctl and the state document (`supervisor.reloads[].plan`) show."""
        return PlanReport(
            changes=tuple(str(change) for change in self.changes),
            restart_required=tuple(str(change) for change in self.restart_required),
            engines_added=self.engines_added,
            engines_removed=self.engines_removed,
            engines_replaced=self.engines_replaced,
            engines_reconfigured=self.engines_reconfigured,
            role_changes=tuple(
                RoleChange(engine=engine, old=old, new=new)
                for engine, old, new in self.role_changes
            ),
        )


def _walk(old: object, new: object, path: str, out: list[Change]) -> None:
    if isinstance(old, dict) and isinstance(new, dict):
        for key in [*old, *(k for k in new if k not in old)]:
            _walk(old.get(key), new.get(key), f"{path}.{key}" if path else str(key), out)
    elif old != new:
        out.append(Change(path, old, new))


def keep_running(new: Config, running: Config) -> Config:
    """`new` with every RESTART_REQUIRED setting taken from `running`.

    A reload applies everything else; these stay what the daemon started with, so the
    configuration in force (and what /narwhal/state shows) is what actually runs.
    """
    kept: Config = _keep(new, running, [path.split(".") for path in RESTART_REQUIRED])
    return kept


def _keep(new: Any, running: Any, paths: list[list[str]]) -> Any:
    heads: dict[str, list[list[str]]] = {}
    for head, *rest in paths:
        heads.setdefault(head, []).append(rest)
    changes: dict[str, Any] = {}
    for head, rests in heads.items():
        value = getattr(running, head)
        if any(rests):
            value = _keep(getattr(new, head), value, [rest for rest in rests if rest])
        changes[head] = value
    return attrs.evolve(new, **changes)


def _secret_changes(old: Any, new: Any, path: str = "") -> list[Change]:
    """Changed credentials outside the engines (the admin token, the clients' keys),
    inline or read from a file, named by the setting that holds them."""
    out: list[Change] = []
    for field in attrs.fields(type(old)):
        before, after = getattr(old, field.name), getattr(new, field.name)
        here = f"{path}.{field.name}" if path else field.name
        if field.metadata.get(SECRET):
            if before != after:
                # Those read from a file change under the name of the file's setting.
                source = field.metadata.get("source")
                name = here if source is None else f"{path}.{source}"
                out.append(Change(name, before, after))
        elif attrs.has(type(before)) and not isinstance(before, Secret):
            out.extend(_secret_changes(before, after, here))
    return out


def _tokenizer_change(old: Config, new: Config) -> list[Change]:
    """The tokenizer's files changed under the same `engine.tokenizer_path` (a changed
    path is a change of its own)."""
    before, after = old.engine.tokenizer, new.engine.tokenizer
    path = old.engine.tokenizer_path
    if before is None or after is None or path != new.engine.tokenizer_path or before == after:
        return []
    return [
        Change(
            "engine.tokenizer_path", f"sha256:{before.digest[:12]}", f"sha256:{after.digest[:12]}"
        )
    ]


def diff(old: Config, new: Config) -> ReloadPlan:
    before = config_to_dict(old)
    after = config_to_dict(new)
    old_engines = {spec["id"]: spec for spec in before.pop("engines")}
    new_engines = {spec["id"]: spec for spec in after.pop("engines")}

    settings: list[Change] = []
    _walk(before, after, "", settings)
    secrets = _secret_changes(old, new)
    settings.extend(_tokenizer_change(old, new))
    # The dicts show secrets redacted: a changed list length would show there too.
    shown = {change.path for change in secrets}
    settings = [*(c for c in settings if c.path not in shown), *secrets]
    restart = tuple(c for c in settings if c.path in RESTART_REQUIRED)
    changes = [c for c in settings if c.path not in RESTART_REQUIRED]

    added = tuple(engine_id for engine_id in new_engines if engine_id not in old_engines)
    removed = tuple(engine_id for engine_id in old_engines if engine_id not in new_engines)
    replaced: list[str] = []
    reconfigured: list[str] = []
    roles: list[tuple[str, str, str]] = []
    engine_changes = [Change(f"engines[{engine_id}]", None, "added") for engine_id in added]
    engine_changes.extend(
        Change(f"engines[{engine_id}]", "present", "removed") for engine_id in removed
    )
    old_keys = {spec.id: spec.api_key for spec in old.engines}
    new_keys = {spec.id: spec.api_key for spec in new.engines}
    for engine_id, spec in new_engines.items():
        previous = old_engines.get(engine_id)
        if previous is None:
            continue
        fields: list[Change] = []
        _walk(previous, spec, f"engines[{engine_id}]", fields)
        before_key, after_key = old_keys[engine_id], new_keys[engine_id]
        if before_key != after_key:
            # Keys are left out of the dicts, which get printed; compared here, redacted.
            fields.append(
                Change(f"engines[{engine_id}].api_key", _redacted(before_key), _redacted(after_key))
            )
        if not fields:
            continue
        engine_changes.extend(fields)
        names = {change.path.rsplit(".", 1)[-1] for change in fields}
        if names & set(_REPLACING_FIELDS):
            replaced.append(engine_id)
        else:
            reconfigured.append(engine_id)
        if previous["role"] != spec["role"]:
            roles.append((engine_id, previous["role"], spec["role"]))
    if list(old_engines) != list(new_engines) and not (added or removed):
        engine_changes.append(Change("engines (order)", list(old_engines), list(new_engines)))
    return ReloadPlan(
        changes=(*engine_changes, *changes),
        restart_required=restart,
        engines_added=added,
        engines_removed=removed,
        engines_replaced=tuple(replaced),
        engines_reconfigured=tuple(reconfigured),
        role_changes=tuple(roles),
    )
