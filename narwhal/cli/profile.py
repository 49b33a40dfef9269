"""narwhal-profile: measure every configured engine directly and write the profile store.

    narwhal-profile --config FILE [--out PATH] [--fast] [sweep options]

The sweep (see `narwhal.probe._sweep` for exactly what is measured) is bounded in count
and time; progress goes to stderr. The store is written atomically to ``--out`` (default:
the config's ``profiles.path``) and read back against the config before the command
succeeds. A fit whose model error is above `narwhal.profiles.POOR_FIT_RESIDUAL_P90` gets
a WARNING line on stderr, even with ``--quiet``, and so does an engine whose prefills of
a cached prefix miss the cached-prefill law by more than that (`narwhal.probe._cached`);
the store is still written and the exit status is unchanged. The store's writer lock
(``PATH.lock``) is held throughout: a second narwhal-profile, or a narwhal-check
--record, is refused until this one ends. Facts recorded by ``narwhal-check --record`` in
an existing store are kept when every engine still runs the build they were measured on.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from functools import partial

import attrs
import trio

from .._errors import os_reason
from ..config import Config, ConfigError, load_config_file
from ..probe import SweepFailed, SweepPlan, cached_law_warning, carry_facts, profile_fleet
from ..profiles import (
    ProfileStore,
    StoreBusy,
    check_store,
    lock_store,
    poor_fits,
    read_store,
    save_profiles,
)
from ._common import add_version, closed_pipe_is_quiet, interruptible, signal_exit, unwritable


def _sizes(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        message = f"{text!r} is not a comma-separated list of integers"
        raise argparse.ArgumentTypeError(message) from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: sizes must be positive integers")
    return values


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="narwhal-profile",
        description="Measure engine latency profiles (prefill, decode, crossed handoff, "
        "KV capacity, chars/token) by driving every configured engine directly.",
    )
    p.add_argument("--config", required=True, help="path to the JSON config file")
    p.add_argument("--out", help="where to write the store (default: the config's profiles.path)")
    p.add_argument(
        "--fast", action="store_true", help="a small sweep (tests, smoke runs); options override"
    )
    p.add_argument("--prefill-sizes", type=_sizes, help="prompt sizes in tokens, e.g. 16,256,4096")
    p.add_argument("--prefill-repeats", type=int, help="requests per prefill size (default 3)")
    p.add_argument(
        "--decode-active",
        type=_sizes,
        help="concurrent decodes (default 1,4,16,64,128,256; points the engine will not "
        "run at once are skipped): the controller only moves to splits whose decode "
        "batches lie inside the measured range",
    )
    p.add_argument(
        "--decode-contexts", type=_sizes, help="decode context sizes in tokens (default 256,2048)"
    )
    p.add_argument(
        "--kv-budget",
        type=float,
        help="largest share of an engine's KV cache one decode point may fill (default 0.5)",
    )
    p.add_argument("--decode-gaps", type=int, help="measured gaps per decode point (default 24)")
    p.add_argument("--handoff-sizes", type=_sizes, help="handoff prompt sizes in tokens")
    p.add_argument("--handoff-repeats", type=int, help="handoffs per pair and size (default 4)")
    p.add_argument(
        "--cached-repeats",
        type=int,
        help="requests per cached-prefill point (default 5; 0: do not measure prefix caching)",
    )
    p.add_argument(
        "--parallel",
        type=int,
        help="engines measured at once (default 1; SGLang prefill/decode servers: always 1)",
    )
    p.add_argument("--budget-s", type=float, help="time budget of the whole sweep (default 900)")
    p.add_argument(
        "--request-timeout-s", type=float, help="bound on any single probe (default 120)"
    )
    p.add_argument("--seed", type=int, help="prompt text seed (default 0)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    add_version(p)
    return p


_OVERRIDES = {
    "prefill_sizes": "prefill_sizes",
    "prefill_repeats": "prefill_repeats",
    "decode_active": "decode_active",
    "decode_contexts": "decode_contexts",
    "decode_gaps": "decode_gaps",
    "kv_budget": "kv_budget",
    "handoff_sizes": "handoff_sizes",
    "handoff_repeats": "handoff_repeats",
    "cached_repeats": "cached_repeats",
    "parallel": "parallel",
    "budget_s": "budget_s",
    "request_timeout_s": "request_timeout_s",
    "seed": "seed",
}


def plan_from_args(args: argparse.Namespace) -> SweepPlan:
    plan = SweepPlan.fast() if args.fast else SweepPlan()
    changes = {
        field: getattr(args, option)
        for option, field in _OVERRIDES.items()
        if getattr(args, option) is not None
    }
    return attrs.evolve(plan, **changes)


def warnings(store: ProfileStore) -> list[str]:
    """What an operator must not miss in a fresh store: poor fits, and engines whose
    prefill of a cached prefix strays from the cached-prefill law."""
    out: list[str] = []
    for engine_id in sorted(store.engines):
        profile = store.engines[engine_id]
        out += [fit.message() for fit in poor_fits(profile)]
        cached = cached_law_warning(engine_id, profile.cached)
        if cached is not None:
            out.append(cached)
    return out


def _err(message: str) -> None:
    print(f"narwhal-profile: {message}", file=sys.stderr, flush=True)


async def run(config: Config, plan: SweepPlan, out: str, *, quiet: bool = False) -> int:
    progress = (lambda _: None) if quiet else _err
    try:
        store = await profile_fleet(config, plan, progress=progress)
    except SweepFailed as exc:
        _err(f"{exc}; nothing was written")
        return 1
    old, _ = await trio.to_thread.run_sync(read_store, out)
    store, dropped = carry_facts(store, old)
    if dropped:
        _err(dropped)
    # A signal during the write lets it finish: the store is then the new one, whole.
    with trio.CancelScope(shield=True):
        try:
            await trio.to_thread.run_sync(partial(save_profiles, store, out))
        except OSError as exc:
            _err(f"cannot write {out}: {os_reason(exc)}; the measurements are lost")
            return 1
        reread, problems = await trio.to_thread.run_sync(read_store, out)
    check = check_store(reread, problems, config)
    for message in check.messages:
        _err(message)
    # Even with --quiet: a poor fit is what an operator must not miss, and the progress
    # lines that also show the residuals scroll past.
    for warning in warnings(store):
        _err(f"WARNING: {warning}")
    if not check.ok:
        return 1
    print(
        f"wrote {out}: {len(store.engines)} engine profile(s), {len(store.handoffs)} "
        f"handoff pair(s) in {store.sweep.get('duration_s')} s"
    )
    return 0


def _interrupted(out: str, name: str) -> int:
    _err(f"interrupted by {name}: nothing was written; {out} is as it was")
    return signal_exit(name)


@closed_pipe_is_quiet
def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        config = load_config_file(args.config)
    except ConfigError as exc:
        _err(f"{len(exc.messages)} problem(s) in {args.config}:")
        for message in exc.messages:
            print(message, file=sys.stderr)
        return 2
    try:
        plan = plan_from_args(args)
    except (TypeError, ValueError) as exc:
        _err(str(exc))
        return 2
    out = args.out or config.profiles.path
    # A sweep takes minutes: find out now, not after it, that its result cannot be kept.
    problem = unwritable(out)
    if problem is not None:
        _err(f"{problem}; nothing was measured")
        return 2
    try:
        with lock_store(out, holder="narwhal-profile"):
            job = partial(run, config, plan, out, quiet=args.quiet)
            return trio.run(interruptible, job, partial(_interrupted, out))
    except StoreBusy as exc:
        _err(f"{exc}; nothing was measured")
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
