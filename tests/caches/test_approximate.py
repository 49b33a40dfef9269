"""The approximate source, for engines without KV events: what a prompt would find
cached is the share of it learnt from the prompts routed there, within the TTL, below
the whole prompt; restarts, reloads and a departure reset it, a role change does not. No sockets:
an EngineCaches without events opens none."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio
from prometheus_client import CollectorRegistry, generate_latest

from narwhal.caches import EngineCaches
from narwhal.config import Config, load_config
from narwhal.fleet import Fleet
from narwhal.prefix import TEXT_BLOCK_CHARS, prompt_key

B = TEXT_BLOCK_CHARS
SHARED = "s" * (3 * B)
# 4 full blocks and a tail; 3 blocks shared with OTHER.
PROMPT = prompt_key(SHARED + "p" * (B + 100), 300)
OTHER = prompt_key(SHARED + "o" * B, 200)


def config(**cache: Any) -> Config:
    return load_config(
        {
            "engines": [
                {"id": "a", "url": "http://127.0.0.1:9"},
                {"id": "b", "url": "http://127.0.0.1:10"},
            ],
            "cache": cache,
        }
    )


@asynccontextmanager
async def running(cfg: Config) -> AsyncIterator[tuple[EngineCaches, Fleet, CollectorRegistry]]:
    fleet = Fleet(cfg)
    registry = CollectorRegistry()
    caches = EngineCaches(fleet, cfg, registry)
    async with trio.open_nursery() as nursery:
        await nursery.start(caches.run)
        yield caches, fleet, registry
        nursery.cancel_scope.cancel()


def state(caches: EngineCaches, engine_id: str = "a") -> dict[str, Any]:
    return attrs.asdict(caches.state().engines[engine_id])


async def test_a_routed_prompt_is_found_cached_in_the_share_it_shares() -> None:
    async with running(config()) as (caches, _, registry):
        assert caches.cached_tokens("a", PROMPT, 0.0) == 0
        caches.routed("a", PROMPT, 0.0)
        # All of its full blocks, 4 * 256 of 1124 chars: floor(1024 / 1124 * 300).
        assert caches.cached_tokens("a", PROMPT, 1.0) == 273
        assert caches.cached_tokens("a", OTHER, 1.0) == 3 * B * 200 // OTHER.chars
        assert caches.cached_tokens("b", PROMPT, 1.0) == 0
        assert caches.cached_tokens("gone", PROMPT, 1.0) == 0
        section = caches.state()
        assert section.approximate_ttl_s == 300.0
        engine = state(caches)
        assert (engine["source"], engine["blocks"], engine["learnt"]) == ("approximate", 4, 1)
        assert (engine["endpoint"], engine["block_size"], engine["resets"]) == (None, None, {})
        assert repr(caches) == "<EngineCaches [a: ~4, b: ~0]>"
        scraped = generate_latest(registry).decode()
        assert 'narwhal_cache_source{engine="a",source="approximate"} 1.0' in scraped
        assert 'narwhal_cache_blocks{engine="a"} 4.0' in scraped
        # The TTL counts from the last use.
        assert caches.cached_tokens("a", PROMPT, 300.5) == 0
        assert state(caches)["expired"] == 4
        scraped = generate_latest(registry).decode()
        assert 'narwhal_cache_expired_blocks_total{engine="a"} 4.0' in scraped


async def test_a_prompt_learnt_whole_is_cached_but_for_its_last_token() -> None:
    async with running(config()) as (caches, _, _):
        whole = prompt_key("w" * (2 * B), 128)
        caches.routed("a", whole, 0.0)
        assert caches.cached_tokens("a", whole, 0.0) == 127
        one = prompt_key("w" * B, 1)
        assert caches.cached_tokens("a", one, 0.0) == 0
        assert caches.cached_tokens("a", prompt_key("", 0), 0.0) == 0


async def test_a_restart_resets_the_learnt_prompts_and_a_role_change_does_not() -> None:
    async with running(config()) as (caches, fleet, _):
        live = fleet.get("a")
        assert live is not None
        caches.routed("a", PROMPT, 0.0)
        live.recovery_new_instance()
        assert caches.cached_tokens("a", PROMPT, 0.0) == 0
        caches.routed("a", PROMPT, 0.0)
        held = caches.cached_tokens("a", PROMPT, 0.0)
        assert held == 4 * B * 300 // PROMPT.chars
        # A role move is the router's: the engine keeps what it cached.
        live.role = "decode"
        assert caches.cached_tokens("a", PROMPT, 0.0) == held
        caches.routed("a", OTHER, 0.0)
        assert caches.cached_tokens("a", OTHER, 0.0) == 199
        engine = state(caches)
        assert engine["resets"] == {"restart": 1}
        assert engine["learnt"] == 3


async def test_a_reload_follows_the_ttl_the_bound_and_the_fleet() -> None:
    async with running(config(max_blocks_per_engine=2)) as (caches, fleet, _):
        caches.routed("a", PROMPT, 0.0)
        caches.routed("b", PROMPT, 0.0)
        assert state(caches)["dropped"] == 2
        caches.reconfigure(config(approximate_ttl_s=10.0, max_blocks_per_engine=2))
        assert caches.state().approximate_ttl_s == 10.0
        assert caches.cached_tokens("a", PROMPT, 10.5) == 0
        caches.routed("a", PROMPT, 20.0)
        # The TTL at 0: nothing is known, nothing learnt.
        caches.reconfigure(config(approximate_ttl_s=0))
        assert state(caches)["source"] == "none"
        caches.routed("a", PROMPT, 20.0)
        assert caches.cached_tokens("a", PROMPT, 20.0) == 0
        assert repr(caches) == "<EngineCaches []>"
        # On again: learning starts from nothing.
        caches.reconfigure(config())
        assert (state(caches)["source"], state(caches)["blocks"]) == ("approximate", 0)
        caches.routed("b", PROMPT, 30.0)
        # An engine that leaves the fleet takes its index with it.
        fleet.retire("b")
        caches.reconfigure(config())
        assert caches.cached_tokens("b", PROMPT, 30.0) == 0
        assert set(caches.state().engines) == {"a"}
