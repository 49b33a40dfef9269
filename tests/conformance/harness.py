"""Send the conformance corpus to an engine and reduce each answer to what Narwhal depends on.

Owns: the corpus (`corpus.json`), the recorded answers (`recorded.json`), `run_corpus`
(one engine set, every case in order), `normalise` (an answer, reduced), `compare`.
Invariants: a normalised answer keeps the status and reason phrase, the media type, every
key of every JSON document and stream chunk with its value's type, and the values that do
not vary between runs or engines: error type/code/param, object, finish_reason,
stop_reason, choice indexes, kv_transfer_params' nulls and transfer_mode, max_model_len,
the model name, plus a case's `exact` fields. Ids, timestamps, generated text, token
counts of text prompts and logprob values are reduced to their type ("<str>", "<int>"); a
list of plain values (token ids, a token's bytes) is "<list>". A stream is its events'
shapes, each choice's chunks together (choices interleave as the engine pleases) and
repeats of one shape in a row kept once (the engine packs tokens into events as it falls
behind), so the comparison holds whatever the pace; a stream that sent a choice's tokens
all in its last chunk is sent again, as it shows no middle chunk. /metrics is the
presence of each metric name Narwhal reads.
Both engine families answer the one corpus (a case's `dialects` keeps it to some), each
recorded apart: `recorded.json` (vLLM), `recorded-sglang.json` (SGLang; its "prefill" and
"decode" engines are a Mooncake pair's servers, asked only for /get_server_info: a pair's
/metrics changes with what it has served, and SGLang has no single-request P/D leg).
See: tools/engines/record_conformance.py (records from real engines), test_sim.py (the
simulator against the recordings), tests/real/test_conformance.py.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import httpx

HERE = Path(__file__).parent
CORPUS = HERE / "corpus.json"
# Each engine family's recorded answers.
RECORDED = {"vllm": HERE / "recorded.json", "sglang": HERE / "recorded-sglang.json"}
DIALECTS = tuple(RECORDED)
# Engine names of the corpus: no KV connector, and the two ends of a NixlConnector pair.
ENGINES = ("plain", "prefill", "decode")
# A token id every vocabulary has, for prompts of token ids.
FILLER_TOKEN = 100
# Per request, generous for a real engine on a loaded 2-core box.
REQUEST_TIMEOUT_S = 120.0
# Sends of a stream case whose tokens the engine merged into each choice's last chunk.
STREAM_ATTEMPTS = 4

# The metric samples Narwhal reads (probe, recovery, profiles), by engine family: test_sim
# checks that these lists cover every name in narwhal/ outside the simulator.
NARWHAL_METRICS = {
    "vllm": (
        "process_start_time_seconds",
        "vllm:cache_config_info",
        "vllm:gpu_cache_usage_perc",
        "vllm:kv_cache_usage_perc",
        "vllm:nixl_num_kv_expired_reqs",
        "vllm:nixl_num_kv_expired_reqs_total",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:prompt_tokens_total",
    ),
    "sglang": (
        "process_start_time_seconds",
        "sglang:max_total_num_tokens",
        "sglang:num_queue_reqs",
        "sglang:num_running_reqs",
        "sglang:prompt_tokens_total",
        "sglang:token_usage",
    ),
}
# cache_config_info labels Narwhal reads (the KV capacity).
CACHE_INFO_LABELS = ("block_size", "num_gpu_blocks")

# Keys whose values are kept wherever they appear.
_KEPT = frozenset(
    {
        "object",
        "finish_reason",
        "stop_reason",
        "index",
        "role",
        "type",
        "code",
        "param",
        "model",
        "owned_by",
        "max_model_len",
        "transfer_mode",
        "do_remote_prefill",
        "do_remote_decode",
    }
)
_METRIC_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="')

Json = Any


@attrs.frozen
class Case:
    name: str
    about: str
    engine: str
    method: str
    path: str
    body: Json = None
    exact: tuple[str, ...] = ()
    # The engine families the case is sent to (a vLLM P/D leg means nothing to SGLang).
    dialects: tuple[str, ...] = DIALECTS
    # The keys of a JSON answer that are compared (none: all); SGLang's /get_server_info
    # is every server argument, most of which Narwhal never reads.
    fields: tuple[str, ...] = ()


@attrs.frozen
class Corpus:
    model: str
    max_model_len: int
    cases: tuple[Case, ...]


def load_corpus(path: Path = CORPUS) -> Corpus:
    doc = json.loads(path.read_text())
    cases = []
    for raw in doc["cases"]:
        case = Case(
            name=raw["name"],
            about=raw["about"],
            engine=raw["engine"],
            method=raw["method"],
            path=raw["path"],
            body=raw.get("body"),
            exact=tuple(raw.get("exact", ())),
            dialects=tuple(raw.get("dialects", DIALECTS)),
            fields=tuple(raw.get("fields", ())),
        )
        if case.engine not in ENGINES:
            raise ValueError(f"case {case.name!r}: engine {case.engine!r} is not one of {ENGINES}")
        if not set(case.dialects) <= set(DIALECTS):
            raise ValueError(f"case {case.name!r}: dialects {case.dialects} not in {DIALECTS}")
        cases.append(case)
    names = [c.name for c in cases]
    if len(set(names)) != len(names):
        raise ValueError("corpus case names must be unique")
    return Corpus(model=doc["model"], max_model_len=doc["max_model_len"], cases=tuple(cases))


def expand(value: Json, earlier: Mapping[str, Json]) -> Json:
    """A body with its placeholders filled: {"$token_ids": N}, {"$words": N} and
    {"$kv_from": CASE} (the kv_transfer_params the earlier case CASE answered)."""
    if isinstance(value, dict):
        if set(value) == {"$token_ids"}:
            return [FILLER_TOKEN] * int(value["$token_ids"])
        if set(value) == {"$words"}:
            return " ".join(["word"] * int(value["$words"]))
        if set(value) == {"$kv_from"}:
            source = value["$kv_from"]
            if source not in earlier:
                raise ValueError(f"$kv_from {source!r}: no earlier case of that name")
            return earlier[source]
        return {k: expand(v, earlier) for k, v in value.items()}
    if isinstance(value, list):
        return [expand(v, earlier) for v in value]
    return value


async def run_corpus(
    client: httpx.AsyncClient,
    urls: Mapping[str, str],
    corpus: Corpus,
    *,
    dialect: str = "vllm",
    only: Callable[[Case], bool] | None = None,
) -> dict[str, Json]:
    """Every case of the `dialect` (or those `only` keeps) sent in corpus order to the
    engine its `engine` names in `urls`; the normalised answers by case name."""
    answers: dict[str, Json] = {}
    kv_params: dict[str, Json] = {}
    for case in corpus.cases:
        if dialect not in case.dialects or (only is not None and not only(case)):
            continue
        body = expand(case.body, kv_params) if case.body is not None else None
        url = urls[case.engine] + case.path
        for _ in range(STREAM_ATTEMPTS):
            if case.method == "GET":
                response = await client.get(url, timeout=REQUEST_TIMEOUT_S)
            else:
                response = await client.post(url, json=body, timeout=REQUEST_TIMEOUT_S)
            if _token_by_token(response.content):
                break
        raw = response.content
        if response.headers.get("content-type", "").startswith("application/json") and raw:
            document = json.loads(raw)
            if isinstance(document, dict) and "kv_transfer_params" in document:
                kv_params[case.name] = document["kv_transfer_params"]
        answers[case.name] = normalise(
            case,
            response.status_code,
            response.reason_phrase,
            response.headers.get("content-type"),
            raw,
            dialect,
        )
    return answers


async def engine_version(client: httpx.AsyncClient, url: str, dialect: str) -> str:
    """The version the engine at `url` reports (SGLang 0.5.23 has no /version)."""
    path = "/version" if dialect == "vllm" else "/get_server_info"
    response = await client.get(url + path, timeout=REQUEST_TIMEOUT_S)
    response.raise_for_status()
    version = response.json()["version"]
    assert isinstance(version, str), version
    return version


def _token_by_token(raw: bytes) -> bool:
    """Whether every choice of a stream sent a chunk before its last one (besides a chat's
    role chunk). An engine that falls behind merges a choice's tokens into fewer chunks,
    down to one; the middle chunks' shape is then missing from the answer, so a stream
    that merged them all is asked again (`STREAM_ATTEMPTS`)."""
    text = raw.decode(errors="replace")
    if not text.startswith("data: "):
        return True
    middle: dict[int, bool] = {}
    for block in text.split("\n\n"):
        try:
            event = json.loads(block.removeprefix("data: "))
        except ValueError:
            continue
        choices = event.get("choices") if isinstance(event, dict) else None
        for choice in choices or ():
            index = choice.get("index")
            role = "role" in (choice.get("delta") or {})
            middle.setdefault(index, False)
            if choice.get("finish_reason") is None and not role:
                middle[index] = True
    return all(middle.values())


def normalise(
    case: Case,
    status: int,
    reason: str,
    content_type: str | None,
    raw: bytes,
    dialect: str = "vllm",
) -> dict[str, Json]:
    media = None if content_type is None else content_type.split(";")[0].strip()
    out: dict[str, Json] = {"status": status, "reason": reason, "media_type": media}
    if case.path == "/metrics" and status == 200:
        out["metrics"] = _metric_names(raw.decode(), dialect)
    elif media == "text/event-stream":
        out["stream"] = _stream(raw.decode(), case.exact)
    elif media == "application/json" and raw:
        document = json.loads(raw)
        if case.fields and isinstance(document, dict):
            document = {k: document[k] for k in case.fields if k in document}
        out["body"] = shape(document, case.exact)
    else:
        out["body_bytes"] = len(raw)
    return out


def shape(value: Json, exact: Sequence[str] = (), path: str = "", key: str = "") -> Json:
    """`value` with every value reduced to its type but the kept ones (see module doc)."""
    if path in exact or (key in _KEPT and not isinstance(value, dict | list)):
        return value
    if isinstance(value, dict):
        if key == "top_logprobs" and "logprob" not in value:
            # A completion's top logprobs: token -> logprob, tokens as keys (a chat's
            # are objects with a token and a logprob).
            return {"<token>": _distinct([shape(v) for v in value.values()])}
        return {k: shape(v, exact, f"{path}.{k}" if path else k, k) for k, v in value.items()}
    if isinstance(value, list):
        if not any(isinstance(v, dict | list) for v in value):
            # Token ids, bytes, offsets: their length and contents vary with the text.
            return "<list>"
        items = [
            shape(v, exact, f"{path}.{i}" if path else str(i), key) for i, v in enumerate(value)
        ]
        return _distinct(items)
    if value is None:
        return None
    return f"<{type(value).__name__}>"


def _distinct(items: list[Json]) -> list[Json]:
    out: list[Json] = []
    for item in items:
        if item not in out:
            out.append(item)
    return out


def _stream(text: str, exact: Sequence[str]) -> list[Json]:
    if not text.endswith("\n\n"):
        return [f"<framing: stream does not end with a blank line: {text[-40:]!r}>"]
    events: list[Json] = []
    for block in text[:-2].split("\n\n"):
        if not block.startswith("data: ") or "\n" in block:
            return [f"<framing: not one `data: ` line per event: {block[:80]!r}>"]
        data = block[len("data: ") :]
        events.append("[DONE]" if data == "[DONE]" else shape(json.loads(data), exact))
    return _group_choices(events)


def _choice_index(event: Json) -> int | None:
    if isinstance(event, dict) and isinstance(event.get("choices"), list):
        indexes = [c.get("index") for c in event["choices"] if isinstance(c, dict)]
        if len(indexes) == 1 and isinstance(indexes[0], int):
            return indexes[0]
    return None


def _group_choices(events: list[Json]) -> list[Json]:
    """Each run of single-choice chunks ordered by choice (stable), then repeats of a
    shape in a row kept once."""
    ordered: list[Json] = []
    run: list[Json] = []
    for event in [*events, None]:
        if event is not None and _choice_index(event) is not None:
            run.append(event)
            continue
        ordered.extend(sorted(run, key=lambda e: _choice_index(e) or 0))
        run = []
        if event is not None:
            ordered.append(event)
    out: list[Json] = []
    for event in ordered:
        if not out or out[-1] != event:
            out.append(event)
    return out


def _metric_names(text: str, dialect: str) -> dict[str, Json]:
    seen: dict[str, set[str]] = {}
    for line in text.splitlines():
        match = _METRIC_LINE.match(line)
        if match:
            labels = set(_LABEL.findall(match.group(2) or ""))
            seen.setdefault(match.group(1), set()).update(labels)
    out: dict[str, Json] = {name: name in seen for name in NARWHAL_METRICS[dialect]}
    if dialect == "vllm":
        info = seen.get("vllm:cache_config_info", set())
        out["vllm:cache_config_info labels"] = [k for k in CACHE_INFO_LABELS if k in info]
    return out


def differences(recorded: Json, actual: Json, path: str = "") -> list[str]:
    """Where `actual` differs from `recorded`, one line per difference."""
    if isinstance(recorded, dict) and isinstance(actual, dict):
        lines: list[str] = []
        for k in sorted(set(recorded) | set(actual)):
            where = f"{path}.{k}" if path else k
            if k not in actual:
                lines.append(f"{where}: missing (recorded {_short(recorded[k])})")
            elif k not in recorded:
                lines.append(f"{where}: not recorded (got {_short(actual[k])})")
            else:
                lines.extend(differences(recorded[k], actual[k], where))
        return lines
    if isinstance(recorded, list) and isinstance(actual, list) and len(recorded) == len(actual):
        lines = []
        for i, (r, a) in enumerate(zip(recorded, actual, strict=True)):
            lines.extend(differences(r, a, f"{path}[{i}]"))
        return lines
    if recorded == actual:
        return []
    return [f"{path}: recorded {_short(recorded)}, got {_short(actual)}"]


def _short(value: Json) -> str:
    text = json.dumps(value)
    return text if len(text) <= 300 else text[:300] + "..."


def load_recorded(path: Path = RECORDED["vllm"]) -> dict[str, Json]:
    doc: dict[str, Json] = json.loads(path.read_text())
    return doc


def compare(recorded: Mapping[str, Json], answers: Mapping[str, Json]) -> list[str]:
    """Every difference between the recorded answers and these, by case."""
    lines: list[str] = []
    for name in sorted(set(recorded) | set(answers)):
        if name not in answers:
            lines.append(f"{name}: not answered")
        elif name not in recorded:
            lines.append(f"{name}: not recorded (run tools/engines/record_conformance.py)")
        else:
            lines.extend(f"{name}: {line}" for line in differences(recorded[name], answers[name]))
    return lines
