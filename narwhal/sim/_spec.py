"""Options of one simulated engine."""

from __future__ import annotations

from typing import Any, Literal

import attrs

from ._events import KvEventsConfig
from ._timing import SimTiming
from ._vllm_builds import DEFAULT_VLLM_VERSION, VLLM_BUILDS, VllmBuild

Dialect = Literal["vllm", "sglang"]
# SGLang's --disaggregation-mode; "null" (its default) is an ordinary aggregate server.
DisaggregationMode = Literal["null", "prefill", "decode"]
DISAGGREGATION_MODES: tuple[DisaggregationMode, ...] = ("null", "prefill", "decode")
# The launch modes each dialect has: vLLM none (each request names its leg:
# docs/design.md#vllm-nixl-handoff).
LAUNCH_MODES: dict[Dialect, tuple[DisaggregationMode, ...]] = {
    "vllm": ("null",),
    "sglang": DISAGGREGATION_MODES,
}

# The engine versions whose wire behaviour the simulator follows by default; a vLLM
# engine plays the build its spec's vllm_version names (`_vllm_builds.VLLM_BUILDS`).
ENGINE_VERSION = {"vllm": DEFAULT_VLLM_VERSION, "sglang": "0.5.23"}
DEFAULT_MODEL = "meta-llama/Meta-Llama-3-8B-Instruct"
SIM_BUILD = "narwhal-sim 0.1.0.dev0"


def _positive(_inst: object, attr: attrs.Attribute[Any], value: float) -> None:
    if not value > 0:
        raise ValueError(f"{attr.name} is {value!r}; must be > 0")


def _optional_positive_int(_inst: object, attr: attrs.Attribute[Any], v: int | None) -> None:
    if v is not None and v < 1:
        raise ValueError(f"{attr.name} is {v!r}; must be >= 1 or None")


@attrs.frozen(kw_only=True)
class SimEngineSpec:
    """Everything that configures one simulated engine.

    Durations are seconds at speed 1; the engine divides every one of them (step times, KV
    transfer, lease, timeouts) by ``speed``. ``keep_alive_s`` is wall-clock, like uvicorn's.
    """

    dialect: Dialect = attrs.field(
        default="vllm", validator=attrs.validators.in_(("vllm", "sglang"))
    )
    # SGLang --disaggregation-mode, fixed for the engine's life (docs/design.md#sglang-bootstrap): a
    # prefill or decode server takes only its own leg of a bootstrap pair and answers a request
    # without bootstrap_room with 400; "null" serves every request as aggregate. vLLM has no launch
    # role (each request names its leg, docs/design.md#vllm-nixl-handoff), so it must stay "null".
    disaggregation_mode: DisaggregationMode = attrs.field(
        default="null", validator=attrs.validators.in_(DISAGGREGATION_MODES)
    )
    # The vLLM build a vllm engine plays (`_vllm_builds.VLLM_BUILDS`): its /version and every
    # behaviour that differs between the builds Narwhal supports.
    vllm_version: str = attrs.field(
        default=DEFAULT_VLLM_VERSION, validator=attrs.validators.in_(tuple(VLLM_BUILDS))
    )
    # Whether a vllm engine was launched with a KV connector (--kv-transfer-config). Without
    # one it serves a P/D leg's kv_transfer_params as an ordinary request: a prefill leg
    # generates its max_tokens and answers kv_transfer_params null, a decode leg computes
    # the prompt itself, and /metrics has no nixl_* series. SGLang engines ignore it.
    kv_connector: bool = True
    model: str = DEFAULT_MODEL
    speed: float = attrs.field(default=1.0, validator=_positive)
    # vLLM kv_lease_duration (NIXL lease on produced KV, docs/design.md#kv-lease).
    lease_s: float = attrs.field(default=30.0, validator=_positive)
    seed: int = 0
    # Not Narwhal's version, which changes with every commit (git describe): a profile
    # store is refused when the build it measured changes, and runs/profiles.json (the
    # demo's) was measured on this one. Change it when the simulator's timing changes.
    build: str = SIM_BUILD
    # The version as the stock engines report it (vLLM's /version, SGLang's
    # /get_server_info): the version alone, no build or instance id, so a restart shows
    # only in /metrics or as an unreachable period.
    stock_version: bool = False
    # The output bound of a request that sets none: a chat without max_tokens or
    # max_completion_tokens (both dialects) or a vLLM 0.29 completion with max_tokens null (an
    # absent one is 16). It generates min(this, context - prompt) tokens, at least its
    # min_tokens. The real engines run such a request to the context (vLLM: unless the
    # model's generation_config.json sets max_new_tokens, which caps every request, bounded
    # or not). A simulated fleet keeps a chat answer's order instead, so that a test or a
    # benchmark that leaves the bound out does not decode thousands of tokens per request;
    # None runs to the context as the engines do.
    unbounded_max_tokens: int | None = attrs.field(default=256, validator=_optional_positive_int)
    # vLLM --max-num-queued-reqs (waiting + running); None means unbounded, as vLLM's default.
    max_num_queued: int | None = attrs.field(default=None, validator=_optional_positive_int)
    timing: SimTiming = attrs.Factory(SimTiming)
    # uvicorn's default keep-alive timeout (vLLM VLLM_HTTP_TIMEOUT_KEEP_ALIVE).
    keep_alive_s: float = attrs.field(default=5.0, validator=_positive)
    # SGLang SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT / WAITING_TIMEOUT
    # (docs/design.md#sglang-bootstrap).
    bootstrap_timeout_s: float = attrs.field(default=300.0, validator=_positive)
    waiting_timeout_s: float = attrs.field(default=300.0, validator=_positive)
    # Generated tokens per streamed event (SGLang --stream-interval). vLLM packs tokens the
    # same way when its API server falls behind the engine (v1 RequestOutputCollector merges
    # deltas) or speculative decoding accepts several tokens in one step.
    stream_interval: int = attrs.field(default=1, validator=_optional_positive_int)
    # SGLang: whether /tokenize also takes chat `messages`, rendered as the chat completion
    # renders them, as 0.5.23's does (TokenizeRequest, sglang protocol.py@004c82e0).
    # False plays an older build, whose /tokenize requires `prompt` and answers a messages
    # body with FastAPI's validation error (400). vLLM's /tokenize always takes messages.
    tokenize_messages: bool = True
    # SGLang's /tokenize `max_model_len`: its tokenizer's model_max_length, or None for
    # the server's context, which SGLang reports when the tokenizer config's is past a
    # 64-bit integer (as the default model's, 1e30, is). A Llama-3.1 tokenizer says 131072
    # whatever the server's context.
    tokenizer_max_length: int | None = attrs.field(default=None, validator=_optional_positive_int)
    # The engine's --api-key: requests to the routes the real engine guards must carry
    # `Authorization: Bearer <api_key>` or get its 401 (see `EngineProtocol.requires_api_key`).
    api_key: str | None = None
    # Bound on the per-request outcome ring kept for /_sim/state.
    outcome_ring: int = attrs.field(default=10_000, validator=_positive)
    # vLLM --enable-prefix-caching: a prompt's cached full blocks (timing.block_size
    # tokens each, chained hashes as vLLM's) are shared instead of computed, within
    # timing.kv_capacity_tokens, LRU-evicted (`_blocks`). Real vLLM has it on by default;
    # the simulator keeps it off unless asked, so that the timing every existing test,
    # profile and benchmark was measured under does not move. vllm engines only.
    prefix_caching: bool = False
    # vLLM --enable-prompt-tokens-details: usage carries prompt_tokens_details with the
    # prompt tokens the cache served (cached_tokens).
    prompt_tokens_details: bool = False
    # vLLM --kv-events-config with events on and the zmq publisher (`_events`); needs
    # prefix_caching, without which vLLM has no cache to report on.
    kv_events: KvEventsConfig | None = None

    def __attrs_post_init__(self) -> None:
        if self.disaggregation_mode not in LAUNCH_MODES[self.dialect]:
            raise ValueError(
                f"disaggregation_mode is {self.disaggregation_mode!r}; only sglang engines "
                "have a launch role (vllm takes the leg each request names)"
            )
        if (self.prefix_caching or self.kv_events is not None) and self.dialect != "vllm":
            raise ValueError(
                "prefix_caching and kv_events are simulated for vllm engines only "
                f"(dialect is {self.dialect!r})"
            )
        if self.kv_events is not None and not self.prefix_caching:
            raise ValueError("kv_events needs prefix_caching: without it there is no cache")

    @property
    def vllm(self) -> VllmBuild:
        return VLLM_BUILDS[self.vllm_version]

    def scaled(self, seconds: float) -> float:
        """Wall-clock seconds for a model duration."""
        return seconds / self.speed
