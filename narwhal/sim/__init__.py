"""narwhal-sim: a simulated vLLM / SGLang engine fleet for tests, demos and benchmarks.

Each simulated engine is a continuous-batching scheduler (`SchedulerCore`) behind an h11 +
trio HTTP server that speaks vLLM's (or SGLang's) OpenAI API, P/D handoff and auxiliary
endpoints. Wire shapes follow docs/design.md#engine-wire-facts; the latency law is
docs/design.md#simulated-latency.

In-process use (stable API)::

    from functools import partial
    from narwhal.sim import serve_fleet

    async def test_something(nursery):
        fleet = await nursery.start(partial(serve_fleet, engines=4, speed=50))
        fleet[0].url                  # "http://127.0.0.1:<ephemeral port>"
        fleet[0].set_faults(error_status=503, leg="prefill", count=1)
        fleet[0].clear_faults()
        fleet[0].state()              # same document as GET /_sim/state
        await fleet[1].go_down()      # connection refused until ...
        await fleet[1].come_up()
        await fleet[2].restart()      # drop in-flight work and KV, new instance id

`serve_fleet(*, engines, host="127.0.0.1", port=0, spec=None, dialect=None, speed=None,
lease_s=None, model=None, seed=None, build=None, vllm_version=None, max_num_queued=None,
timing=None, disaggregation_modes=None, kv_connectors=None, api_key=None, task_status)`
serves until cancelled. ``port=0`` gives each engine its own free port below the kernel's
ephemeral range (so a restarted engine can bind it again); a base port gives consecutive
ports. Keyword options override fields of `SimEngineSpec`.

vLLM builds: a vLLM engine plays the build ``vllm_version`` names (CLI ``--vllm-version``),
one of `VLLM_BUILDS`; Narwhal supports vLLM 0.29 and 0.32. ``"0.32.0"`` (the default) is
checked against answers recorded on real vLLM 0.32.0 (tests/conformance): it serves a
prompt + ``max_tokens`` over the context with the output capped, refusing only a prompt
alone over it or ``max_tokens`` above ``max_model_len``, reads a completion's
``max_tokens: null`` as 16, and answers with 0.32's fields. ``"0.29.0"`` plays the
behaviour docs/design.md#engine-wire-facts describes (such a request refused, null
unbounded, 0.29's fields). `_vllm_builds` has the table. Both builds serve ``n > 1``, logprobs and
stop strings, and send the engine's own input checks (token ids out of vocabulary, logprobs
above 20) after a stream's 200 as an error event with code 400, then ``[DONE]``. A vLLM
engine has a KV connector unless its spec's ``kv_connector`` is false (``kv_connectors=``
per engine, CLI ``--kv-connector none``): without one it serves a P/D leg as a plain
request (``kv_transfer_params`` null, no lease kept) and exports no ``vllm:nixl_*`` metrics.

SGLang engines play SGLang 0.5.23, checked against answers recorded on it
(tests/conformance; `_sglang` has its rules). Roles are fixed at launch, as in SGLang
(docs/design.md#sglang-bootstrap): each engine has a ``disaggregation_mode``
(``disaggregation_modes=["prefill", "decode"]``, CLI ``--disaggregation-mode
prefill,decode``). A ``"null"`` engine (the default) is an aggregate server and ignores
bootstrap fields; a prefill or decode one serves only its own leg of a bootstrap pair and
answers a request without ``bootstrap_room`` with 400 in SGLang's flat error shape. The
simulator has no API that changes a role. vLLM engines take the leg each request's
``kv_transfer_params`` names. An SGLang engine's ``/tokenize`` counts chat ``messages``
as its chat completions render them; ``tokenize_messages=False`` (CLI
``--no-tokenize-messages``) plays an older build, which requires a ``prompt`` (a messages
body gets FastAPI's 400). It has no ``/version`` (404; ``/get_server_info`` names the
version) and publishes its load gauges only once its scheduler has reported (a decode
server after 40 decode steps).

Requests are validated as each engine does (docs/design.md#engine-errors): a vLLM engine refuses a
``model`` other than its own with 404; an SGLang one takes any name and refuses a
``base:adapter`` LoRA selection, as SGLang without ``--enable-lora`` does. A request that
sets no output bound (a chat without ``max_tokens``; on vLLM 0.29 a completion with
``max_tokens: null``, which SGLang refuses) generates ``unbounded_max_tokens`` tokens
(default 256, CLI ``--unbounded-max-tokens``) within the context; the engines run it to the
context, which ``None`` (CLI ``context``) does too. SGLang serves ``n > 1`` on an
aggregate server; a bootstrap pair given it never answers, as SGLang's does not.

`SimTiming` is the latency law in seconds at speed 1 (defaults: Llama-3-8B bf16 on one
H100); ``--speed K`` / ``speed=K`` divides every duration (steps, KV transfer, lease,
SGLang timeouts) by K. `SimTiming.zero()` is an instant engine whose steps still take
``min_step_s`` so a busy engine never spins (CLI: ``--zero``). `SchedulerCore` / `CoreRequest` /
`idle_prefill_s` are the pure step arithmetic (no I/O) for tests and profile checks.

Faults (`FaultSpec`, see `narwhal.sim._faults` for every key) are set per engine with
``POST /_sim/faults`` (JSON object), cleared with ``DELETE /_sim/faults``, or per request
with the header ``X-Sim-Fault: <json object>`` (which replaces the engine's faults for that
request). Fault durations are wall-clock seconds. Examples::

    {"error_status": 503, "leg": "prefill", "count": 2}     # first two P legs get 503
    {"crash_after_tokens": 5, "leg": "decode"}              # drop TCP after 5 tokens
    {"sse_error_after_tokens": 3}                           # error event + [DONE]
    {"stall_after_tokens": 4}                               # hang forever after 4 tokens
    {"lease_s": 0.05}                                       # KV produced here expires fast
    {"down_s": 2.0}   {"health_flap_period_s": 1.0}   {"unhealthy": true}
    {"metrics_stall_s": 3600}                               # /metrics never answers
    {"decode_slowdown": 3.0}                                # decode steps 3x the law

Prefix caching (vLLM engines, off unless ``prefix_caching=True``, CLI
``--enable-prefix-caching``): each engine caches its prompts' full blocks
(``timing.block_size`` tokens, CLI ``--block-size``) under vLLM's own chained hashes
(`narwhal.prefix`), LRU-evicted within ``kv_capacity_tokens``; a prompt's cached prefix is
not prefilled again. ``prompt_tokens_details=True`` (``--enable-prompt-tokens-details``)
reports ``usage.prompt_tokens_details.cached_tokens``; ``kv_events=KvEventsConfig(...)``
(``--kv-events-config``, vLLM's JSON) publishes BlockStored / BlockRemoved /
AllBlocksCleared on ZMQ as vLLM does, with its replay socket. ``POST /reset_prefix_cache``
empties the cache; a restart starts an empty one whose event seq counts from 0 again.

Everything the simulator reports is wall-clock. When the process is CPU-bound the step
loop falls behind the law; ``/_sim/state`` counts that under ``step_lag`` (a speed below 1
is valid and runs the fleet in slow motion, which keeps a CPU-bound benchmark faithful).

Simulator-only endpoints on every engine: ``GET /_sim/state[?outcomes=N]``,
``GET|POST|DELETE /_sim/faults``, ``POST /_sim/restart``, and the engine-to-engine side
channel ``POST /_sim/nixl/{pull,heartbeat,release}`` and ``POST /_sim/bootstrap/transfer``.
"""

from ._core import (
    CoreRequest as CoreRequest,
    ReqState as ReqState,
    SchedulerCore as SchedulerCore,
    StepPlan as StepPlan,
    StepResult as StepResult,
    idle_prefill_s as idle_prefill_s,
)
from ._engine import SimEngine as SimEngine
from ._events import KvEventsConfig as KvEventsConfig
from ._faults import (
    FaultSpec as FaultSpec,
    FaultSpecError as FaultSpecError,
    parse_faults as parse_faults,
)
from ._fleet import EngineHandle as EngineHandle, Fleet as Fleet, serve_fleet as serve_fleet
from ._spec import (
    DEFAULT_MODEL as DEFAULT_MODEL,
    DISAGGREGATION_MODES as DISAGGREGATION_MODES,
    ENGINE_VERSION as ENGINE_VERSION,
    Dialect as Dialect,
    DisaggregationMode as DisaggregationMode,
    SimEngineSpec as SimEngineSpec,
)
from ._timing import SimTiming as SimTiming
from ._tokenizer import Tokenizer as Tokenizer, render_chat as render_chat
from ._vllm_builds import (
    DEFAULT_VLLM_VERSION as DEFAULT_VLLM_VERSION,
    VLLM_BUILDS as VLLM_BUILDS,
    VllmBuild as VllmBuild,
)
