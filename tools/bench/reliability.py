"""Reliability soak: many requests through the real daemon with random faults and
config reloads, then every invariant of tests/reliability/invariants.py.

    .venv/bin/python tools/bench/reliability.py [--dialect vllm|sglang] [--requests 20000]
        [--fault-rate 0.03] [--speed 20] [--concurrency 32] [--reload-every 3]
        [--workers N [--kill-worker-after S]] [--out runs/bench/reliability.json]

Three processes on loopback: a simulated fleet (2 prefill + 2 decode engines, this
script re-run as `--serve-sim`, with an outcome ring large enough for every leg),
`narwhal serve` on a config file, and this load generator. Faults come at
--fault-rate per request the router served: when such a request ends, one random fault
(crash, stall before or after the first token, engine 5xx/429, slow first token,
mid-stream error event, short KV lease, failed KV pull, an engine going down for a
moment) may be armed on an engine the router has in placement, for its next leg. So an
outage, whose refusals come back in milliseconds, does not speed the faults up, and no
fault is aimed at an engine out of placement, whose only legs are the router's
verification legs (docs/benchmarks.md). A few clients hang up part-way. Every
--reload-every seconds the config file is rewritten with another valid variant (or,
one time in five, an invalid one that must be rejected) and the daemon gets SIGHUP.
Once the load has drained the router and the engines must be idle and every invariant
must hold; the result goes to --out as JSON. Bounded: the load stops after --max-s.

`--workers N` runs the daemon with serving.workers = N; `--kill-worker-after S` then
SIGKILLs the worker serving the most requests S seconds into the load. The requests it
takes with it (in flight at that moment, and not listed in flight on another worker) may
end cut short, as verdict `worker_lost`; every other invariant holds for them too, and the
router must count each once (`worker_lost` among its outcomes).

`--dialect sglang` plays an SGLang P/D fleet instead: two servers launched with
`--disaggregation-mode prefill` and two with `decode`, which Narwhal drives as
bootstrap pairs (both legs at once, the same body, paired by bootstrap room; the
result goes to runs/bench/reliability-sglang.json). Its faults are the ones SGLang can
show: no short KV lease (SGLang has none: a prefill server pushes the KV to its decoder
and frees it then, or when the decoder has left, or at the bootstrap timeout), and,
since the prefill leg carries the client's streamed body, crashes, error events and slow
starts on either leg. Its config variants are valid for an SGLang fleet (no role
changes: the launch mode fixes them), and one of its invalid variants mixes dialects.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import sys
import tempfile
import time
from collections.abc import Collection
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import Any

import benchkit
import h11
import trio
from benchkit import harness
from prometheus_client.parser import text_string_to_metric_families

ROOT = benchkit.REPO
sys.path.insert(0, str(ROOT))  # the soak's client and invariants are the test suite's

from narwhal.sim import DisaggregationMode, Fleet, SimEngineSpec, serve_fleet  # noqa: E402
from narwhal.sim._http import request as sim_request  # noqa: E402
from tests.reliability.client import Exchange, after_events, exchange  # noqa: E402
from tests.reliability.invariants import check_all, verdict  # noqa: E402

MODEL = "sim-llama-3-8b"
ROLES: tuple[DisaggregationMode, ...] = ("prefill", "prefill", "decode", "decode")
DIALECTS = ("vllm", "sglang")
SLACK_S = 1.0

BASE: dict[str, Any] = {
    "listen": {"host": "127.0.0.1", "port": 0},
    "admin": {"host": "127.0.0.1", "port": 0},
    "serving": {
        "admission": "open",
        "request_timeout_s": 4.0,
        "prefill_timeout_s": 1.0,
        "max_attempts": 3,
        "handoff_timeout_s": 1.0,
        "retry_base_s": 0.005,
        "retry_cap_s": 0.05,
        "retry_budget": 200,
        "retry_replenish": 0.5,
        "client_stall_s": 0.5,
    },
    "engine": {
        "first_token_timeout_s": 1.0,
        "decode_read_timeout_s": 0.5,
        "tokenize_timeout_s": 0.5,
        "health_timeout_s": 0.5,
        "connect_timeout_s": 0.5,
    },
    "recovery": {
        "restart_hold_s": 0.2,
        "health": {"interval_s": 0.1, "failure_threshold": 2, "readmit_successes": 2},
        "breaker": {"failure_threshold": 5, "window_s": 5.0, "open_s": 0.3},
        "shutdown_grace_s": 2.0,
    },
    "controller": {"enabled": False},
}
# Valid variants cycled through by the reloads: limits resized in place, timers and
# retry settings for new requests. request_timeout_s stays at its maximum in BASE.
VARIANTS: list[dict[str, Any]] = [
    {},
    {
        "serving": {"max_attempts": 2, "retry_budget": 50, "prefill_concurrency": 16},
        "engine": {"decode_read_timeout_s": 0.4},
    },
    {
        "serving": {"decode_concurrency": 24, "request_timeout_s": 3.0},
        "engine": {"first_token_timeout_s": 0.8},
    },
]
INVALID: dict[str, Any] = {"serving": {"max_attempts": 9}}
# SGLang: a pair holds a slot on both engines before either leg is sent, so the phase
# limits are what its variants resize; the first-token timer starts when the prefill
# leg answers. Token counting without /tokenize is a path of its own (older SGLang
# builds cannot count chat).
SGLANG_VARIANTS: list[dict[str, Any]] = [
    {},
    {
        "serving": {
            "max_attempts": 2,
            "retry_budget": 50,
            "prefill_concurrency": 16,
            "decode_concurrency": 16,
        },
        "engine": {"decode_read_timeout_s": 0.4},
    },
    {
        "serving": {"decode_concurrency": 24, "request_timeout_s": 3.0},
        "engine": {"first_token_timeout_s": 0.8, "tokenize": False},
    },
]


def variants(dialect: str) -> list[dict[str, Any]]:
    return SGLANG_VARIANTS if dialect == "sglang" else VARIANTS


def invalid_documents(dialect: str, valid: dict[str, Any]) -> list[dict[str, Any]]:
    """The rejected reloads, taken in turn: a field out of range, and for SGLang also a
    fleet whose dialects differ (a vLLM prefill cannot hand KV to an SGLang decode)."""
    out = [merge(valid, INVALID)]
    if dialect == "sglang":
        engines = [dict(e) for e in valid["engines"]]
        engines[0]["dialect"] = "vllm"
        del engines[0]["bootstrap_port"]
        out.append({**valid, "engines": engines})
    return out


def engine_entries(dialect: str, urls: list[str]) -> list[dict[str, Any]]:
    engines: list[dict[str, Any]] = []
    for i, (url, role) in enumerate(zip(urls, ROLES, strict=True)):
        entry: dict[str, Any] = {"id": f"{role[0]}{i}", "url": url, "role": role, "model": MODEL}
        if dialect == "sglang":
            entry["dialect"] = "sglang"
            # narwhal-sim serves the bootstrap endpoints on the engine's HTTP port.
            entry["bootstrap_port"] = int(url.rsplit(":", 1)[1])
        engines.append(entry)
    return engines


def merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


# ------------------------------------------------------------------------------ the fleet


async def serve_sim(speed: float, dialect: str) -> None:
    """Child process: the simulated fleet; prints its engine URLs as one JSON line."""
    spec = SimEngineSpec(outcome_ring=400_000)
    sglang = dialect == "sglang"

    async with trio.open_nursery() as nursery:
        fleet: Fleet = await nursery.start(
            partial(
                serve_fleet,
                engines=len(ROLES),
                speed=speed,
                model=MODEL,
                spec=spec,
                dialect="sglang" if sglang else "vllm",
                disaggregation_modes=ROLES if sglang else None,
            )
        )
        print(json.dumps(fleet.urls), flush=True)


async def sim_call(url: str, method: str, path: str, body: Any = None) -> Any:
    host, port = url.split("://", 1)[1].split(":")
    with trio.fail_after(30):
        response = await sim_request(host, int(port), method, path, body, max_body=1 << 30)
    return response.json()


# ------------------------------------------------------------------------------ faults


FAULT_KINDS = {
    "vllm": (
        "crash",
        "stall_first",
        "stall_after",
        "status",
        "slow_first",
        "sse_error",
        "lease",
        "pull",
        "down",
    ),
    # No "lease": an SGLang prefill server has no KV lease to cut short. The prefill leg
    # is a stream of the client's body, so it can crash or end in an error event too.
    "sglang": (
        "crash",
        "prefill_crash",
        "stall_first",
        "stall_after",
        "status",
        "slow_first",
        "sse_error",
        "prefill_sse_error",
        "pull",
        "down",
    ),
}


# The kinds whose leg runs on one role; the rest ("stall_first", "status", "slow_first"
# for SGLang) pick a role first, and "down" takes any engine in placement.
_PREFILL_KINDS = ("prefill_crash", "prefill_sse_error", "lease")
_DECODE_KINDS = ("crash", "stall_after", "sse_error", "pull")


def random_fault(
    rng: random.Random, dialect: str, in_placement: Collection[int]
) -> tuple[int, dict[str, Any]] | None:
    """(engine index, fault) for one fault on an engine the router has in placement,
    or None when the role the drawn kind needs has no engine there. Engine faults apply
    to the engine's next matching leg.

    An engine out of placement gets no legs but the router's own verification legs, so
    a fault armed there would be spent on its readmission check instead of on serving
    traffic (and keep it out another round)."""
    kind = rng.choice(FAULT_KINDS[dialect])
    if kind == "down":
        engines = sorted(in_placement)
        return (rng.choice(engines), {"down_s": rng.uniform(0.05, 0.3)}) if engines else None
    if kind in _PREFILL_KINDS:
        role = "prefill"
    elif kind in _DECODE_KINDS or (kind == "slow_first" and dialect != "sglang"):
        role = "decode"
    else:
        role = rng.choice(("prefill", "decode"))
    engines = [i for i, r in enumerate(ROLES) if r == role and i in in_placement]
    if not engines:
        return None
    index = rng.choice(engines)
    leg = role
    if kind in ("crash", "prefill_crash"):
        tokens = rng.randint(0, 4) if kind == "crash" else 0
        return index, {"crash_after_tokens": tokens, "leg": leg, "count": 1}
    if kind in ("sse_error", "prefill_sse_error"):
        tokens = rng.randint(0, 3) if kind == "sse_error" else 0
        return index, {"sse_error_after_tokens": tokens, "leg": leg, "count": 1}
    if kind == "stall_first":
        return index, {"stall_before_first_token_s": 30.0, "leg": leg, "count": 1}
    if kind == "stall_after":
        return index, {"stall_after_tokens": rng.randint(1, 3), "leg": leg, "count": 1}
    if kind == "status":
        status = rng.choice((500, 502, 503, 504, 429))
        return index, {"error_status": status, "leg": leg, "count": rng.randint(1, 3)}
    if kind == "slow_first":
        # An SGLang pair's decode waits for its prefill, so a slow prefill start is a
        # slow first token too.
        return index, {"slow_first_token_s": rng.uniform(0.1, 1.5), "leg": leg, "count": 1}
    if kind == "lease":
        return index, {"lease_s": 0.0001, "leg": leg, "count": 1}
    return index, {"kv_pull_fail": True, "leg": leg, "count": 1}


def in_placement(state: dict[str, Any], engines: list[dict[str, Any]]) -> set[int]:
    """Indexes (into the soak's engine list) of the engines /narwhal/state has available."""
    available = {e["id"] for e in state["engines"] if e["available"]}
    return {i for i, e in enumerate(engines) if e["id"] in available}


def served(ex: Exchange) -> bool:
    """The router placed the request on engines: anything but a refusal for want of one.
    Faults are drawn per served request, so a closed-loop client refused in milliseconds
    while a role has no engine (3-6x the usual request rate) draws none."""
    return verdict(ex).code != "no_engine_available"


def shares(outcomes: dict[str, int]) -> dict[str, float | None]:
    """ok and no_engine_available as shares of all requests, and ok of the served ones.

    The clients are a closed loop: while a role has no engine they are refused in
    milliseconds and send 3-6x as many requests, so a run's few whole-role outages weigh
    on the ok share far beyond their seconds. ok of served leaves those refusals out."""
    total = sum(outcomes.values())
    refused = sum(n for label, n in outcomes.items() if label.endswith(":no_engine_available"))
    ok = outcomes.get("ok", 0)
    return {
        "ok": round(ok / total, 4) if total else None,
        "no_engine_available": round(refused / total, 4) if total else None,
        "ok_of_served": round(ok / (total - refused), 4) if total > refused else None,
    }


def legs_with_armed_faults(states: list[dict[str, Any]]) -> dict[str, int]:
    """Legs that ran with a fault armed on their engine, by whose they were: the soak's
    clients, the router's verification pairs (`narwhal-verify-...`), or anyone else."""
    out = {"serving": 0, "verification": 0, "other": 0}
    for state in states:
        for entry in state["outcomes"]:
            if not entry.get("armed_fault"):
                continue
            request_id = str(entry["request_id"])
            if request_id.startswith("narwhal-verify-"):
                out["verification"] += 1
            elif request_id.startswith("soak-"):
                out["serving"] += 1
            else:
                out["other"] += 1
    return out


def verification_counts(metrics: str) -> dict[str, Any]:
    """narwhal_verifications_total summed by outcome, from a /metrics page, with the
    share of pairs that failed: `failed_pairs` counts every pair that failed (a pair
    that failed at once is `retried`: sent again, only the second counts), and
    `failed_verdicts` the verifications whose counted pair failed."""
    by_outcome: dict[str, int] = {}
    for family in text_string_to_metric_families(metrics):
        for sample in family.samples:
            if sample.name == "narwhal_verifications_total":
                outcome = sample.labels["outcome"]
                by_outcome[outcome] = by_outcome.get(outcome, 0) + int(sample.value)
    pairs = sum(by_outcome.values())
    failed_pairs = by_outcome.get("failed", 0) + by_outcome.get("retried", 0)
    verdicts = pairs - by_outcome.get("retried", 0)
    return {
        "by_outcome": dict(sorted(by_outcome.items())),
        "pairs": pairs,
        "failed_pairs": failed_pairs,
        "failed_pair_share": round(failed_pairs / pairs, 4) if pairs else None,
        "verdicts": verdicts,
        "failed_verdicts": by_outcome.get("failed", 0),
        "failed_verdict_share": round(by_outcome.get("failed", 0) / verdicts, 4)
        if verdicts
        else None,
    }


FAULT_RULE = (
    "after each request the router served (anything but a no_engine_available refusal) "
    "ends, one fault is drawn with probability fault_rate and armed on an engine that "
    "/narwhal/state has available, for its next matching leg (a down closes it at once)"
)


# ------------------------------------------------------------------------------ the daemon


class Daemon:
    """`narwhal serve` on a config file the soak rewrites, ready once it tells systemd's
    notify socket (which names the ports it bound)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.config_path = directory / "narwhal.json"
        self.notify_path = directory / "notify.sock"
        self.process: trio.Process | None = None
        self.notify = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_DGRAM)
        self.url = ""
        self.admin_url = ""  # /narwhal/state and /metrics

    async def __aenter__(self) -> Daemon:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.notify.close()

    def write(self, document: dict[str, Any]) -> None:
        tmp = self.config_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(document))
        tmp.replace(self.config_path)

    async def start(self, procs: harness.Procs, document: dict[str, Any]) -> None:
        await self.notify.bind(str(self.notify_path))
        self.write(document)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("NOTIFY_", "WATCHDOG_"))}
        env["NOTIFY_SOCKET"] = str(self.notify_path)
        argv = [sys.executable, "-m", "narwhal", "serve", "--config", str(self.config_path)]
        self.process = await procs.start("narwhal", argv, env=env)
        with trio.fail_after(60):
            while True:
                text = (await self.notify.recv(65536)).decode()
                match = re.search(
                    r"listening on (http://[0-9.]+:[0-9]+); admin on (http://[0-9.]+:[0-9]+)", text
                )
                if "READY=1" in text.split("\n") and match is not None:
                    self.url, self.admin_url = match.group(1), match.group(2)
                    return

    async def get(self, path: str) -> Any:
        """An admin route's answer: the state document, or the /metrics text."""
        host, port = self.admin_url.split("://", 1)[1].split(":")
        with trio.fail_after(30):
            response = await sim_request(host, int(port), "GET", path, max_body=1 << 28)
        if path == "/metrics":
            return response.body.decode()
        return response.json()

    async def stop(self, procs: harness.Procs) -> int | None:
        if self.process is None:
            return None
        await procs.stop(self.process, grace_s=15.0)
        return self.process.returncode


def reload_counts(metrics: str) -> dict[str, int]:
    """narwhal_reloads_total by outcome, from a /metrics page."""
    return {
        sample.labels["outcome"]: int(sample.value)
        for family in text_string_to_metric_families(metrics)
        for sample in family.samples
        if sample.name == "narwhal_reloads_total"
    }


# ------------------------------------------------------------------------------ the load


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    started_wall = time.time()
    directory = Path(tempfile.mkdtemp(prefix="nw-soak-"))
    async with harness.Procs(directory) as procs, Daemon(directory) as daemon:
        argv = [sys.executable, __file__, "--serve-sim", "--speed", str(args.speed)]
        sim = await procs.start("sim", [*argv, "--dialect", args.dialect], stdout_pipe=True)
        (line,) = await harness.read_lines(sim, 1, 60.0)
        urls: list[str] = json.loads(line)
        engines = engine_entries(args.dialect, urls)
        ctl = {"socket": str(directory / "ctl.sock")}
        profiles = {"path": str(directory / "no-profiles.json")}
        plane = {"serving": {"workers": args.workers}}
        documents = [
            merge(
                merge(merge(BASE, variant), plane),
                {"engines": engines, "ctl": ctl, "profiles": profiles},
            )
            for variant in variants(args.dialect)
        ]
        invalid = invalid_documents(args.dialect, documents[0])
        await daemon.start(procs, documents[0])
        timeout_s = max(d["serving"]["request_timeout_s"] for d in documents)
        exchanges: list[Exchange] = []
        injected: dict[str, int] = {}
        reloads_sent = {"valid": 0, "invalid": 0}
        hang_ups = 0
        served_count = 0
        next_index = 0
        load_started = trio.current_time()
        stop_at = load_started + args.max_s

        async def arm_fault() -> None:
            state = await daemon.get("/narwhal/state")
            drawn = random_fault(rng, args.dialect, in_placement(state, engines))
            if drawn is None:
                name = "not_set_no_engine_of_its_role_in_placement"
            else:
                engine, fault = drawn
                name = next(k for k in fault if k not in ("leg", "count"))
                try:
                    await sim_call(urls[engine], "POST", "/_sim/faults", fault)
                except (OSError, h11.ProtocolError):
                    name = "not_set_engine_down"  # it is down for a moment already
            injected[name] = injected.get(name, 0) + 1

        async def one(index: int) -> None:
            nonlocal hang_ups, served_count
            stream = rng.random() < 0.7
            chat = rng.random() < 0.2
            prompt = " ".join(rng.choice(("alpha", "beta", "gamma")) for _ in range(16))
            body: dict[str, Any] = {
                "model": MODEL,
                "max_tokens": rng.randint(4, 24),
                "stream": stream,
            }
            if chat:
                body["messages"] = [{"role": "user", "content": prompt}]
            else:
                body["prompt"] = prompt
            hang_up = None
            if stream and rng.random() < 0.01:
                hang_ups += 1
                hang_up = after_events(rng.randint(1, 3))
            ex = await exchange(
                daemon.url,
                body,
                request_id=f"soak-{index}",
                path="/v1/chat/completions" if chat else "/v1/completions",
                hang_up=hang_up,
                give_up_s=timeout_s + 15.0,
                on_start=exchanges.append,
            )
            # The fault clock: one draw per request the router served, made when it has
            # ended, so an outage (requests refused in milliseconds) draws no faults.
            if served(ex):
                served_count += 1
                if rng.random() < args.fault_rate:
                    await arm_fault()

        async def worker() -> None:
            nonlocal next_index
            while next_index < args.requests and trio.current_time() < stop_at:
                index = next_index
                next_index += 1
                await one(index)

        async def reloader(done: trio.Event) -> None:
            turn = 0
            while not done.is_set():
                with trio.move_on_after(args.reload_every):
                    await done.wait()
                if done.is_set():
                    return
                turn += 1
                if turn % 5 == 0:
                    daemon.write(invalid[(turn // 5 - 1) % len(invalid)])
                    reloads_sent["invalid"] += 1
                else:
                    daemon.write(documents[turn % len(documents)])
                    reloads_sent["valid"] += 1
                assert daemon.process is not None
                daemon.process.send_signal(signal.SIGHUP)

        kill: dict[str, Any] = {}

        async def kill_worker() -> None:
            """SIGKILL the worker process serving the most requests, once."""
            await trio.sleep(args.kill_worker_after)
            state = await daemon.get("/narwhal/state")
            workers = state["workers"]
            victim = max(workers, key=lambda w: len(w.get("in_flight", [])))
            kill["others_in_flight"] = sorted(
                r["id"] for w in workers if w is not victim for r in w.get("in_flight", [])
            )
            kill["victim_in_flight"] = len(victim.get("in_flight", []))
            os.kill(victim["pid"], signal.SIGKILL)
            kill["at"] = trio.current_time()
            kill["worker"] = victim["index"]
            print(f"  killed worker {victim['index']} (pid {victim['pid']})", file=sys.stderr)

        async def progress(done: trio.Event) -> None:
            while not done.is_set():
                with trio.move_on_after(10):
                    await done.wait()
                elapsed = trio.current_time() - load_started
                print(f"  {len(exchanges)} requests in {elapsed:.0f}s", file=sys.stderr)

        done = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reloader, done)
            nursery.start_soon(progress, done)
            if args.kill_worker_after is not None:
                nursery.start_soon(kill_worker)
            async with trio.open_nursery() as workers:
                for _ in range(args.concurrency):
                    workers.start_soon(worker)
            done.set()
        load_s = trio.current_time() - load_started
        # Back to a known-good config, faults off, then wait for everything to drain.
        daemon.write(documents[0])
        assert daemon.process is not None
        daemon.process.send_signal(signal.SIGHUP)
        for url in urls:
            with trio.fail_after(10):
                while True:
                    try:
                        await sim_call(url, "DELETE", "/_sim/faults")
                        break
                    except (OSError, h11.ProtocolError):
                        await trio.sleep(0.1)  # down for a moment (down_s); try again
        settle_started = trio.current_time()
        router_state, engine_states, settle_waited = await settle(daemon, urls)
        settle_s = trio.current_time() - settle_started
        lost = lost_with_worker(exchanges, kill)
        report = check_all(
            exchanges,
            request_timeout_s=timeout_s,
            slack_s=SLACK_S,
            engine_states=engine_states,
            router_state=router_state,
            outcomes_before={},
            lost=lost,
        )
        metrics = await daemon.get("/metrics")
        reloads = reload_counts(metrics)
        verifications = verification_counts(metrics)
        armed_legs = legs_with_armed_faults(engine_states)
        faults_set = sum(n for name, n in injected.items() if not name.startswith("not_set"))
        code = await daemon.stop(procs)
        visible = sum(1 for ex in exchanges if verdict(ex).visible_output)
        counters = _sum_counters(engine_states)
        return {
            "tool": "tools/bench/reliability.py",
            "measured_at": datetime.fromtimestamp(started_wall, UTC).isoformat(timespec="seconds"),
            "machine": {**benchkit.machine(), "loadavg_end": benchkit.load_average()},
            "versions": benchkit.versions(
                ["narwhal", "trio", "h11", "hypercorn", "httpx", "attrs"]
            ),
            "run": {
                "dialect": args.dialect,
                "requests": len(exchanges),
                "requested": args.requests,
                "concurrency": args.concurrency,
                "fault_rate": args.fault_rate,
                "sim_speed": args.speed,
                "seed": args.seed,
                "reload_every_s": args.reload_every,
                "workers": args.workers,
                "load_s": round(load_s, 1),
                "settle_s": round(settle_s, 1),
                "settle_waited_s": settle_waited,
                "requests_per_s": round(len(exchanges) / load_s, 1),
                "daemon_exit_code": code,
            },
            "config": {
                "base": BASE,
                "engines": engines,
                "variants": variants(args.dialect),
                "invalid_variant": INVALID,
                **({"invalid_mixed_dialects": True} if args.dialect == "sglang" else {}),
            },
            "outcomes": dict(sorted(report.outcomes.items())),
            "shares": shares(report.outcomes),
            "streams_with_visible_output": visible,
            "client_hang_ups": hang_ups,
            "faults_injected": dict(sorted(injected.items())),
            "fault_clock": {
                "rule": FAULT_RULE,
                "served_requests": served_count,
                "faults_set": faults_set,
                "faults_per_served_request": round(faults_set / max(served_count, 1), 4),
                "legs_with_armed_faults": armed_legs,
            },
            "verifications": verifications,
            "engine_counters": counters,
            "reloads": {"sent": reloads_sent, "daemon": reloads},
            "worker_kill": _kill_report(kill, lost, report.outcomes),
            "router_outcomes": router_state["requests"]["outcomes"],
            "retry_budget": router_state["retry_budget"],
            "invariants": report.to_json(),
        }


def lost_with_worker(exchanges: list[Exchange], kill: dict[str, Any]) -> set[str]:
    """The requests a killed worker may have taken with it: in flight when it died, and
    not listed in flight on another worker just before."""
    if "at" not in kill:
        return set()
    at, others = kill["at"], set(kill["others_in_flight"])
    return {
        ex.request_id
        for ex in exchanges
        if ex.started <= at and (ex.ended == 0 or ex.ended >= at) and ex.request_id not in others
    }


def _kill_report(kill: dict[str, Any], lost: set[str], outcomes: Any) -> dict[str, Any] | None:
    if "at" not in kill:
        return None
    return {
        "worker": kill["worker"],
        "its_requests_in_flight_listed": kill["victim_in_flight"],
        "in_flight_at_the_kill_elsewhere_or_unlisted": len(lost),
        "ended_worker_lost": outcomes.get("worker_lost", 0),
    }


def _sum_counters(states: list[dict[str, Any]]) -> dict[str, int]:
    keys = (
        "crashes_injected",
        "stalls_injected",
        "errors_injected",
        "sse_errors_injected",
        "slow_first_tokens_injected",
        "kv_pull_failures_injected",
        "kv_expired",
        "downs_injected",
    )
    out = {key: sum(int(s["counters"][key]) for s in states) for key in keys}
    for key in ("requests", "completed", "aborted", "errors"):
        out[f"legs_{key}"] = sum(sum(s["counters"][key].values()) for s in states)
    return out


async def settle(
    daemon: Daemon, urls: list[str]
) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, float]]:
    """Wait (bounded) until the router is idle and every engine is available, idle and
    has released or expired every KV lease; then read the final state of both, and how
    long each condition held the wait up (`waited_s`: a slow settle says what it was)."""
    waited: dict[str, float] = {}
    with trio.fail_after(120):
        while True:
            state = await daemon.get("/narwhal/state")
            blockers = [f"unavailable:{e['id']}" for e in state["engines"] if not e["available"]]
            if state["admission"]["retained"]:
                blockers.append("router_retained")
            if not blockers:
                for url in urls:
                    engine = await sim_call(url, "GET", "/_sim/state?outcomes=0")
                    blockers.extend(f"busy:{url}:{why}" for why in _busy(engine))
                if not blockers:
                    break
            before = trio.current_time()
            await trio.sleep(0.2)
            for blocker in blockers:
                waited[blocker] = waited.get(blocker, 0.0) + trio.current_time() - before
    router_state = await daemon.get("/narwhal/state")
    engine_states = [await sim_call(url, "GET", "/_sim/state") for url in urls]
    return router_state, engine_states, {k: round(v, 1) for k, v in sorted(waited.items())}


def _busy(state: dict[str, Any]) -> list[str]:
    """What keeps a simulated engine from being idle (none: it is)."""
    counters = state["counters"]
    accepted = sum(counters["requests"].values())
    refused = counters["errors_injected"] + counters["rejected_queue_full"]
    ended = sum(sum(counters[k].values()) for k in ("completed", "aborted", "errors"))
    busy = [name for name in ("running", "waiting", "pulling") if state[name]]
    if state["leases"]["held"]:
        busy.append("leases")
    if ended < accepted + refused:
        busy.append("unended")
    return busy


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dialect", choices=DIALECTS, default="vllm")
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument(
        "--fault-rate",
        type=float,
        default=0.03,
        help="faults per request served (not refused with no_engine_available)",
    )
    parser.add_argument("--speed", type=float, default=20.0)
    parser.add_argument("--reload-every", type=float, default=3.0)
    parser.add_argument("--workers", type=int, default=1, help="serving.workers")
    parser.add_argument(
        "--kill-worker-after",
        type=float,
        default=None,
        help="SIGKILL the busiest worker process this many seconds into the load",
    )
    parser.add_argument("--max-s", type=float, default=900.0, help="stop starting requests")
    parser.add_argument("--seed", type=int, default=9)
    parser.add_argument(
        "--out", help="default: runs/bench/reliability.json, reliability-sglang.json for sglang"
    )
    parser.add_argument("--serve-sim", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_sim:
        trio.run(serve_sim, args.speed, args.dialect)
        return 0
    if args.out is None:
        name = "reliability-sglang.json" if args.dialect == "sglang" else "reliability.json"
        args.out = str(ROOT / "runs" / "bench" / name)
    if not 0.01 <= args.fault_rate <= 0.05:
        print("note: the soak is specified at a 1-5% fault rate", file=sys.stderr)
    result = trio.run(soak, args)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    invariants = result["invariants"]
    print(json.dumps({"outcomes": result["outcomes"], "passed": invariants["passed"]}))
    for name, check in invariants["checks"].items():
        print(f"  {name}: {'ok' if check['passed'] else 'FAILED'} ({check['checked']} checked)")
        for example in check["examples"]:
            print(f"      {example}")
    return 0 if invariants["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
