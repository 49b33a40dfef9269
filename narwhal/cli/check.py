"""narwhal-check: preflight a configured fleet and print a pass/fail table.

    narwhal-check --config FILE [--record] [--json PATH] [options]

Exits 0 when every check passes (warnings and skips allowed), 1 when any fails or its
results cannot be written, 2 on a configuration or usage error (an option out of range,
a --json or --record destination that cannot be written, or a --record store locked by
another writer, found before anything is measured). See `narwhal.probe._check` for what
each check does.

``--record`` writes the measured facts (verified KV lease per engine and its fleet
minimum, crossed-handoff p99, the builds they were measured on) into the existing profile
store at ``profiles.path``, keeping its profiles, under the store's writer lock (held
from the start; refused, exit 2, while a narwhal-profile holds it); without a readable
store nothing is recorded (run narwhal-profile first). narwhal-profile keeps recorded
facts while the builds are unchanged.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from functools import partial

import attrs
import trio

from .._errors import os_reason
from ..config import Config, ConfigError, load_config_file
from ..probe import CheckPlan, format_table, run_check
from ..profiles import StoreBusy, lock_store, read_store, save_profiles
from ._common import (
    add_version,
    closed_pipe_is_quiet,
    count,
    interruptible,
    positive_seconds,
    signal_exit,
    unwritable,
)
from .profile import _sizes


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="narwhal-check",
        description="Preflight: health, SGLang launch modes, tokenisation, crossed handoffs, "
        "profiles, KV lease and timeouts of every configured engine.",
    )
    p.add_argument("--config", required=True, help="path to the JSON config file")
    p.add_argument(
        "--record", action="store_true", help="record the measured facts in the profile store"
    )
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON to PATH")
    p.add_argument(
        "--handoff-samples", type=count, default=2, help="handoffs per pair and size for the p99"
    )
    p.add_argument("--handoff-sizes", type=_sizes, help="handoff prompt sizes in tokens")
    p.add_argument(
        "--lease-max-s",
        type=positive_seconds,
        default=120.0,
        help="longest wait for a producer to release an abandoned handoff (default 120)",
    )
    p.add_argument(
        "--lease-poll-s",
        type=positive_seconds,
        default=0.05,
        help="producer counter poll period",
    )
    p.add_argument("--no-lease", action="store_true", help="skip the lease measurement")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    add_version(p)
    return p


def _err(message: str) -> None:
    print(f"narwhal-check: {message}", file=sys.stderr, flush=True)


async def run(
    config: Config, plan: CheckPlan, *, record: bool, json_path: str | None, quiet: bool
) -> int:
    store, problems = await trio.to_thread.run_sync(read_store, config.profiles.path)
    report = await run_check(
        config,
        plan,
        store=store,
        store_problems=problems,
        progress=(lambda _: None) if quiet else _err,
    )
    print(format_table(report.rows), flush=True)
    unwritten = False
    if json_path:
        document = {
            "failed": report.failed,
            "lease_s": report.lease_s,
            "lease_by_engine": report.lease_by_engine,
            "crossed_handoff_p99_s": report.crossed_p99_s,
            "builds": report.builds,
            "rows": [attrs.asdict(row) for row in report.rows],
        }
        text = json.dumps(document, indent=2) + "\n"
        try:
            await trio.Path(json_path).write_text(text, encoding="utf-8")
        except OSError as exc:
            _err(f"--json: cannot write {json_path}: {os_reason(exc)}")
            unwritten = True
    if record:
        # The store as it is now (the lock keeps other writers out, not someone's cp).
        current, _ = await trio.to_thread.run_sync(read_store, config.profiles.path)
        if current is None:
            _err(f"nothing recorded: no valid profile store at {config.profiles.path}")
        else:
            updated = attrs.evolve(current, facts=report.facts())
            try:
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(
                        partial(save_profiles, updated, config.profiles.path)
                    )
            except OSError as exc:
                _err(f"--record: cannot write {config.profiles.path}: {os_reason(exc)}")
                unwritten = True
            else:
                _err(f"recorded lease and crossed-handoff p99 in {config.profiles.path}")
    failed = [row for row in report.rows if row.status == "fail"]
    if failed:
        _err(f"{len(failed)} check(s) failed")
        return 1
    return 1 if unwritten else 0


def _interrupted(record: bool, name: str) -> int:
    kept = "; nothing was recorded" if record else ""
    _err(f"interrupted by {name} before the checks finished{kept}")
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
    # Checked before minutes of measurement, not after them.
    for option, path in (
        ("--json", args.json),
        ("--record", config.profiles.path if args.record else None),
    ):
        problem = None if path is None else unwritable(path)
        if problem is not None:
            _err(f"{option}: {problem}")
            return 2
    try:
        plan = CheckPlan(
            handoff_samples=args.handoff_samples,
            handoff_sizes=args.handoff_sizes,
            lease_max_s=args.lease_max_s,
            lease_poll_s=args.lease_poll_s,
            measure_lease=not args.no_lease,
        )
    except (TypeError, ValueError) as exc:
        _err(str(exc))
        return 2
    job = partial(run, config, plan, record=args.record, json_path=args.json, quiet=args.quiet)
    stop = partial(_interrupted, args.record)
    if not args.record:
        return trio.run(interruptible, job, stop)
    # Held from the start: the check loads the engines a concurrent sweep would measure.
    try:
        with lock_store(config.profiles.path, holder="narwhal-check --record"):
            return trio.run(interruptible, job, stop)
    except StoreBusy as exc:
        _err(f"--record: {exc}; nothing was checked")
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
