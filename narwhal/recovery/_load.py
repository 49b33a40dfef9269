"""An engine's own view of its load, from its Prometheus /metrics page.

Owns
  `parse_load` and the metric names of each dialect; `METRICS_BODY_LIMIT`.

Invariants
  Only the wanted lines are parsed (a vLLM page is ~100 KB, read every monitor pass).
  What only feeds restart detection (the process start time, the prompt-token counter)
  is skipped when malformed rather than failing the scrape.

Errors
  `ScrapeError` when the page is not utf-8 or lacks, or garbles, a load gauge.
"""

from __future__ import annotations

import math

from ._evidence import LoadSample, ScrapeError

# A vLLM /metrics page is ~100 KB; the bound is for a broken or hostile engine.
METRICS_BODY_LIMIT = 8 * 1024 * 1024

# vLLM and SGLang name the same three gauges differently.
_LOAD_NAMES: dict[str, tuple[str, str, str]] = {
    "vllm": ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"),
    "sglang": ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage"),
}
_PROMPT_COUNTER = {"vllm": "vllm:prompt_tokens_total", "sglang": "sglang:prompt_tokens_total"}
# Older vLLM builds only have the deprecated name.
_KV_FALLBACK = {"vllm": "vllm:gpu_cache_usage_perc"}
# SGLang (0.5.23) sets its load gauges only when its scheduler reports: a prefill or
# aggregate server at its first batch, a decode server after 40 decode steps or at an
# idle tick after serving. Until then its /metrics has the rest of its metrics (it was
# started with --enable-metrics), among them this one, set at start-up: a page with it
# and without the gauges is a fresh server's.
_GAUGES_LATER = {"sglang": "sglang:max_total_num_tokens"}
_START_TIME = "process_start_time_seconds"


def parse_load(raw: bytes, dialect: str) -> LoadSample:
    """Running and waiting requests (summed over data-parallel ranks), KV usage (the
    fullest rank) and, when reported, the process start time and the prompt-token counter
    of each rank, from Prometheus text. Only the wanted lines are parsed: a vLLM /metrics
    page is ~100 KB and is read every monitor pass. The last two only feed restart
    detection, so a malformed value there is skipped rather than failing the scrape. A
    fresh SGLang server's page without the gauges reads as no load, `gauges_pending`."""
    running_name, waiting_name, kv_name = _LOAD_NAMES.get(dialect, _LOAD_NAMES["vllm"])
    kv_fallback = _KV_FALLBACK.get(dialect)
    prompt_name = _PROMPT_COUNTER.get(dialect, _PROMPT_COUNTER["vllm"])
    later = _GAUGES_LATER.get(dialect)
    optional = {_START_TIME, prompt_name}
    if later:
        optional.add(later)
    wanted = {running_name, waiting_name, kv_name, *optional}
    if kv_fallback:
        wanted.add(kv_fallback)
    found: dict[str, list[float]] = {}
    prompt: list[tuple[str, float]] = []
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ScrapeError("GET /metrics: body is not utf-8") from None
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        end = len(line)
        for sep in ("{", " "):
            index = line.find(sep)
            if index != -1:
                end = min(end, index)
        name = line[:end]
        if name not in wanted:
            continue
        labels_end = line.rindex("}") + 1 if "{" in line[end : end + 1] else end
        fields = line[labels_end:].split()
        value = math.nan
        problem = None if fields else f"no value for {name}"
        if fields:
            try:
                value = float(fields[0])
            except ValueError:
                problem = f"bad value for {name}: {fields[0]!r}"
        if problem is not None:
            if name in optional:
                continue
            raise ScrapeError(f"GET /metrics: {problem}")
        if not math.isfinite(value):
            continue
        if name == prompt_name:
            prompt.append((line[end:labels_end], value))
        else:
            found.setdefault(name, []).append(value)
    pending = False
    if running_name not in found or waiting_name not in found:
        missing = [n for n in (running_name, waiting_name) if n not in found]
        if len(missing) < 2 or later not in found:
            raise ScrapeError(f"GET /metrics lacks {', '.join(missing)}")
        pending = True
    kv_values = found.get(kv_name) or (found.get(kv_fallback) if kv_fallback else None)
    started = found.get(_START_TIME)
    return LoadSample(
        running=sum(found.get(running_name, [])),
        waiting=sum(found.get(waiting_name, [])),
        kv_usage=max(kv_values) if kv_values else None,
        started_at=max(started) if started else None,
        prompt_tokens=tuple(prompt) if prompt else None,
        gauges_pending=pending,
    )
