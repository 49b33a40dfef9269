"""Synthetic profiles and configs for the profile tests."""

from __future__ import annotations

from typing import Any

from narwhal.config import Config, load_config
from narwhal.profiles import (
    DecodeModel,
    EngineProfile,
    HandoffBucket,
    HandoffProfile,
    PrefillModel,
    ProfileStore,
)

MODEL = "sim-llama-3-8b"
BUILD = "vllm 0.29.0 [narwhal-sim test] model=sim-llama-3-8b max_model_len=8192"


def prefill(a: float = 0.006, b: float = 2e-5, c: float = 7e-10) -> PrefillModel:
    return PrefillModel(
        a_s=a, b_s_per_token=b, c_s_per_token2=c, min_tokens=2, max_tokens=7800, samples=30
    )


def decode(t0: float = 0.006, alpha: float = 4.4e-8, beta: float = 3e-5) -> DecodeModel:
    return DecodeModel(
        t0_s=t0,
        kv_s_per_token=alpha,
        active_s_per_request=beta,
        idle_floor_s=t0 + 1e-5,
        min_active=1,
        max_active=64,
        min_kv_tokens=260,
        max_kv_tokens=135000,
        samples=200,
    )


def engine(
    engine_id: str,
    url: str,
    *,
    build: str = BUILD,
    model: str = MODEL,
    dialect: str = "vllm",
    **kw: Any,
) -> EngineProfile:
    return EngineProfile(
        id=engine_id,
        url=url,
        dialect=dialect,
        model=model,
        build=build,
        max_model_len=8192,
        kv_capacity_tokens=450000,
        kv_capacity_source="vllm:cache_config_info num_gpu_blocks x block_size",
        prefill=kw.pop("prefill", prefill()),
        decode=kw.pop("decode", decode()),
        chars_per_token=kw.pop("chars_per_token", 4.5),
    )


def handoff(p: str, d: str, scale: float = 1.0) -> HandoffProfile:
    return HandoffProfile(
        prefill=p,
        decode=d,
        buckets=tuple(
            HandoffBucket(
                tokens=t,
                min_tokens=t - 1,
                max_tokens=t + 1,
                samples=4,
                p50_s=scale * (0.008 + 2.6e-6 * t),
                p99_s=scale * (0.010 + 2.8e-6 * t),
                first_token_p50_s=scale * (0.008 + 2.6e-6 * t),
                first_token_p99_s=scale * (0.010 + 2.8e-6 * t),
            )
            for t in (64, 1950, 3900, 7780)
        ),
    )


def store_for(urls: dict[str, str], *, build: str = BUILD) -> ProfileStore:
    engines = {engine_id: engine(engine_id, url, build=build) for engine_id, url in urls.items()}
    ids = list(urls)
    pairs = [(p, d) for p in ids for d in ids if p != d] or [(ids[0], ids[0])]
    return ProfileStore(
        created_at="2026-01-01T00:00:00+00:00",
        tool="test",
        engines=engines,
        handoffs={pair: handoff(*pair) for pair in pairs},
        chars_per_token={"vllm": 4.5},
        sweep={"duration_s": 1.0},
    )


def config_document(
    urls: dict[str, str], *, profiles: str = "runs/profiles.json", **sections: Any
) -> dict[str, Any]:
    document: dict[str, Any] = {
        "engines": [{"id": e, "url": u, "model": MODEL} for e, u in urls.items()],
        "profiles": {"path": profiles},
    }
    for key, value in sections.items():
        document[key] = {**document.get(key, {}), **value}
    return document


def config_for(
    urls: dict[str, str], *, profiles: str = "runs/profiles.json", **sections: Any
) -> Config:
    return load_config(config_document(urls, profiles=profiles, **sections))
