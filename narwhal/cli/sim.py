"""narwhal-sim: serve a simulated engine fleet until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from collections.abc import Sequence
from functools import partial
from typing import Any, cast

import attrs
import trio

from narwhal._files import read_file
from narwhal.cli._common import closed_pipe_is_quiet
from narwhal.sim import (
    DEFAULT_MODEL,
    DEFAULT_VLLM_VERSION,
    DISAGGREGATION_MODES,
    VLLM_BUILDS,
    DisaggregationMode,
    KvEventsConfig,
    SimEngineSpec,
    SimTiming,
    serve_fleet,
)

from ._common import add_version

_KV_CONNECTORS = {"nixl": True, "none": False}
# A timing profile is a few SimTiming fields, or a profile store's engine entry.
_PROFILE_LIMIT = 1024 * 1024


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="narwhal-sim",
        description="Serve N simulated vLLM/SGLang engines on consecutive ports.",
    )
    p.add_argument(
        "--port",
        type=int,
        default=8100,
        help="first engine's port; engine i gets port+i (0: ephemeral ports)",
    )
    p.add_argument("--engines", type=int, default=1, help="number of engines (default 1)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--dialect", choices=("vllm", "sglang"), default="vllm")
    p.add_argument(
        "--disaggregation-mode",
        metavar="MODE[,MODE...]",
        default=None,
        help="SGLang launch mode, null (aggregate, the default), prefill or decode: one "
        "for every engine, or one per engine (e.g. prefill,decode,decode)",
    )
    p.add_argument(
        "--vllm-version",
        choices=tuple(VLLM_BUILDS),
        default=DEFAULT_VLLM_VERSION,
        help=f"vLLM build whose behaviour the engines play (default {DEFAULT_VLLM_VERSION})",
    )
    p.add_argument(
        "--kv-connector",
        metavar="KIND[,KIND...]",
        default=None,
        help="vLLM engines' KV connector, nixl (the default) or none (an aggregate-only "
        "engine: no KV handoff, kv_transfer_params null): one for every engine, or one per "
        "engine (e.g. none,none,nixl,nixl)",
    )
    p.add_argument(
        "--speed",
        type=float,
        default=1.0,
        help="time compression: every simulated duration is divided by this",
    )
    p.add_argument(
        "--profile",
        metavar="FILE",
        help="JSON object of SimTiming fields (seconds at speed 1) overriding the "
        'default law, optionally nested under "timing"',
    )
    p.add_argument(
        "--lease-s",
        type=float,
        default=30.0,
        help="KV lease on produced blocks, seconds at speed 1 (default 30)",
    )
    p.add_argument("--model", default=DEFAULT_MODEL, help="served model name")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--build", default=None, help="build identity reported by /version")
    p.add_argument(
        "--stock-version",
        action="store_true",
        help="answer /version with the version alone, as stock vLLM and SGLang do",
    )
    p.add_argument(
        "--max-num-queued",
        type=int,
        default=None,
        help="vLLM admission limit on waiting+running requests (503 beyond)",
    )
    p.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="generated tokens per streamed event (SGLang --stream-interval)",
    )
    p.add_argument(
        "--unbounded-max-tokens",
        type=_bound,
        default=256,
        metavar="N|context",
        help="tokens generated for a request that sets no output bound (a chat without "
        "max_tokens, a vLLM 0.29 completion with max_tokens null), within the context (default "
        "256; `context` runs it to the context, as the real engines do)",
    )
    p.add_argument(
        "--tokenize-messages",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="SGLang: whether /tokenize also takes chat messages, as 0.5.23's does "
        "(--no-tokenize-messages plays an older build, which requires a prompt and answers "
        "messages with 400)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY` on the routes the real engine guards "
        "(vLLM: /v1/*; SGLang: all but /health* and /metrics*)",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action="store_true",
        help="vLLM engines keep a prefix cache (vLLM's default; off here unless asked): "
        "cached prompt blocks skip prefill",
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="KV block size in tokens (default: the timing's, 16; vLLM on CPU uses 128)",
    )
    p.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="usage carries prompt_tokens_details.cached_tokens, as vLLM's flag",
    )
    p.add_argument(
        "--kv-events-config",
        metavar="JSON",
        default=None,
        help="vLLM's KV events config, e.g. "
        '\'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}\': engine i '
        "publishes on the endpoint's port + i (needs --enable-prefix-caching)",
    )
    p.add_argument(
        "--zero",
        action="store_true",
        help="instant engines (SimTiming.zero) for router-overhead measurements",
    )
    add_version(p)
    return p


def _bound(text: str) -> int | None:
    if text == "context":
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a count nor `context`") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive count")
    return value


def load_profile(path: str) -> SimTiming:
    data: Any = json.loads(read_file(path, limit=_PROFILE_LIMIT))
    if isinstance(data, dict) and isinstance(data.get("timing"), dict):
        data = data["timing"]
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object of SimTiming fields")
    known = {f.name for f in attrs.fields(SimTiming)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{path}: unknown timing field(s): {', '.join(unknown)}")
    return SimTiming(**data)


async def _run(
    spec: SimEngineSpec,
    *,
    engines: int,
    host: str,
    port: int,
    modes: Sequence[DisaggregationMode] | None = None,
    connectors: Sequence[bool] | None = None,
) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            fleet = await nursery.start(
                partial(
                    serve_fleet,
                    engines=engines,
                    host=host,
                    port=port,
                    spec=spec,
                    disaggregation_modes=modes,
                    kv_connectors=connectors,
                )
            )
            for handle in fleet:
                print(handle.url, flush=True)
            async for _ in signals:
                nursery.cancel_scope.cancel()
                break


def spec_from_args(args: argparse.Namespace) -> SimEngineSpec:
    """The engine spec the command line asks for; ValueError names a bad option."""
    if args.engines < 1:
        raise ValueError(f"--engines is {args.engines}; must be >= 1")
    if args.port and not 0 < args.port + args.engines - 1 <= 65535:
        raise ValueError("--port + --engines exceeds 65535")
    timing = load_profile(args.profile) if args.profile else SimTiming()
    if args.zero:
        timing = SimTiming.zero()
    if args.block_size is not None:
        timing = attrs.evolve(timing, block_size=args.block_size)
    kv_events = None
    if args.kv_events_config is not None:
        try:
            raw = json.loads(args.kv_events_config)
        except ValueError as exc:
            raise ValueError(f"--kv-events-config is not JSON: {exc}") from None
        kv_events = KvEventsConfig.from_json(raw)
    fields: dict[str, Any] = {
        "dialect": args.dialect,
        "speed": args.speed,
        "lease_s": args.lease_s,
        "model": args.model,
        "seed": args.seed,
        "timing": timing,
        "max_num_queued": args.max_num_queued,
        "stream_interval": args.stream_interval,
        "stock_version": args.stock_version,
        "tokenize_messages": args.tokenize_messages,
        "unbounded_max_tokens": args.unbounded_max_tokens,
        "api_key": args.api_key,
        "vllm_version": args.vllm_version,
        "prefix_caching": args.enable_prefix_caching,
        "prompt_tokens_details": args.enable_prompt_tokens_details,
        "kv_events": kv_events,
    }
    if args.build:
        fields["build"] = args.build
    return SimEngineSpec(**fields)


def modes_from_args(args: argparse.Namespace) -> tuple[DisaggregationMode, ...] | None:
    """Each engine's --disaggregation-mode, or None when not given; ValueError names a
    bad value."""
    if args.disaggregation_mode is None:
        return None
    modes: list[DisaggregationMode] = []
    for raw in args.disaggregation_mode.split(","):
        mode = raw.strip()
        if mode not in DISAGGREGATION_MODES:
            raise ValueError(
                f"--disaggregation-mode {mode!r} is not one of {', '.join(DISAGGREGATION_MODES)}"
            )
        modes.append(cast(DisaggregationMode, mode))
    if len(modes) == 1:
        modes *= args.engines
    if len(modes) != args.engines:
        raise ValueError(
            f"--disaggregation-mode gives {len(modes)} modes for {args.engines} engines; "
            "give one, or one per engine"
        )
    if args.dialect != "sglang" and any(mode != "null" for mode in modes):
        raise ValueError("--disaggregation-mode prefill|decode needs --dialect sglang")
    return tuple(modes)


def connectors_from_args(args: argparse.Namespace) -> tuple[bool, ...] | None:
    """Whether each engine has a KV connector (--kv-connector), or None when not given;
    ValueError names a bad value."""
    if args.kv_connector is None:
        return None
    kinds = [raw.strip() for raw in args.kv_connector.split(",")]
    for kind in kinds:
        if kind not in _KV_CONNECTORS:
            raise ValueError(f"--kv-connector {kind!r} is not one of {', '.join(_KV_CONNECTORS)}")
    if len(kinds) == 1:
        kinds *= args.engines
    if len(kinds) != args.engines:
        raise ValueError(
            f"--kv-connector gives {len(kinds)} kinds for {args.engines} engines; "
            "give one, or one per engine"
        )
    return tuple(_KV_CONNECTORS[kind] for kind in kinds)


@closed_pipe_is_quiet
def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        spec = spec_from_args(args)
        modes = modes_from_args(args)
        connectors = connectors_from_args(args)
    except (OSError, ValueError, TypeError) as exc:
        print(f"narwhal-sim: {exc}", file=sys.stderr)
        return 2
    try:
        trio.run(
            partial(
                _run,
                spec,
                engines=args.engines,
                host=args.host,
                port=args.port,
                modes=modes,
                connectors=connectors,
            )
        )
    except BaseExceptionGroup as group:
        # Binding happens inside the fleet's nursery, so a busy port arrives in a group.
        matched, rest = group.split(OSError)
        if matched is None or rest is not None or matched.split(BrokenPipeError)[1] is None:
            raise  # a closed stdout is closed_pipe_is_quiet's
        for err in _leaves(matched):
            print(f"narwhal-sim: {err}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"narwhal-sim: {exc}", file=sys.stderr)
        return 1
    return 0


def _leaves(group: BaseExceptionGroup[OSError]) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out


if __name__ == "__main__":
    raise SystemExit(main())
