"""The profile store: a versioned JSON document written by narwhal-profile.

Loading never raises on bad content. `load_profiles` returns a `ProfileCheck` that says
which configured engines have a usable profile and lists, as messages that name the
engine, the field and both values, everything that makes a profile unusable or
suspicious: a missing or unreadable file, a schema version this Narwhal does not read, a
configured engine without a profile, a profiled engine that is not configured, and an
engine whose url, model or dialect differs from the configuration. A build that changed
while Narwhal runs is found by `verify_builds` (the build is read from the live engine).
Stale or mismatched profiles are reported, never silently used.

Schema version 1 (times in seconds, sizes in tokens; abridged)::

    {"schema_version": 1, "created_at": "2026-12-03T13:40:00+00:00",
     "tool": "narwhal-profile 0.1.0.dev0",
     "chars_per_token": {"vllm": 4.72},
     "engines": {"p0": {
        "url": "http://127.0.0.1:8100", "dialect": "vllm", "model": "sim-llama-3-8b",
        "build": "vllm 0.29.0 [narwhal-sim 0.1.0.dev0] model=sim-llama-3-8b max_model_len=8192",
        "max_model_len": 8192, "kv_capacity_tokens": 450000,
        "kv_capacity_source": "vllm:cache_config_info num_gpu_blocks x block_size",
        "max_num_seqs": 0, "max_num_seqs_source": "",
        "chars_per_token": 4.72,
        "prefill": {"a_s": 0.0077, "b_s_per_token": 2.0e-05, "c_s_per_token2": 1.1e-09,
                    "min_tokens": 3, "max_tokens": 7764, "samples": 66,
                    "residual_p50": 0.009, "residual_p90": 0.038, "residual_max": 0.038,
                    "points": 10,
                    "spread_p50": 0.03, "spread_p90": 0.13, "spread_max": 0.27},
        "decode": {"t0_s": 0.0062, "kv_s_per_token": 4.0e-08, "active_s_per_request": 2.6e-05,
                   "idle_floor_s": 0.0063, "min_active": 1, "max_active": 64,
                   "min_kv_tokens": 289, "max_kv_tokens": 133314, "samples": 240,
                   "residual_p50": 0.018, "residual_p90": 0.12, "residual_max": 0.12,
                   "points": 8,
                   "spread_p50": 0.10, "spread_p90": 0.41, "spread_max": 0.79}}},
     "handoffs": [{"prefill": "p0", "decode": "d0", "buckets": [
        {"tokens": 64, "min_tokens": 62, "max_tokens": 66, "samples": 4,
         "p50_s": 0.011, "p99_s": 0.013, "first_token_p50_s": 0.011,
         "first_token_p99_s": 0.013}, ...]}],
     "facts": {"measured_at": "...", "lease_s": 29.95, "lease_by_engine": {"p0": 29.96},
               "crossed_handoff_p99_s": 0.045, "builds": {"p0": "vllm 0.29.0 [...] ..."}},
     "sweep": {"duration_s": 64.4, "prefill_sizes": [2, 16, ...], ...}}

``facts`` is null until ``narwhal-check --record``; ``sweep`` is informational.
``max_num_seqs`` (0: unknown) and its source are optional: stores written before they
existed load with the engine's cap unknown. So are ``prefill_source``/``decode_source``
("" for a model measured on the idle engine itself; otherwise how it was obtained, for an
SGLang prefill or decode server that serves requests only in bootstrap pairs). So is
``kv_connector`` ("present", "none" for a vLLM engine that answered the router's prefill
leg with ``kv_transfer_params: null``, "" when not known), and so is ``cached`` (written
only when measured: how the engine's prefix cache follows the cached-prefill law,
`CachedPrefill`; a malformed one is reported and dropped, the profile stays usable), and
so are a
model's ``points`` and ``spread_p50``/``p90``/``max``: in a store written before them,
``residual_*`` mixed model error with per-gap (per-repeat) scatter; such a model loads
with ``points`` 0, which says so, and its fit is not judged (`narwhal.profiles._quality`).
The schema version stays 1: a bump would refuse every older store, and ``points`` 0
already tells the two meanings apart. Fields a reader does not know are ignored (and
named), so a store a later narwhal-profile wrote with more fields stays usable after a
rollback; a field whose meaning changes takes a new schema version.

Handoff profiles exist for the `crossed_pairs` of the configuration, leaving out the
engines whose profile says they have no KV connector.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
import secrets
from collections.abc import Iterable, Iterator, Mapping, Sequence, Set as AbstractSet
from typing import Any, TypeVar, cast

import attrs

from .._errors import os_reason
from .._files import read_file
from ..config import Config, EngineSpec
from ._models import (
    CachedPoint,
    CachedPrefill,
    DecodeModel,
    EngineProfile,
    HandoffBucket,
    HandoffProfile,
    PrefillModel,
    with_worst_fit,
)

SCHEMA_VERSION = 1
# What a store may weigh: a few kB per engine and per crossed pair, so tens of MB is
# thousands of pairs (a larger file is the wrong file).
STORE_FILE_LIMIT = 64 * 1024 * 1024

T = TypeVar("T")


@attrs.frozen(kw_only=True)
class MeasuredFacts:
    """What narwhal-check verified (written with ``narwhal-check --record``).

    ``lease_s`` is the shortest verified producer KV lease in the fleet (a lower bound:
    the time from the prefill response until the producer reported the release);
    ``crossed_handoff_p99_s`` the largest decode-open→first-token p99 over every crossed
    pair. ``builds`` are the engine builds the facts were measured on.
    """

    measured_at: str
    lease_s: float | None = None
    lease_by_engine: Mapping[str, float] = attrs.field(factory=dict)
    crossed_handoff_p99_s: float | None = None
    builds: Mapping[str, str] = attrs.field(factory=dict)


@attrs.frozen(kw_only=True)
class ProfileStore:
    """Every engine profile, every ordered pair's handoff profile, and measured facts."""

    schema_version: int = SCHEMA_VERSION
    created_at: str = ""
    tool: str = ""
    engines: Mapping[str, EngineProfile] = attrs.field(factory=dict)
    handoffs: Mapping[tuple[str, str], HandoffProfile] = attrs.field(factory=dict)
    # Measured characters per token, per engine dialect (engine.chars_per_token fallback).
    chars_per_token: Mapping[str, float] = attrs.field(factory=dict)
    facts: MeasuredFacts | None = None
    # How the sweep was run (sizes, counts, duration); informational.
    sweep: Mapping[str, object] = attrs.field(factory=dict)

    def profile(self, engine_id: str) -> EngineProfile | None:
        return self.engines.get(engine_id)

    def handoff(self, prefill: str, decode: str) -> HandoffProfile | None:
        return self.handoffs.get((prefill, decode))

    def max_handoff_p99_s(self) -> float | None:
        """The largest decode-open→first-token p99 over every measured pair and size."""
        values = [h.max_first_token_p99_s for h in self.handoffs.values()]
        return max(values) if values else None

    def mean_profile(self, engine_ids: Iterable[str] | None = None) -> EngineProfile | None:
        """The fleet mean profile used for demand pricing (docs/design.md#reactive-parameters).

        The mean of the listed engines' profiles (default: all): every latency
        coefficient and the idle floor are averaged, so its predictions are the mean of the
        engines' predictions (the models are linear in their coefficients). Its measured
        domain is the intersection of the engines' domains, where every averaged
        prediction is itself inside its engine's domain. None when no engine is listed.
        """
        ids = list(self.engines) if engine_ids is None else list(engine_ids)
        profiles = [self.engines[i] for i in ids if i in self.engines]
        if not profiles:
            return None
        return _mean(profiles)


def _avg(values: Iterable[float]) -> float:
    items = list(values)
    return sum(items) / len(items)


def _mean(profiles: list[EngineProfile]) -> EngineProfile:
    pre = [p.prefill for p in profiles]
    dec = [p.decode for p in profiles]
    min_tokens = max(m.min_tokens for m in pre)
    max_tokens = max(min_tokens, min(m.max_tokens for m in pre))
    prefill = with_worst_fit(
        PrefillModel(
            a_s=_avg(m.a_s for m in pre),
            b_s_per_token=_avg(m.b_s_per_token for m in pre),
            c_s_per_token2=_avg(m.c_s_per_token2 for m in pre),
            min_tokens=min_tokens,
            max_tokens=max_tokens,
            samples=sum(m.samples for m in pre),
        ),
        pre,
    )
    min_active = max(m.min_active for m in dec)
    min_kv = max(m.min_kv_tokens for m in dec)
    seqs = [p.max_num_seqs for p in profiles]
    decode = with_worst_fit(
        DecodeModel(
            t0_s=_avg(m.t0_s for m in dec),
            kv_s_per_token=_avg(m.kv_s_per_token for m in dec),
            active_s_per_request=_avg(m.active_s_per_request for m in dec),
            idle_floor_s=_avg(m.idle_floor_s for m in dec),
            min_active=min_active,
            max_active=max(min_active, min(m.max_active for m in dec)),
            min_kv_tokens=min_kv,
            max_kv_tokens=max(min_kv, min(m.max_kv_tokens for m in dec)),
            samples=sum(m.samples for m in dec),
        ),
        dec,
    )
    first = profiles[0]
    return EngineProfile(
        id="mean",
        url="",
        dialect=first.dialect,
        model=first.model,
        build=f"mean of {len(profiles)} engine profile(s): " + ", ".join(p.id for p in profiles),
        max_model_len=min(p.max_model_len for p in profiles),
        kv_capacity_tokens=int(_avg(p.kv_capacity_tokens for p in profiles)),
        prefill=prefill,
        decode=decode,
        chars_per_token=_avg(p.chars_per_token for p in profiles),
        kv_capacity_source="mean",
        # Like the controller's decode slots: no bound when any engine's is unknown.
        max_num_seqs=0 if not all(seqs) else round(_avg(seqs)),
        max_num_seqs_source="mean" if all(seqs) else "",
    )


# -- JSON ---------------------------------------------------------------------------------


def store_to_json(store: ProfileStore) -> dict[str, object]:
    engines: dict[str, object] = {}
    for engine_id, p in sorted(store.engines.items()):
        entry: dict[str, object] = {
            "url": p.url,
            "dialect": p.dialect,
            "model": p.model,
            "build": p.build,
            "max_model_len": p.max_model_len,
            "kv_capacity_tokens": p.kv_capacity_tokens,
            "kv_capacity_source": p.kv_capacity_source,
            "max_num_seqs": p.max_num_seqs,
            "max_num_seqs_source": p.max_num_seqs_source,
            "prefill_source": p.prefill_source,
            "decode_source": p.decode_source,
            "kv_connector": p.kv_connector,
            "chars_per_token": p.chars_per_token,
            "prefill": attrs.asdict(p.prefill),
            "decode": attrs.asdict(p.decode),
        }
        if p.cached is not None:
            entry["cached"] = {
                **attrs.asdict(p.cached),
                "points": [attrs.asdict(point) for point in p.cached.points],
            }
        engines[engine_id] = entry
    handoffs = [
        {
            "prefill": h.prefill,
            "decode": h.decode,
            "buckets": [attrs.asdict(b) for b in h.buckets],
        }
        for _, h in sorted(store.handoffs.items())
    ]
    out: dict[str, object] = {
        "schema_version": store.schema_version,
        "created_at": store.created_at,
        "tool": store.tool,
        "chars_per_token": dict(sorted(store.chars_per_token.items())),
        "engines": engines,
        "handoffs": handoffs,
        "facts": None,
        "sweep": dict(store.sweep),
    }
    if store.facts is not None:
        f = store.facts
        out["facts"] = {
            "measured_at": f.measured_at,
            "lease_s": f.lease_s,
            "lease_by_engine": dict(sorted(f.lease_by_engine.items())),
            "crossed_handoff_p99_s": f.crossed_handoff_p99_s,
            "builds": dict(sorted(f.builds.items())),
        }
    return out


class _Problems:
    def __init__(self, source: str) -> None:
        self.source = source
        self.messages: list[str] = []

    def add(self, message: str) -> None:
        self.messages.append(f"{self.source}: {message}")

    def unknown(self, where: str, names: set[str]) -> None:
        """Fields this Narwhal does not know are read past, and said. A later sweep adds
        fields without a schema version bump (the module docstring), so a store it wrote
        must stay usable by the Narwhal a rollback brings back: refusing the engine for
        them would turn predictive admission off for the whole fleet. A change that
        alters what a known field means takes a new schema version instead."""
        if names:
            self.add(
                f"{where}: unknown field(s) {', '.join(sorted(names))} ignored (a store "
                "written by a newer narwhal-profile?)"
            )


def _build(cls: type[T], where: str, raw: object, problems: _Problems) -> T | None:
    """Construct an attrs model from a JSON object; report (not raise) what is wrong."""
    if not isinstance(raw, dict):
        problems.add(f"{where}: expected an object, got {_kind(raw)}")
        return None
    fields: dict[str, attrs.Attribute[Any]] = {f.name: f for f in _fields(cls)}
    kwargs: dict[str, object] = {}
    bad = False
    for name, field in fields.items():
        if name not in raw:
            if field.default is attrs.NOTHING:
                problems.add(f"{where}.{name}: missing")
                bad = True
            continue
        value = raw[name]
        expected = field.type
        if expected in ("int", int):
            if isinstance(value, bool) or not isinstance(value, int):
                problems.add(f"{where}.{name}: expected an integer, got {value!r}")
                bad = True
                continue
        elif expected in ("float", float):
            if isinstance(value, bool) or not isinstance(value, int | float):
                problems.add(f"{where}.{name}: expected a number, got {value!r}")
                bad = True
                continue
            value = float(value)
            if not math.isfinite(value):
                problems.add(f"{where}.{name}: expected a finite number, got {value!r}")
                bad = True
                continue
        elif expected in ("bool", bool) and not isinstance(value, bool):
            problems.add(f"{where}.{name}: expected true or false, got {value!r}")
            bad = True
            continue
        elif expected in ("str", str) and not isinstance(value, str):
            problems.add(f"{where}.{name}: expected a string, got {value!r}")
            bad = True
            continue
        kwargs[name] = value
    problems.unknown(where, set(raw) - set(fields))
    if bad:
        return None
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        problems.add(f"{where}: {exc}")
        return None


def _fields(cls: type[object]) -> tuple[attrs.Attribute[Any], ...]:
    return tuple(attrs.fields(cast(Any, cls)))


def _kind(value: object) -> str:
    if value is None:
        return "null"
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}.get(
        type(value), f"{value!r}"
    )


_ENGINE_SCALARS: dict[str, type] = {
    "url": str,
    "dialect": str,
    "model": str,
    "build": str,
    "max_model_len": int,
    "kv_capacity_tokens": int,
    "kv_capacity_source": str,
    "chars_per_token": float,
}
# Fields later versions of the sweep added; a store without them is still read.
_ENGINE_OPTIONAL: dict[str, type] = {
    "max_num_seqs": int,
    "max_num_seqs_source": str,
    "prefill_source": str,
    "decode_source": str,
    "kv_connector": str,
}
_ENGINE_FIELDS = {**_ENGINE_SCALARS, **_ENGINE_OPTIONAL}


def _engine(engine_id: str, raw: object, problems: _Problems) -> EngineProfile | None:
    where = f"engines.{engine_id}"
    if not isinstance(raw, dict):
        problems.add(f"{where}: expected an object, got {_kind(raw)}")
        return None
    values: dict[str, object] = {}
    bad = False
    for name, kind in _ENGINE_FIELDS.items():
        if name in _ENGINE_OPTIONAL and name not in raw:
            continue  # a store written before the field existed: its default applies
        value = raw.get(name)
        if name == "kv_capacity_source" and value is None:
            value = ""
        ok = (
            isinstance(value, kind) and not isinstance(value, bool)
            if kind is not float
            else isinstance(value, int | float)
            and not isinstance(value, bool)
            and math.isfinite(float(value))
        )
        if not ok:
            problems.add(f"{where}.{name}: expected {kind.__name__}, got {value!r}")
            bad = True
            continue
        values[name] = float(value) if kind is float else value  # type: ignore[arg-type]
    problems.unknown(where, set(raw) - set(_ENGINE_FIELDS) - {"prefill", "decode", "cached"})
    prefill = _build(PrefillModel, f"{where}.prefill", raw.get("prefill"), problems)
    decode = _build(DecodeModel, f"{where}.decode", raw.get("decode"), problems)
    if bad or prefill is None or decode is None:
        return None
    cached = _cached(f"{where}.cached", raw["cached"], problems) if "cached" in raw else None
    try:
        return EngineProfile(
            id=engine_id,
            prefill=prefill,
            decode=decode,
            cached=cached,
            **values,  # type: ignore[arg-type]
        )
    except (TypeError, ValueError) as exc:
        problems.add(f"{where}: {exc}")
        return None


def _cached(where: str, raw: object, problems: _Problems) -> CachedPrefill | None:
    """The engine's cached-prefill record; a malformed one is reported and left out, and
    the engine's profile stays usable (the record only informs: nothing prices with it)."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        problems.add(f"{where}: expected an object, got {_kind(raw)}; ignored")
        return None
    points: list[CachedPoint] = []
    raw_points = raw.get("points", [])
    if not isinstance(raw_points, list):
        problems.add(f"{where}.points: expected a list, got {_kind(raw_points)}; ignored")
        return None
    for i, item in enumerate(raw_points):
        point = _build(CachedPoint, f"{where}.points[{i}]", item, problems)
        if point is None:
            return None
        points.append(point)
    record = _build(CachedPrefill, where, {k: v for k, v in raw.items() if k != "points"}, problems)
    return None if record is None else attrs.evolve(record, points=tuple(points))


def _handoff(index: int, raw: object, problems: _Problems) -> HandoffProfile | None:
    where = f"handoffs[{index}]"
    if not isinstance(raw, dict):
        problems.add(f"{where}: expected an object, got {_kind(raw)}")
        return None
    prefill, decode, buckets = raw.get("prefill"), raw.get("decode"), raw.get("buckets")
    if not isinstance(prefill, str) or not isinstance(decode, str):
        problems.add(f"{where}: prefill and decode must be engine ids (strings)")
        return None
    where = f"handoffs[{index}] ({prefill} -> {decode})"
    if not isinstance(buckets, list):
        problems.add(f"{where}.buckets: expected a list, got {_kind(buckets)}")
        return None
    parsed: list[HandoffBucket] = []
    for i, item in enumerate(buckets):
        bucket = _build(HandoffBucket, f"{where}.buckets[{i}]", item, problems)
        if bucket is None:
            return None
        parsed.append(bucket)
    try:
        return HandoffProfile(prefill=prefill, decode=decode, buckets=tuple(parsed))
    except (TypeError, ValueError) as exc:
        problems.add(f"{where}: {exc}")
        return None


def _facts(raw: object, problems: _Problems) -> MeasuredFacts | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        problems.add(f"facts: expected an object or null, got {_kind(raw)}")
        return None
    measured_at = raw.get("measured_at")
    lease = raw.get("lease_s")
    p99 = raw.get("crossed_handoff_p99_s")
    by_engine = raw.get("lease_by_engine") or {}
    builds = raw.get("builds") or {}

    def number(value: object) -> bool:
        return value is None or (
            isinstance(value, int | float)
            and not isinstance(value, bool)
            and math.isfinite(value)
            and value >= 0
        )

    if (
        not isinstance(measured_at, str)
        or not number(lease)
        or not number(p99)
        or not isinstance(by_engine, dict)
        or not all(isinstance(k, str) and number(v) and v is not None for k, v in by_engine.items())
        or not isinstance(builds, dict)
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in builds.items())
    ):
        problems.add(
            "facts: malformed (measured_at, lease_s, lease_by_engine, "
            "crossed_handoff_p99_s, builds); ignored"
        )
        return None
    return MeasuredFacts(
        measured_at=measured_at,
        lease_s=None if lease is None else float(lease),
        lease_by_engine={k: float(v) for k, v in by_engine.items()},
        crossed_handoff_p99_s=None if p99 is None else float(p99),
        builds=dict(builds),
    )


def store_from_json(
    document: object, *, source: str = "profile store"
) -> tuple[ProfileStore | None, list[str]]:
    """Parse a store document. Returns (store or None, problems); never raises.

    A wrong schema version yields no store at all (its fields may mean something else);
    a malformed engine or handoff entry is left out of the store and reported.
    """
    problems = _Problems(source)
    if not isinstance(document, dict):
        problems.add(f"expected a JSON object, got {_kind(document)}")
        return None, problems.messages
    version = document.get("schema_version")
    if version != SCHEMA_VERSION or isinstance(version, bool):
        problems.add(
            f"schema_version is {version!r}; this Narwhal reads schema_version "
            f"{SCHEMA_VERSION}: run narwhal-profile again"
        )
        return None, problems.messages
    engines: dict[str, EngineProfile] = {}
    raw_engines = document.get("engines")
    if not isinstance(raw_engines, dict):
        problems.add(f"engines: expected an object, got {_kind(raw_engines)}")
        raw_engines = {}
    for engine_id, raw in raw_engines.items():
        profile = _engine(str(engine_id), raw, problems)
        if profile is not None:
            engines[profile.id] = profile
    handoffs: dict[tuple[str, str], HandoffProfile] = {}
    raw_handoffs = document.get("handoffs", [])
    if not isinstance(raw_handoffs, list):
        problems.add(f"handoffs: expected a list, got {_kind(raw_handoffs)}")
        raw_handoffs = []
    for i, raw in enumerate(raw_handoffs):
        handoff = _handoff(i, raw, problems)
        if handoff is not None:
            handoffs[(handoff.prefill, handoff.decode)] = handoff
    cpt: dict[str, float] = {}
    raw_cpt = document.get("chars_per_token", {})
    if isinstance(raw_cpt, dict):
        for dialect, value in raw_cpt.items():
            if (
                isinstance(value, int | float)
                and not isinstance(value, bool)
                and math.isfinite(value)
                and value > 0
            ):
                cpt[str(dialect)] = float(value)
            else:
                problems.add(
                    f"chars_per_token.{dialect}: expected a positive number, got {value!r}"
                )
    else:
        problems.add(f"chars_per_token: expected an object, got {_kind(raw_cpt)}")
    sweep = document.get("sweep", {})
    store = ProfileStore(
        schema_version=SCHEMA_VERSION,
        created_at=str(document.get("created_at", "")),
        tool=str(document.get("tool", "")),
        engines=engines,
        handoffs=handoffs,
        chars_per_token=cpt,
        facts=_facts(document.get("facts"), problems),
        sweep=dict(sweep) if isinstance(sweep, dict) else {},
    )
    return store, problems.messages


def save_profiles(store: ProfileStore, path: str | os.PathLike[str]) -> None:
    """Write the store atomically: a reader sees the old file or the new one, never half.

    Blocking: from async code call it through `trio.to_thread.run_sync`.
    """
    target = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(target))
    os.makedirs(directory, exist_ok=True)
    text = json.dumps(store_to_json(store), indent=2) + "\n"
    # Not tempfile.mkstemp: its 0600 mode would survive the rename; a plain exclusive
    # create gets the usual umask-derived mode, like any file the operator writes.
    tmp = os.path.join(directory, f".{os.path.basename(target)}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as stream:
            stream.write(text)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


class StoreBusy(Exception):
    """Another narwhal-profile or narwhal-check --record holds the store's writer lock."""


@contextlib.contextmanager
def lock_store(path: str | os.PathLike[str], *, holder: str) -> Iterator[None]:
    """Hold the writer lock of the store at `path` (an advisory flock on ``PATH.lock``).

    Writes are atomic, but the writers read, measure for minutes and write back: two at
    once would each load the engines the other measures, and the last to write would
    throw away what the other wrote. The second one is refused (`StoreBusy`, naming the
    holder) before it measures anything. The kernel drops the lock when its holder exits,
    however it exits; the lock file stays (removing it would race with a new holder).
    Readers (the daemon) need no lock. Blocking.
    """
    target = os.fspath(path)
    lock = f"{target}.lock"
    os.makedirs(os.path.dirname(os.path.abspath(lock)), exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = os.pread(fd, 256, 0).decode("utf-8", "replace").strip() or "another process"
            raise StoreBusy(
                f"{target} is locked by {other} ({lock}); wait for it to finish"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{holder} (pid {os.getpid()})\n".encode(), 0)
        yield
    finally:
        os.close(fd)


@attrs.frozen
class StoreDocument:
    """A store's bytes as read from `source` (a file's path, or where else they were kept),
    or none (`data` None) with the reason in `problems`; `digest` is their sha256 in hex,
    what tells two stores apart without parsing them."""

    source: str
    data: bytes | None
    problems: tuple[str, ...] = ()
    digest: str | None = attrs.field(init=False, eq=False)

    @digest.default
    def _digest(self) -> str | None:
        return None if self.data is None else hashlib.sha256(self.data).hexdigest()


def read_document(path: str | os.PathLike[str]) -> StoreDocument:
    """A store file's bytes, unparsed; none, with why, when it is missing or unreadable.
    Blocking."""
    source = os.fspath(path)
    try:
        data = read_file(source, limit=STORE_FILE_LIMIT)
    except FileNotFoundError:
        missing = f"{source}: profile store is missing; run narwhal-profile --config FILE"
        return StoreDocument(source, None, (missing,))
    except OSError as exc:
        unreadable = f"{source}: cannot read profile store: {os_reason(exc)}"
        return StoreDocument(source, None, (unreadable,))
    return StoreDocument(source, data)


def parse_document(document: StoreDocument) -> tuple[ProfileStore | None, list[str]]:
    """Parse a store's bytes, as `store_from_json` does its JSON; never raises."""
    source = document.source
    if document.data is None:
        return None, list(document.problems)
    try:
        text = document.data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, [f"{source}: cannot read profile store: {exc}"]
    try:
        parsed = json.loads(text)
    except ValueError as exc:
        return None, [f"{source}: not valid JSON: {exc}"]
    return store_from_json(parsed, source=source)


def read_store(path: str | os.PathLike[str]) -> tuple[ProfileStore | None, list[str]]:
    """Read and parse a store file; (None, [why]) when it is missing or unreadable."""
    return parse_document(read_document(path))


# -- checking against the configuration ---------------------------------------------------


@attrs.frozen
class ProfileCheck:
    """The result of loading the store against a configuration.

    ``usable`` holds the configured engines whose profile may be used; ``messages``
    explains every problem (each names the engine and the field). ``ok`` is true when
    every configured engine is usable and nothing was reported.
    """

    store: ProfileStore | None
    usable: frozenset[str]
    messages: tuple[str, ...]
    configured: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.messages and self.usable == frozenset(self.configured)

    def profile(self, engine_id: str) -> EngineProfile | None:
        """The engine's profile if it is usable, else None."""
        if self.store is None or engine_id not in self.usable:
            return None
        return self.store.profile(engine_id)

    def handoff(self, prefill: str, decode: str) -> HandoffProfile | None:
        """The pair's handoff profile if both engines are usable, else None."""
        if self.store is None or prefill not in self.usable or decode not in self.usable:
            return None
        return self.store.handoff(prefill, decode)

    def mean_profile(self) -> EngineProfile | None:
        """The fleet mean over the usable configured engines
        (docs/design.md#reactive-parameters)."""
        if self.store is None:
            return None
        return self.store.mean_profile(e for e in self.configured if e in self.usable)

    def with_builds(self, observed: Mapping[str, str]) -> ProfileCheck:
        """This check after comparing live engine builds: changed builds become unusable."""
        if self.store is None:
            return self
        problems = verify_builds(self.store, observed)
        changed = {
            e for e in observed if e in self.usable and _build_changed(self.store, e, observed)
        }
        return attrs.evolve(
            self, usable=self.usable - changed, messages=self.messages + tuple(problems)
        )


def _build_changed(store: ProfileStore, engine_id: str, observed: Mapping[str, str]) -> bool:
    profile = store.profile(engine_id)
    return profile is None or profile.build != observed[engine_id]


def verify_builds(store: ProfileStore, observed: Mapping[str, str]) -> list[str]:
    """Messages for every engine whose live build differs from its profile's."""
    out: list[str] = []
    for engine_id, build in sorted(observed.items()):
        profile = store.profile(engine_id)
        if profile is None:
            out.append(f"engine {engine_id!r}: no profile to compare build {build!r} against")
        elif profile.build != build:
            out.append(
                f"engine {engine_id!r}: build is {build!r} but the profile was measured on "
                f"{profile.build!r}; the profile is stale, run narwhal-profile again"
            )
    return out


def check_store(store: ProfileStore | None, problems: list[str], config: Config) -> ProfileCheck:
    """Compare a parsed store with the configuration (see `load_profiles`)."""
    configured = tuple(e.id for e in config.engines)
    messages = list(problems)
    if store is None:
        return ProfileCheck(None, frozenset(), tuple(messages), configured)
    usable: set[str] = set()
    for spec in config.engines:
        profile = store.profile(spec.id)
        if profile is None:
            messages.append(f"engine {spec.id!r}: no profile in the store; run narwhal-profile")
            continue
        differs = [
            f"engine {spec.id!r}: {name} is {want!r} in the config but {got!r} in the profile"
            for name, want, got in (
                ("url", spec.url.rstrip("/"), profile.url.rstrip("/")),
                ("model", spec.model, profile.model),
                ("dialect", spec.dialect, profile.dialect),
            )
            if want != got
        ]
        if differs:
            messages.extend(differs)
            continue
        usable.add(spec.id)
    messages.extend(
        f"engine {engine_id!r}: profiled in the store but not in the config (ignored)"
        for engine_id in sorted(set(store.engines) - set(configured))
    )
    pairs = crossed_pairs(config.engines, no_connector=without_connector(store))
    messages.extend(
        f"pair {p!r} -> {d!r}: no crossed-handoff profile in the store; run narwhal-profile"
        for p, d in pairs
        if p in usable and d in usable and store.handoff(p, d) is None
    )
    return ProfileCheck(store, frozenset(usable), tuple(messages), configured)


def pd_server(spec: EngineSpec) -> str | None:
    """ "prefill" or "decode" for an SGLang engine launched in that disaggregation mode
    (its configured role, notes 5.1); None for an aggregate SGLang server and for vLLM,
    whose role is only a request shape."""
    if spec.dialect == "sglang" and spec.role != "both":
        return spec.role
    return None


def without_connector(store: ProfileStore) -> frozenset[str]:
    """The profiled engines that have no KV connector (`EngineProfile.kv_connector`)."""
    return frozenset(e for e, p in store.engines.items() if p.kv_connector == "none")


def crossed_pairs(
    engines: Sequence[EngineSpec], *, no_connector: AbstractSet[str] = frozenset()
) -> list[tuple[str, str]]:
    """The ordered (prefill, decode) pairs a handoff can be measured on and the router
    can place: every pair of distinct engines (the self pair for a one-engine fleet),
    except that an SGLang prefill or decode server joins only bootstrap pairs in its
    launched role, opposite a server of the other role. An aggregate SGLang server never
    joins a bootstrap room, so it pairs only with another aggregate one. A vLLM engine
    in `no_connector` (it answered the prefill leg with ``kv_transfer_params: null``) can
    hand no KV over, nor take any: it is in no pair."""
    if len(engines) == 1:
        lone = engines[0]
        return [] if pd_server(lone) or lone.id in no_connector else [(lone.id, lone.id)]
    return [
        (p.id, d.id)
        for p in engines
        for d in engines
        if p.id != d.id
        and p.id not in no_connector
        and d.id not in no_connector
        and (
            (pd_server(p), pd_server(d)) == ("prefill", "decode")
            if pd_server(p) or pd_server(d)
            else True
        )
    ]


def load_profiles(path: str | os.PathLike[str] | None, config: Config) -> ProfileCheck:
    """Load the store at `path` (default: ``config.profiles.path``) and check it. Never
    raises on bad content; blocking (call it via `trio.to_thread.run_sync` from async code).
    """
    return check_document(read_document(config.profiles.path if path is None else path), config)


def check_document(document: StoreDocument, config: Config) -> ProfileCheck:
    """Parse a store's bytes and check them against the configuration, as `load_profiles`
    does a file's. Never raises on bad content."""
    store, problems = parse_document(document)
    return check_store(store, problems, config)
