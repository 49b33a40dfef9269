"""The configuration model: one frozen attrs class per section.

Every setting is here with its default (docs/design.md has the rules they serve). Ranges
are attached as metadata (see `_rules`) and cross-field rules live in `_cross`; both
are enforced by `load_config`, which reports every problem at once. The `doc` text of
each field is the meaning column of the generated `docs/configuration.md` (at most two
sentences, a test checks); its `notes` go under the section's table.
"""

from __future__ import annotations

from typing import Literal, TypeVar
from urllib.parse import urlsplit

import attrs

from ..tokenizer import LocalTokenizer
from ._rules import (
    AtLeast,
    Between,
    Credential,
    HttpOrigin,
    KeyPrefix,
    NonNegative,
    Positive,
    ReplicaName,
    Rule,
    SocketPath,
    Text,
    ZeroOrAtLeast,
    ZmqEndpoint,
)

Dialect = Literal["vllm", "sglang"]
Role = Literal["prefill", "decode", "both"]
KvRole = Literal["kv_both", "kv_producer", "kv_consumer"]
Admission = Literal["predictive", "open"]
LogLevel = Literal["debug", "info", "warning", "error"]
T = TypeVar("T")

# Marks a field the loader fills in from elsewhere (a file the document names): it is
# not a key of the document, not in `config_to_dict`, and not in the reference.
RESOLVED = "resolved"
# Marks a field holding credentials (Secret values): rendered redacted, compared apart.
SECRET = "secret"
# Marks a file path: a relative one is taken from the folder of the configuration file
# (`_resolve`), so the daemon, a reload and every command agree wherever they run.
PATH = "path"
# What every path field's doc says of it (the reference explains the rest).
RELATIVE = " A relative path is taken from the config file's folder."


@attrs.frozen(repr=False)
class Secret:
    """A credential read from a file. Only `reveal()` gives the text, for the wire; every
    other rendering (repr, str, logs, state, reload changes) shows it redacted."""

    _value: str = attrs.field(alias="value")

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "<redacted>"

    __str__ = __repr__


def _meta(*rules: Rule, doc: str, notes: str = "") -> dict[str, object]:
    """`doc`: the reference's meaning cell, at most two sentences; `notes`: the rest,
    printed under the section's table."""
    return {"rules": rules, "doc": doc, "notes": notes}


def _f(default: T, *rules: Rule, doc: str, notes: str = "") -> T:
    # Typed as the default so the attrs mypy plugin sees a plain default value.
    field: T = attrs.field(default=default, metadata=_meta(*rules, doc=doc, notes=notes))
    return field


def _path(default: T, *rules: Rule, doc: str, notes: str = "") -> T:
    field: T = attrs.field(
        default=default,
        metadata={**_meta(*rules, doc=doc, notes=(notes + RELATIVE).strip()), PATH: True},
    )
    return field


def _secret(doc: str, notes: str = "") -> dict[str, object]:
    """Metadata of a credential the document may hold inline (a string, or a list)."""
    return {**_meta(Credential(), doc=doc, notes=notes), SECRET: True}


def _resolved_secret(source: str) -> dict[str, object]:
    """Metadata of a credential the loader reads from the file the field `source` names."""
    return {RESOLVED: True, SECRET: True, "source": source, "doc": f"Read from `{source}`."}


@attrs.frozen(kw_only=True)
class KvEvents:
    """An engine's KV cache events: the keys of its `--kv-events-config` (vLLM), copied."""

    endpoint: str | None = _f(
        None,
        ZmqEndpoint(),
        doc=(
            "The engine's `endpoint`. `tcp://*:PORT` (the engine binds): Narwhal connects "
            "to the engine's host at PORT; a concrete `tcp://HOST:PORT` (the engine "
            "connects): Narwhal binds it; `null`: no events (see `cache.approximate_ttl_s`)."
        ),
        notes=(
            "Narwhal keeps an index of the blocks each engine with events holds "
            "(`cache.max_blocks_per_engine`); `/narwhal/state` shows it under `caches`. A "
            "gap in the events that the replay cannot fill, an engine restart, a role "
            "change or a changed endpoint empties that engine's index. The events name "
            "blocks by hashes of token ids: a prompt is priced as cached on the engine only "
            "when the router has its ids (`engine.tokenizer_path`, or a prompt sent as "
            "ids); without them it is priced uncached there, which the daemon's start and "
            "`narwhal validate` warn of."
        ),
    )
    replay_endpoint: str | None = _f(
        None,
        ZmqEndpoint(),
        doc=(
            "The engine's `replay_endpoint` (always bound by the engine; `tcp://*:PORT` "
            "is reached at the engine's host), asked for missed batches; `null`: a gap "
            "empties the index."
        ),
    )
    topic: str = _f("", doc="The engine's `topic`: the prefix of the messages read.")

    @property
    def enabled(self) -> bool:
        return self.endpoint is not None


@attrs.frozen(kw_only=True)
class EngineSpec:
    """One engine of the fleet (`engines` is a list of these)."""

    @property
    def launch_fixes_role(self) -> str | None:
        """Why this vLLM engine's launch fixes its role, or None (the dialect may still)."""
        if self.kv_role in ("kv_producer", "kv_consumer"):
            return (
                f"a vllm engine launched with kv_role {self.kv_role!r} keeps the role it was "
                "launched for (vLLM's explicit NixlConnector roles); relaunch it with "
                "kv_both, or with the other kv_role, and change engines[].kv_role"
            )
        return None

    id: str = attrs.field(
        metadata=_meta(
            doc="Unique, non-blank engine name used by placement, state, metrics and narwhalctl."
        )
    )
    url: str = attrs.field(
        metadata=_meta(doc="Engine base URL, `http://host:port`, with no path beyond `/`.")
    )
    dialect: Dialect = attrs.field(
        default="vllm",
        metadata=_meta(
            doc="Engine API dialect. One fleet uses one dialect: KV handoff cannot cross them."
        ),
    )
    role: Role = attrs.field(
        default="both",
        metadata=_meta(
            doc="Initial role. The controller may change it at run time unless it is disabled; "
            "for an SGLang engine it is the server's launch mode (`--disaggregation-mode "
            "prefill|decode`, none for `both`), which neither the controller nor `narwhalctl "
            "pin` changes."
        ),
    )
    model: str = _f(
        "default", doc="Model the engine serves. All engines must serve the same model."
    )
    bootstrap_port: int | None = _f(
        None,
        Between(1, 65535),
        doc=(
            "SGLang only (rejected for vLLM engines): the engine's prefill bootstrap-server "
            "port (`--disaggregation-bootstrap-port`). `null` means SGLang's default, 8998, "
            "which the router then sends."
        ),
    )
    kv_role: KvRole | None = attrs.field(
        default=None,
        metadata=_meta(
            doc="vLLM only: the `kv_role` the engine was launched with in `--kv-transfer-config`. "
            "`kv_producer` (role `prefill`) and `kv_consumer` (role `decode`) fix its role, as "
            "SGLang's launch mode does; `null` or `kv_both` leaves it movable.",
            notes="Neither the controller nor `narwhalctl pin` changes a fixed role. vLLM 0.32 "
            "deprecates `kv_both` for NixlConnector but still serves either leg with any "
            "`kv_role`.",
        ),
    )
    prefill_concurrency: int | None = _f(
        None,
        NonNegative(),
        doc="Override of `serving.prefill_concurrency` for this engine; `null` inherits it.",
    )
    decode_concurrency: int | None = _f(
        None,
        NonNegative(),
        doc="Override of `serving.decode_concurrency` for this engine; `null` inherits it.",
    )
    api_key_file: str | None = _path(
        None,
        doc=(
            "Override of `engine.api_key_file` for this engine (an engine started with its "
            "own `--api-key`); `null` inherits it."
        ),
    )
    kv_events: KvEvents = attrs.field(factory=KvEvents)
    api_key: Secret | None = attrs.field(
        default=None,
        metadata={
            RESOLVED: True,
            "doc": "The key read from the effective `api_key_file`; never in the document.",
        },
    )

    def api_key_text(self) -> str | None:
        """The key to send, for the transport only; None when none is configured."""
        return None if self.api_key is None else self.api_key.reveal()

    def origin(self) -> tuple[str, int]:
        """(host, port) of a url the loader accepted."""
        parts = urlsplit(self.url)
        host = parts.hostname or ""
        return host, parts.port or 80


@attrs.frozen(kw_only=True)
class Slo:
    """Service-level objectives that admission, placement and role control price against."""

    ttft_s: float = _f(0.5, Positive(), doc="Time-to-first-token target, seconds.")
    tpot_s: float = _f(0.05, Positive(), doc="Time-per-output-token target, seconds.")
    percentile: float = _f(
        0.9,
        Between(0.0, 1.0, low_open=True),
        doc="Percentile at which SLO attainment is reported.",
    )


@attrs.frozen(kw_only=True)
class Listen:
    """The router's HTTP listener for clients: the OpenAI routes and `/health`."""

    host: str = _f("127.0.0.1", Text(), doc="Address the HTTP server binds.")
    port: int = _f(8000, Between(0, 65535), doc="HTTP port; `0` picks a free port.")
    max_open_connections: int = _f(
        4096,
        AtLeast(1),
        doc=(
            "Most client connections open at once, idle or not; more than "
            "`serving.max_connections + serving.queue_capacity`. At the limit a new "
            "connection takes the place of the one idle longest, or waits in the kernel's "
            "listen backlog while every connection has a request in flight."
        ),
        notes=(
            "An idle connection has no request in flight: it is between requests, or still "
            "sending its request head. The room above the retained-request ceiling leaves a "
            "connection for the ceiling's 429 and for `/health`. The default is eight times "
            "that ceiling at its defaults and bounds idle sockets to about 60 MB (about "
            "14 kB each). At start and at a reload the soft open-file limit (RLIMIT_NOFILE) "
            "is raised, up to the hard limit, to this plus a reserve: each engine's pools "
            "(`serving.max_connections` plus its control pool share) and 200 for sockets and "
            "files. Under a hard limit without room for it, fewer connections are kept open "
            "(the hard limit less the reserve; a WARNING, and `connections.limit` against "
            "`configured_limit` in `/narwhal/state`); one that leaves no more than "
            "`serving.max_connections + serving.queue_capacity` stops startup, or rejects "
            "the reload. A lower value at a reload closes nothing at once: it only holds new "
            "connections back until enough have closed."
        ),
    )
    max_open_connections_per_client: int = _f(
        0,
        NonNegative(),
        doc=(
            "Most connections one client address (an IPv6 address by its /64 prefix) may "
            "have open at once; `0` derives twice the retained-request ceiling, at least 64 "
            "and at most `listen.max_open_connections` (1024 at the defaults). Past it a new "
            "connection takes the place of that address's own longest-idle one, or, when "
            "none is idle, is answered 429 `connections_per_client` and closed."
        ),
        notes=(
            "The derived value lets one client alone hold a connection for every retained "
            "request and as many idle ones, while one address takes no more than a quarter "
            "of the default limit from everyone else. The 429 goes out at once, before the "
            "request is read, with `Retry-After: 1` and `connection: close`. Such refusals "
            "count in `narwhal_client_connections_refused_total`, and each address's are "
            "logged once when they begin and once when they end (event `client_limit`). "
            "Behind a reverse proxy every client has the proxy's address: set it to "
            "`listen.max_open_connections` there. A reload applies it to new connections."
        ),
    )

    api_keys: tuple[Secret, ...] = attrs.field(
        default=(),
        metadata=_secret(
            "API keys a client must send, one of them, as `Authorization: Bearer KEY` on every "
            "`/v1/` route (`/health` stays open); with none here or in `listen.api_keys_file`, "
            "none is asked. A request without one is answered 401 `missing_api_key` or "
            "`invalid_api_key` before anything else is looked at.",
            notes="OpenAI's SDKs send their `api_key` so. The 401 carries `WWW-Authenticate: "
            "Bearer` and counts in `narwhal_refusals_total{reason}`. Keys are compared in "
            "constant time and never shown (logs, `narwhal validate`, `/narwhal/state` and "
            "reload changes say `<redacted>`); keeping them in `listen.api_keys_file` keeps "
            "them out of this file too. A reload applies them to the next request.",
        ),
    )
    api_keys_file: str | None = _path(
        None,
        Text(),
        doc=(
            "File of API keys clients may send, one per line (blank lines and lines starting "
            "with `#` are skipped), taken with `listen.api_keys`; `null` reads none. It is "
            "read again at each reload, which an unreadable or malformed file, or one "
            "holding no key, rejects (the running keys stay)."
        ),
        notes=("A regular file of at most 1 MiB; at most 1000 keys in all."),
    )
    file_api_keys: tuple[Secret, ...] = attrs.field(
        default=(), metadata=_resolved_secret("api_keys_file")
    )

    def client_keys(self) -> tuple[Secret, ...]:
        """Every key a client may send; empty when none is asked."""
        return self.api_keys + self.file_api_keys


@attrs.frozen(kw_only=True)
class Admin:
    """The admin listener, apart from the clients' port: `GET /narwhal/state` (engines and
    their urls, requests in flight with their placement, the configuration's effects) and
    `GET /metrics` (Prometheus), which the client listener does not serve."""

    host: str = _f(
        "127.0.0.1",
        Text(),
        doc=(
            "Address the admin listener binds: loopback by default. On another address, "
            "set `admin.token` or `admin.token_file`; without one a WARNING says who can "
            "read the state."
        ),
    )
    port: int = _f(
        8001,
        Between(0, 65535),
        doc="Admin port, not the client port; `0` picks a free port.",
    )
    token: Secret | None = attrs.field(
        default=None,
        metadata=_secret(
            "Bearer token the admin routes ask for (`Authorization: Bearer TOKEN`; "
            "Prometheus: `authorization.credentials_file`); `null` asks none. A request "
            "without it, or with another, is answered 401 `missing_token` or "
            "`invalid_token`.",
            notes="Compared in constant time and never shown. At most one of `admin.token` "
            "and `admin.token_file`.",
        ),
    )
    token_file: str | None = _path(
        None,
        Text(),
        doc=(
            "File holding the admin token: one line of printable ASCII without spaces (one "
            "trailing newline is ignored), a regular file of at most 4096 bytes, read again "
            "at each reload (an unreadable or malformed one rejects the reload and the "
            "running token stays)."
        ),
    )
    file_token: Secret | None = attrs.field(default=None, metadata=_resolved_secret("token_file"))

    def bearer_token(self) -> Secret | None:
        """The token the admin routes ask for; None when they ask none."""
        return self.token if self.token is not None else self.file_token


@attrs.frozen(kw_only=True)
class Ctl:
    """The narwhalctl control socket."""

    socket: str = _path(
        "runs/narwhal.sock",
        SocketPath(),
        doc="Path of the AF_UNIX control socket, which `narwhalctl --config` reads too.",
    )


@attrs.frozen(kw_only=True)
class Log:
    """Logging."""

    level: LogLevel = attrs.field(default="info", metadata=_meta(doc="Minimum level logged."))


@attrs.frozen(kw_only=True)
class Serving:
    """Admission, waiting, phase concurrency, retries, byte limits and deadlines
    (docs/design.md#bounded-serving, #deadlines)."""

    admission: Admission = attrs.field(
        default="predictive",
        metadata=_meta(
            doc=(
                "`predictive` prices every prefill path against the TTFT target and "
                "constrains aggregate placement to the single-phase region covered by "
                "measurements; `open` disables both admission checks."
            )
        ),
    )
    admission_margin: float = _f(
        0.0,
        NonNegative(),
        doc="Fraction added to the TTFT admission budget to reduce boundary churn.",
    )
    max_connections: int = _f(
        512, AtLeast(1), doc="Global admitted-request limit and HTTP data-pool size."
    )
    workers: int = _f(
        1,
        Between(0, 256),
        doc=(
            "Worker processes serving clients around one decision core; `0` is one per "
            "CPU this process may run on, `1` serves in the daemon's own process."
        ),
        notes=(
            "`serving.workers`: every limit stays global (the core holds them for every "
            "worker; docs/architecture.md#workers). A change needs a restart."
        ),
    )
    queue_capacity: int = _f(
        0,
        NonNegative(),
        doc="Maximum requests waiting for admission. `0` rejects immediately at saturation.",
    )
    queue_timeout_s: float = _f(
        0.0,
        NonNegative(),
        doc=(
            "Maximum admission wait, capped by the original request deadline. "
            "Must be positive when queueing is enabled."
        ),
    )
    prefill_concurrency: int = _f(
        0,
        NonNegative(),
        doc=(
            "Resident prefill requests per engine, at most `serving.max_connections`; `0` "
            "sets no limit. Queueing requires a positive measured value."
        ),
    )
    decode_concurrency: int = _f(
        0,
        NonNegative(),
        doc=(
            "Resident decode requests per engine, at most `serving.max_connections`; `0` "
            "sets no limit. Queueing requires a positive measured value, and the role "
            "controller's projections bound each engine's decode batch by it."
        ),
    )
    handoff_timeout_s: float = _f(
        0.0,
        NonNegative(),
        doc=(
            "Caps KV-handoff age from the start of the prefill HTTP request; at `0` the "
            "original request deadline supplies the cap. Queueing or retry requires a "
            "positive cap below the verified backend lease (and below "
            "`serving.request_timeout_s`)."
        ),
    )
    max_attempts: int = _f(
        1, Between(1, 3), doc="Maximum complete prefill/decode attempts per original request."
    )
    retry_base_s: float = _f(
        0.1,
        Positive(),
        doc="Initial exponential-backoff ceiling. Full jitter samples from zero to the ceiling.",
    )
    retry_cap_s: float = _f(
        1.0, Positive(), doc="Maximum backoff ceiling. At least `serving.retry_base_s`."
    )
    retry_budget: int = _f(
        10,
        NonNegative(),
        doc="Initial and maximum retry-credit pool. Each retry spends one credit.",
    )
    retry_replenish: float = _f(
        0.1,
        Between(0.0, 1.0),
        doc="Credits added after each successful original request.",
    )
    max_request_bytes: int = _f(
        4194304, AtLeast(1), doc="Maximum HTTP request-body size, enforced while reading."
    )
    max_response_bytes: int = _f(
        16777216,
        AtLeast(1),
        doc=(
            "Maximum retained bytes for each non-streaming attempt and the streaming "
            "pre-output metadata buffer."
        ),
    )
    client_stall_s: float = _f(
        0.5,
        Positive(),
        doc=(
            "A write to a client that cannot complete within this time means the client "
            "stopped reading and its socket buffer is full ([client "
            "backpressure](design.md#streaming-failures)): the connection is closed at once "
            "and the request's engine legs are cancelled."
        ),
    )
    body_timeout_s: float = _f(
        30.0,
        Positive(),
        doc=(
            "Time from HTTP ingress by which the whole request body must have arrived, "
            "however it trickles in; a later body is answered 408 `body_timeout` and its "
            "connection closed, so a slow client holds a [retained "
            "request](design.md#retained-ceiling) this long at most. Capped by "
            "`serving.request_timeout_s`, the limit the 408 then names."
        ),
    )
    max_pending_bodies_per_client: int = _f(
        0,
        NonNegative(),
        doc=(
            "Most completion requests from one client address (an IPv6 address by its /64 "
            "prefix) whose bodies are still arriving at once; `0` derives an eighth of the "
            "retained-request ceiling, at least 8 (64 at the defaults). A request over it is "
            "refused before its body is read, with 429 `pending_bodies_per_client` "
            "(`Retry-After: 1`, its connection closed), and is not an SLO miss."
        ),
        notes=(
            "Each such request holds a retained request until its body is complete or "
            "`serving.body_timeout_s`: without this limit one address sending slow bodies "
            "could hold the whole ceiling, and everyone else got 429 `retained_ceiling`. "
            "Each address's refusals are logged once when they begin and once when they end "
            "(event `client_limit`). An honest client's body arrives in milliseconds, so even "
            "one sending hundreds of requests a second has few pending at once. Behind a "
            "reverse proxy that streams bodies through unbuffered, every client has the "
            "proxy's address: raise it to the ceiling there. A reload applies it to new "
            "requests."
        ),
    )
    request_timeout_s: float = _f(
        600.0,
        Positive(),
        doc="End-to-end completion deadline from HTTP ingress through response delivery.",
    )
    prefill_timeout_s: float = _f(120.0, Positive(), doc="Prefill-leg deadline.")
    expose_engine_details: bool = _f(
        False,
        doc=(
            "Let client-facing error messages name the engine (its id) and what only the "
            "operator should read: the engine's host and port in a connect failure, an "
            "SGLang pair's transfer endpoints, the monitor's last failure, file paths. Off, "
            "a client reads the same message without them (`prefill engine returned HTTP "
            "500: ...`, not `prefill engine p0 returned ...`); the engine's own words about "
            "the request stay, and the log always has the whole message."
        ),
    )

    @property
    def retained_ceiling(self) -> int:
        """The most completion requests retained at once (docs/design.md#retained-ceiling)."""
        return self.max_connections + self.queue_capacity

    def pending_bodies_per_client(self) -> int:
        """`max_pending_bodies_per_client`; `0` derives an eighth of the retained-request
        ceiling, at least 8."""
        if self.max_pending_bodies_per_client:
            return self.max_pending_bodies_per_client
        return max(8, self.retained_ceiling // 8)


@attrs.frozen(kw_only=True)
class Engine:
    """How the router talks to engines over HTTP (docs/design.md#admission, #deadlines)."""

    control_connections: int = _f(
        0,
        NonNegative(),
        doc=(
            "HTTP connections reserved for health and recovery. "
            "`0` derives two per engine, with a minimum of four."
        ),
    )
    decode_read_timeout_s: float = _f(
        60.0,
        NonNegative(),
        doc=(
            "Maximum silent interval between decode chunks after the first token. "
            "`0` disables the gap limit."
        ),
    )
    first_token_timeout_s: float = _f(
        2.5,
        Positive(),
        doc=(
            "Deadline from opening the decode stream to the first generated token, and for "
            "each functional-verification leg."
        ),
    )
    tokenize: bool = _f(
        True,
        doc=(
            "Request the exact input length from the dialect's tokenisation endpoint. An "
            "exact count (or a prompt of token ids) is checked against the engines' context "
            "length before any leg (400 `context_length_exceeded`); an estimate is not, and "
            "the engine refuses an over-long request itself."
        ),
        notes=(
            "Of SGLang's tokenisation endpoints, only newer builds' takes chat messages: "
            "once an engine's refuses them, its chat requests are estimated "
            '(`narwhal_token_count_fallbacks_total{reason="unsupported"}`, one log line per '
            "engine) without asking it again for 300 s, or until a reload or until it has "
            "been out of placement (as a restart takes it)."
        ),
    )
    tokenize_timeout_s: float = _f(2.0, Positive(), doc="Exact-token-count deadline.")
    tokenizer_path: str | None = _path(
        None,
        Text(),
        doc=(
            "The model's tokenizer, a folder holding its tokenizer.json (and chat template) "
            "or the file, to count prompts in the router instead of asking engines' "
            "/tokenize; `null` asks them. Read at start and at each reload."
        ),
        notes=(
            "Needs the `tokenizer` extra (`pip install 'narwhal[tokenizer]'`: the "
            "`tokenizers` library the engines use, and `jinja2` for chat templates). A "
            "completion's text is counted with the special tokens the engines add; a chat's "
            "is its messages rendered through the folder's chat template (chat_template.jinja, "
            "else tokenizer_config.json's) as vLLM renders them, for a fleet of vLLM engines. "
            "A request it cannot render as the engine does (tools, `chat_template_kwargs`, "
            "tool or developer messages, images, a template that loops over content parts, "
            "an SGLang engine's chat) is counted as without it, by /tokenize, and the miss is "
            "counted by reason (`narwhal_token_count_local_misses_total`). It must be the "
            "engines' model, and their template: an engine started with `--chat-template` or "
            "`--default-chat-template-kwargs` renders otherwise. A reload reads the file "
            "again; one that cannot be read or parsed is refused with this setting named, and "
            "the running tokenizer stays."
        ),
    )
    tokenizer: LocalTokenizer | None = attrs.field(
        default=None,
        metadata={
            RESOLVED: True,
            "doc": "The tokenizer read from `tokenizer_path`; never in the document.",
        },
    )
    vocab_size: int | None = _f(
        None,
        Between(1, 100_000_000),
        doc=(
            "The model's vocabulary size: a prompt of token ids may use 0 to `vocab_size` - 1 "
            "and any other id is refused (400, param `prompt`) before an engine sees it. "
            "`null` checks only that ids are not negative (vLLM refuses the rest itself)."
        ),
        notes=(
            "Set it for SGLang: 0.5.23 does not check token ids, and one out of range kills "
            "its scheduler and the server exits."
        ),
    )
    chars_per_token: float = _f(
        3.8,
        Positive(),
        doc=(
            "Character-to-token ratio for counting a prompt without /tokenize, used when "
            "the loaded profile store has no ratio measured on the fleet's dialect."
        ),
    )
    prefill_chunk_tokens: int = _f(
        2048,
        AtLeast(1),
        doc=(
            "Prompt tokens an engine prefills per scheduler step (vLLM "
            "`--max-num-batched-tokens`, SGLang `--chunked-prefill-size`). Queued prompts "
            "share a step's fixed cost in this proportion when pricing prefill backlog."
        ),
    )
    pool_timeout_s: float = _f(
        5.0,
        Positive(),
        doc="Maximum wait for an engine HTTP connection on the serving or control pool.",
    )
    connect_timeout_s: float = _f(10.0, Positive(), doc="TCP-connect deadline for engine requests.")
    health_timeout_s: float = _f(
        5.0,
        Positive(),
        doc="Deadline for preflight, breaker and readmission health probes.",
    )
    api_key_file: str | None = _path(
        None,
        doc=(
            "File holding the key engines were started with (`--api-key`), sent as "
            "`Authorization: Bearer` on every engine request; `null` sends none. One line "
            "of printable ASCII without spaces (one trailing newline is ignored), read "
            "again at each reload, so a rotated key takes effect then."
        ),
        notes=(
            "The key itself never goes in the configuration. Under systemd, `LoadCredential=` "
            "provides the file."
        ),
    )

    def control_pool_size(self, engine_count: int) -> int:
        """`0` derives two per engine with a minimum of four (docs/design.md#admission)."""
        if self.control_connections:
            return self.control_connections
        return max(4, 2 * engine_count)


@attrs.frozen(kw_only=True)
class Cache:
    """What Narwhal knows of each engine's prefix cache: exact from its KV events
    (`engines[].kv_events`), else approximate, learnt from the prompts routed to it.

    Admission and placement price a prefill by the tokens each engine must compute
    (`cache.affinity`)."""

    max_blocks_per_engine: int = _f(
        262_144,
        Between(1, 100_000_000),
        doc=(
            "Most cached blocks remembered per engine, in either index; past it the oldest "
            "are forgotten first. About 120 bytes each once the bound is reached (measured "
            "by tools/bench/dev/cache_index_memory.py): the default bounds an engine's "
            "index near 31 MB."
        ),
    )
    replay_timeout_s: float = _f(
        2.0,
        Positive(),
        doc="Deadline for an engine's replay socket to resend the batches a gap lost.",
    )
    approximate_ttl_s: float = _f(
        300.0,
        Between(0.0, 86_400.0),
        doc=(
            "For an engine without `kv_events`: how long a prompt Narwhal routed to it "
            "counts as cached after its last use; `0`: nothing known cached."
        ),
        notes=(
            "The approximate index learns the 256-char text blocks of each prompt routed "
            "to an engine (at most `cache.max_blocks_per_engine`, least recently used "
            "dropped first) and estimates an engine's cached tokens as the matched share "
            "of the prompt. vLLM evicts cached blocks under memory pressure, which "
            "Narwhal does not see: a TTL longer than the engine's blocks survive "
            "over-claims hits, and a saturated engine turns its whole cache over in its KV "
            "capacity divided by its prefill rate, often under a minute. 300 s covers the "
            "pause between a conversation's turns and keeps a shared system prompt in use; "
            "lower it for engines with little KV memory. A reload applies it; `0` at a "
            "reload empties the approximate indexes."
        ),
    )
    affinity: float = _f(
        1.0,
        Between(0, 10),
        doc=(
            "How much an engine's cached prefix of a prompt lowers its placement cost: 1 "
            "prices the prefill by the tokens the engine must compute, 0 places as if "
            "nothing were cached (the spec's placement), above 1 favours cache hits over "
            "backlog."
        ),
        notes=(
            "Admission and projections credit the cache at most as it is worth (at 0, "
            "not at all). The backlog each prefill adds keeps one engine from taking "
            "every prompt that shares its prefix. docs/design.md#prefix-caching."
        ),
    )
    local_prefill_share: float = _f(
        0.9,
        Between(0, 1, low_open=True),
        doc=(
            "Share of a prompt a vLLM decode engine must hold cached before Narwhal lets it "
            "prefill the rest itself, skipping the prefill engine and the KV transfer, "
            "when that is also the cheaper path; 1 never skips."
        ),
        notes=(
            "Counted in `narwhal_local_prefills_total`. SGLang decode engines cannot "
            "prefill, so never skip."
        ),
    )


@attrs.frozen(kw_only=True)
class Cluster:
    """Several Narwhal replicas in front of one fleet, coordinated through etcd
    (docs/operations.md#several-replicas). Without `endpoints`, one replica, exactly as
    without this section."""

    endpoints: tuple[str, ...] = _f(
        (),
        HttpOrigin("Narwhal's etcd client"),
        doc=(
            "etcd client URLs (`http://HOST:PORT`, etcd 3.4 or newer: its v3 JSON gateway); "
            "`[]`: a single replica."
        ),
        notes=(
            "Each replica holds a lease under `cluster.prefix`, and the replicas split "
            "`serving.max_connections` and every engine's phase concurrency between them: "
            "each admits against its own part, so the request path never waits on etcd. "
            "A replica whose lease lapses is gone, and its part returns to the others."
        ),
    )
    prefix: str = _f(
        "/narwhal/",
        KeyPrefix(),
        doc="The etcd key prefix of one fleet's replicas; another fleet uses another.",
    )
    replica_id: str = _f(
        "",
        ReplicaName(),
        doc=(
            'This replica\'s name, unique in the cluster; `""`: the host name and the '
            "listen port (`host:8000`)."
        ),
        notes="A second replica starting with a name in use is refused with its name.",
    )
    lease_ttl_s: int = _f(
        10,
        Between(2, 600),
        doc=(
            "Seconds a replica stays a member after its last word to etcd; it renews every "
            "third of it."
        ),
        notes=(
            "The controller's leadership moves within this plus one monitor interval of "
            "its holder's death; a dead replica's part of the capacity returns after it."
        ),
    )
    request_timeout_s: float = _f(
        2.0,
        Positive(),
        doc="Deadline for one etcd request, at most a third of `cluster.lease_ttl_s`.",
    )
    isolated_share: float = _f(
        0.5,
        Between(0, 1),
        doc=(
            "Share of its part a replica keeps admitting once cut off from etcd for longer "
            "than its lease (the others may have taken its part back by then)."
        ),
        notes=(
            "Until the lease could have lapsed a cut-off replica keeps its whole part, "
            "with roles frozen. Past that, the others may have re-split without it: the "
            "capacity spent twice is at most this share of the cut-off replica's part. `0` "
            "never overspends, and admits one request at a time."
        ),
    )
    load_interval_s: float = _f(
        0.05,
        Between(0, 10),
        doc=(
            "How often a replica publishes its load on each engine (booked prefill "
            "backlog, legs by phase) for the others to price with; `0`: never."
        ),
        notes=(
            "An unchanged load is not written again for a second. Without every other "
            "member's recent word, a replica estimates their legs from the engines' "
            "/metrics instead: in bursts that priced the prefill wait at about half. "
            "Each write is an etcd revision: run etcd with `--auto-compaction-retention`."
        ),
    )

    @property
    def enabled(self) -> bool:
        return bool(self.endpoints)


@attrs.frozen(kw_only=True)
class Profiles:
    """Engine latency profiles."""

    path: str = _path(
        "runs/profiles.json",
        Text(),
        doc="Profile store read by the router and written by `narwhal-profile`.",
    )


@attrs.frozen(kw_only=True)
class Health:
    """Health probing and latency-residual ejection.

    A latency residual is an engine leg's observed latency over what the engine's profile
    predicts for it, at most one per engine per monitor pass (the newest leg of the pass
    that the profile predicts). Prefill legs: the duration of a leg that ran alone on the
    engine, with a prompt inside the profiled range. Decode legs: the stream's median
    token interval against the profile's interval at the engine's decode load during the
    stream (its requests decoding and their resident KV tokens, averaged over the gaps),
    so a loaded engine is judged against its load, not against an idle one. The gaps are
    those after the first token (the KV wait and the prefill come before it), at most the
    first 256; a decode leg is judged only with at least 16 of them, with its heaviest
    load inside the profile's measured domain, and when no client write blocked the relay
    for a quarter of the gaps' time or longer (a stall that outlasted the stream would
    inflate the gaps after it) and no prefill leg ran on the engine meanwhile.
    Aggregate legs are not judged. Once an engine's window holds `min_samples` residuals,
    a median at or above `eject_ratio` ejects it (`latency: median observed/predicted
    ratio ...`), unless it is the last available engine to take its role's work: then one
    `latency_ejection_withheld` warning. A decode engine N times slower than its profile
    shows residuals near N: the default `eject_ratio` ejects from about three times
    slower; a lower one catches a milder slowdown.
    """

    interval_s: float = _f(
        2.0,
        Positive(),
        doc=(
            "Health probe period per engine. An engine out of placement for refusing "
            "Narwhal's API key also gets a key check (`GET /v1/models`) after each good "
            "probe, and comes back when the key is accepted."
        ),
    )
    window_s: float = _f(
        30.0,
        Positive(),
        doc=(
            "Latency-residual window for ejection. An engine ejected for latency waits as "
            "long before its good probes count toward readmission "
            "(`recovery.engines.ID.health.readmission_in_s` in `/narwhal/state`)."
        ),
        notes=(
            "While no other engine in placement takes the work of its role (as for "
            "`recovery.health.readmit_successes`), its good probes count at once (slow "
            "beats refusing all of that work), and one that answered its last probe is "
            "probed at once when its role empties meanwhile. The health transition's reason "
            "says so, and `recovery.engines.ID.health.latency_cut_short_total` counts it."
        ),
    )
    min_samples: int = _f(
        5,
        AtLeast(1),
        doc=(
            "Residuals required before ejection can fire. At most "
            "floor(`recovery.health.window_s` / `controller.monitor_interval_s`): each monitor "
            "pass contributes at most one residual per engine."
        ),
    )
    eject_ratio: float = _f(
        3.0, AtLeast(1.0), doc="Median observed/predicted latency ratio that ejects."
    )
    failure_threshold: int = _f(
        3,
        AtLeast(1),
        doc=(
            "Consecutive failed probes that eject. Sooner than that, a request leg that "
            "cannot connect to the engine takes it out of placement (`unreachable: ...`) "
            "until a health probe sent after that leg answers; that probe goes out at once, "
            "so a refusal that was a blip costs one probe's round trip."
        ),
    )
    readmit_successes: int = _f(
        2,
        AtLeast(1),
        doc=(
            "Consecutive good probes before readmission verification. One is enough while "
            "no other engine in placement takes the work of the engine's role, since every "
            "request needing that role is refused meanwhile (`no_engine_available`)."
        ),
        notes=(
            "Another engine takes the work of the role when it has the same role, is a "
            "`both` engine for a prefill or decode engine, or is an available "
            "prefill/decode pair for a `both` engine; one drained, held, ejected, "
            "quarantined, unreachable or refusing the key or the model does not count. The "
            "verification pair still has to pass, and a restart hold ends at the first good "
            "probe (`recovery.restart_hold_s`). The health transition's reason says so, and "
            "`recovery.engines.ID.health.readmit_shortcuts_total` in `/narwhal/state` counts "
            "it. An ejected engine that answered its last probe is probed at once when its "
            "role empties meanwhile, however it empties: the last other engine taking its "
            "work is ejected, unreachable, held or quarantined, its breaker opens, "
            "`narwhalctl` drains it or pins it to another role, a reload removes or replaces "
            "it or changes its role, the role controller moves it, or a request finds it "
            "refusing Narwhal's API key or its model; likewise when `narwhalctl undrain` or "
            "a role change makes the ejected engine itself the last of its role. A "
            "verification pair (readmission or breaker) that fails at once is sent again, "
            "and only the second pair counts (the first is "
            '`narwhal_verifications_total{outcome="retried"}`); one that ran out '
            "`engine.first_token_timeout_s` is not sent again. A leg answered with HTTP 429 "
            "makes the pair inconclusive (the engine is busy, not broken): it is verified "
            "again a probe interval later. After a failed readmission verification the next "
            "waits a probe interval; from the second failure in a row on, twice as long as "
            "the one before, up to 8 probe intervals "
            "(`recovery.engines.ID.health.failed_verifications` and `verify_in_s`), until a "
            "verification passes or the engine restarts. While no other engine in placement "
            "takes the work of its role the wait is one probe interval whatever the count "
            "(an engine in a longer wait when its role empties is verified at once), since "
            "every request needing the role is refused meanwhile; the ejection's reason "
            "says so."
        ),
    )


@attrs.frozen(kw_only=True)
class Breaker:
    """Per-engine circuit breaker."""

    failure_threshold: int = _f(
        5, AtLeast(1), doc="Counted failures within `window_s` that open the breaker."
    )
    window_s: float = _f(30.0, Positive(), doc="Window in which failures are counted.")
    failure_ratio: float = _f(
        0.5,
        Between(0.0, 1.0, low_open=True),
        doc=(
            "Share of the phase's legs within `window_s` that must have failed, besides "
            "`failure_threshold` of them, before the breaker opens: a busy engine with "
            "rare faults reaches any count, so a count alone would open healthy engines."
        ),
    )
    open_s: float = _f(10.0, Positive(), doc="Time open before a half-open verification.")


@attrs.frozen(kw_only=True)
class Recovery:
    """Quarantine, restart holds, shutdown drain, health and breakers."""

    failure_quarantine_s: float = _f(
        0.0,
        NonNegative(),
        doc="Time a failed engine remains excluded from placement. `0` disables quarantine.",
    )
    restart_hold_s: float = _f(
        5.0,
        NonNegative(),
        doc=(
            "Hold after an engine restart before placement; then a verification pair has "
            "to pass. An engine that answers again after being unreachable counts as "
            "restarted unless its `/version` names the instance id it named before (then "
            "there is no hold)."
        ),
        notes=(
            "While no other engine in placement takes the work of its role (as for "
            "`recovery.health.readmit_successes`), the wait ends at its first good probe "
            "(one goes out at once when the restart shows on `/metrics` or its role empties "
            "during the hold) and the verification pair follows; it is still held until "
            "that passes. The `restart_hold_cut` warning and the hold's release reason say "
            "so, and `recovery.engines.ID.hold.cut_short_total` in `/narwhal/state` counts it."
        ),
    )
    shutdown_grace_s: float = _f(30.0, NonNegative(), doc="In-flight drain bound on SIGTERM.")
    health: Health = attrs.field(factory=Health)
    breaker: Breaker = attrs.field(factory=Breaker)


@attrs.frozen(kw_only=True)
class Thresholds:
    """Role-control thresholds (docs/design.md#role-control)."""

    expand: float = _f(
        1.0, Positive(), doc="SLO-relative pool load that initiates reactive expansion."
    )
    shrink: float = _f(
        0.5,
        NonNegative(),
        doc=(
            "Maximum projected source load for ordinary consolidation, lower than "
            "`controller.thresholds.expand`. Mixed-pressure D-to-P moves may exceed it."
        ),
    )
    cooldown_s: float = _f(10.0, NonNegative(), doc="Minimum time between prefill-to-decode moves.")
    sustained_intervals: int = _f(
        3,
        AtLeast(1),
        doc=(
            "Minimum confirmation count for nonurgent, incomplete-demand and "
            "mixed-pressure proposals."
        ),
    )
    dwell_s: float = _f(
        0.0, NonNegative(), doc="Minimum residence time after an engine changes role."
    )
    panic_ratio: float = _f(
        0.0,
        ZeroOrAtLeast(1),
        doc=(
            "Decode-load multiple that may bypass cooldown while prefill is below `shrink`. "
            "`0` disables it."
        ),
    )
    flip_resident_guard: int = _f(
        0,
        NonNegative(),
        doc=(
            "Maximum resident decode streams allowed on a D-to-P candidate. `0` disables the guard."
        ),
    )


@attrs.frozen(kw_only=True)
class Reactive:
    """Reactive-controller parameters (docs/design.md#adjacent-splits, #evidence-gate,
    #reactive-parameters)."""

    window_s: float = _f(120.0, Positive(), doc="Demand-estimation window.")
    confirmations: int = _f(
        2,
        AtLeast(1),
        doc=(
            "Required consecutive identical adjacent proposals for nonurgent, "
            "incomplete-demand and mixed-pressure moves."
        ),
    )
    utilization: float = _f(
        0.8,
        Between(0.0, 1.0, low_open=True),
        doc="Fraction of each engine treated as usable capacity.",
    )
    min_arrivals: int = _f(10, AtLeast(1), doc="Minimum arrival count required for a decision.")
    demand_floor: float = _f(0.5, Positive(), doc="Minimum accepted demand signal.")
    movement_margin: float = _f(
        0.05,
        Between(0.0, 1.0, high_open=True),
        doc="Required reduction in the worst projected SLO ratio before movement.",
    )
    step_s: float = _f(
        5.0,
        Positive(),
        doc=(
            "Minimum interval between scheduled adjacent-split evaluations. A projected "
            "prefill TTFT breach may trigger one guarded D-to-P evaluation in between."
        ),
    )
    evidence_span_s: float = _f(
        60.0,
        Positive(),
        doc=(
            "Minimum recent-arrival span for D-to-P consolidation and the short horizon of "
            "the rising-demand test. At most `evidence_max_span_s`."
        ),
    )
    evidence_max_span_s: float = _f(
        120.0,
        Positive(),
        doc=(
            "Maximum evidence duration under sparse traffic. At least `evidence_span_s` "
            "and at most `window_s`."
        ),
    )
    evidence_min_arrivals: int = _f(
        10,
        AtLeast(1),
        doc="Minimum samples within the evidence span before D-to-P consolidation.",
    )
    demand_rise_tolerance: float = _f(
        0.25,
        NonNegative(),
        doc="Maximum accepted short-horizon rise over long-horizon decode demand.",
    )
    decode_correction_min: float = _f(
        0.5, Positive(), doc="Lower bound on the live/profile decode correction."
    )
    decode_correction_max: float = _f(
        2.0,
        Positive(),
        doc="Upper bound on the live/profile decode correction. At least the minimum.",
    )
    decode_correction_alpha: float = _f(
        0.2,
        Between(0.0, 1.0, low_open=True),
        doc="Fraction of each qualifying observation window applied to the correction.",
    )
    decode_correction_min_samples: int = _f(
        8,
        AtLeast(1),
        doc="Required decode gaps before a window updates the correction.",
    )


@attrs.frozen(kw_only=True)
class Controller:
    """Role control (docs/design.md#role-control)."""

    enabled: bool = _f(
        True,
        doc="Run the role controller; `false` keeps the configured roles.",
    )
    advisory: bool = _f(
        False,
        doc="Record proposed role splits and reasons while retaining the current roles.",
    )
    monitor_interval_s: float = _f(1.0, Positive(), doc="Delay between monitor passes.")
    monitor_failure_limit: int = _f(
        5,
        AtLeast(1),
        doc=(
            "Consecutive passes with any monitoring-stage failure before degraded state "
            "stops new admission."
        ),
    )
    min_prefill: int = _f(
        1,
        AtLeast(1),
        doc=(
            "Minimum live prefill engines preserved by controller moves. At most the number "
            "of engines that can serve prefill: role `prefill` or `both`, or a `prefill` or "
            "`decode` engine the controller may move (it restores a configured split below "
            "the floor, one engine per monitor pass)."
        ),
    )
    min_decode: int = _f(
        1,
        AtLeast(1),
        doc=(
            "Minimum live decode engines preserved by controller moves. At most the number "
            "of engines that can serve decode: role `decode` or `both`, or a `prefill` or "
            "`decode` engine the controller may move (it restores a configured split below "
            "the floor, one engine per monitor pass)."
        ),
    )
    flip_history: int = _f(
        1000,
        AtLeast(1),
        doc="Maximum retained role-change records exposed by `/narwhal/state`.",
    )
    thresholds: Thresholds = attrs.field(factory=Thresholds)
    reactive: Reactive = attrs.field(factory=Reactive)


@attrs.frozen(kw_only=True)
class Config:
    """The whole configuration document."""

    engines: tuple[EngineSpec, ...] = _f((), doc="The engine fleet; at least one engine.")
    slo: Slo = attrs.field(factory=Slo)
    listen: Listen = attrs.field(factory=Listen)
    admin: Admin = attrs.field(factory=Admin)
    ctl: Ctl = attrs.field(factory=Ctl)
    log: Log = attrs.field(factory=Log)
    serving: Serving = attrs.field(factory=Serving)
    engine: Engine = attrs.field(factory=Engine)
    controller: Controller = attrs.field(factory=Controller)
    recovery: Recovery = attrs.field(factory=Recovery)
    cache: Cache = attrs.field(factory=Cache)
    cluster: Cluster = attrs.field(factory=Cluster)
    profiles: Profiles = attrs.field(factory=Profiles)

    def connections_per_client(self) -> int:
        """`listen.max_open_connections_per_client`; `0` derives twice the retained-request
        ceiling, at least 64 and at most `listen.max_open_connections`."""
        if self.listen.max_open_connections_per_client:
            return self.listen.max_open_connections_per_client
        derived = max(64, 2 * self.serving.retained_ceiling)
        return min(self.listen.max_open_connections, derived)

    def engine_by_id(self, engine_id: str) -> EngineSpec | None:
        for spec in self.engines:
            if spec.id == engine_id:
                return spec
        return None
