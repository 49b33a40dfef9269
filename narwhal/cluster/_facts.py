"""Fleet facts every replica shares: each engine's role, the operator's marks, and
recovery's ejections and quarantines.

Owns
  `Fact` (one of an engine's facts: its role, drained or pinned, ejected or quarantined,
  and the replica that set it), `Hold` (a shared verdict: out until a wall-clock time,
  for a reason), its etcd key and JSON value (`key_of`, `parse_key`, `encode`,
  `decode`), `fact_of` (an operator's or the controller's fact as this replica holds
  it) and `apply` (another replica's such fact onto this replica's engine).

Invariants
  One key per engine and fact under `<prefix>facts/`, so that two replicas changing two
  facts of one engine at once (the leader a role, an operator a drain) both stand; for
  one fact the last writer wins, in etcd's order, on every replica alike. Applying a fact
  goes through the engine's owner methods (`operator_*`, the role setter), so recovery
  hears of the change as from narwhalctl. A role the engine's launch fixes (SGLang) is
  never changed by a fact. A verdict (`VERDICTS`) is a `Hold` or false (released); its
  time is the wall clock's, because each replica's trio clock starts at its own zero,
  and it ends by itself, so a replica that stops sharing cannot hold an engine out for
  good. An undecodable value is refused whole (ValueError).
"""

from __future__ import annotations

import json
from typing import Literal, cast

import attrs

from ..fleet import EngineState, Role

What = Literal["role", "drained", "pinned", "ejected", "quarantined"]
WHATS: tuple[What, ...] = ("role", "drained", "pinned", "ejected", "quarantined")
VERDICTS: tuple[What, ...] = ("ejected", "quarantined")
_ROLES = ("prefill", "decode", "both")


@attrs.frozen
class Hold:
    """A replica's verdict on an engine: out until `until` (epoch seconds), for `reason`."""

    reason: str
    until: float


@attrs.frozen
class Fact:
    engine: str
    what: What
    # A role, a mark, or for a verdict a Hold (false: released).
    value: Role | bool | Hold
    by: str


def key_of(prefix: bytes, engine_id: str, what: What) -> bytes:
    return prefix + b"facts/" + engine_id.encode() + b"/" + what.encode()


def parse_key(prefix: bytes, key: bytes) -> tuple[str, What]:
    """(engine id, what) of a fact's key; ValueError for a key that is not one."""
    engine_id, _, name = key[len(prefix + b"facts/") :].decode().rpartition("/")
    for what in WHATS:
        if engine_id and name == what:
            return engine_id, what
    raise ValueError(f"{key!r} is not <prefix>facts/ENGINE/{'|'.join(WHATS)}")


def fact_of(engine: EngineState, what: What, by: str) -> Fact:
    """The engine's role or mark (not a verdict: the cluster service shares those as
    recovery changes them)."""
    assert what not in VERDICTS, what
    value: Role | bool = engine.role if what == "role" else getattr(engine, what)
    return Fact(engine=engine.id, what=what, value=value, by=by)


def encode(fact: Fact) -> bytes:
    value = fact.value
    if isinstance(value, Hold):
        return json.dumps({"value": attrs.asdict(value), "by": fact.by}, sort_keys=True).encode()
    return json.dumps({"value": value, "by": fact.by}, sort_keys=True).encode()


def _hold(what: What, got: object) -> Hold | bool:
    if got is False:
        return False
    if not isinstance(got, dict):
        raise ValueError(f"{what} {got!r} is not false or an object")
    reason, until = got.get("reason"), got.get("until")
    if not isinstance(reason, str):
        raise ValueError(f"{what} reason {reason!r} is not a string")
    if isinstance(until, bool) or not isinstance(until, (int, float)) or until != until:
        raise ValueError(f"{what} until {until!r} is not a time")
    return Hold(reason=reason[:500], until=float(until))


def decode(prefix: bytes, key: bytes, value: bytes) -> Fact:
    """ValueError naming what is wrong with a stored fact."""
    engine_id, what = parse_key(prefix, key)
    try:
        raw = json.loads(value)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError("not a JSON object")
    got = raw.get("value")
    fact_value: Role | bool | Hold
    if what in VERDICTS:
        fact_value = _hold(what, got)
    elif what == "role":
        if got not in _ROLES:
            raise ValueError(f"role {got!r} is not one of {', '.join(_ROLES)}")
        fact_value = cast(Role, got)
    elif isinstance(got, bool):
        fact_value = got
    else:
        raise ValueError(f"{what} {got!r} is not true or false")
    by = raw.get("by")
    if not isinstance(by, str):
        raise ValueError(f"by {by!r} is not a replica name")
    return Fact(engine=engine_id, what=what, value=fact_value, by=by)


def apply(engine: EngineState, fact: Fact) -> tuple[object, object] | None:
    """Make `engine` what `fact` says; (before, after) if that changed anything."""
    before = fact_of(engine, fact.what, fact.by).value
    if before == fact.value:
        return None
    if fact.what == "drained":
        engine.operator_drain() if fact.value else engine.operator_undrain()
    elif fact.what == "pinned":
        engine.operator_pin() if fact.value else engine.operator_unpin()
    elif engine.fixed_role is None:
        engine.role = cast(Role, fact.value)
    else:
        return None
    return before, fact.value
