"""The demo: a simulated fleet, Narwhal in front of it, a short mixed workload, a summary.

`python -m narwhal.demo` (README: `bash tools/demo.sh`) starts `narwhal-sim` for the
fleet in conf/demo.json, starts `narwhal serve --config conf/demo.json`, sends a short
mix of chat and code-completion style requests (streaming and not), prints a summary
(outcomes, TTFT/TPOT percentiles) and the final /narwhal/state, read on the admin
listener (admin.host:admin.port, with admin.token if the config sets one), and stops
everything it started, by PID, even when something fails.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import attrs
import httpx
import numpy as np
import trio

from .cli._common import closed_pipe_is_quiet
from .config import Config, ConfigError, load_config_file
from .engines._dialects import usage_tokens

_WORDS = [
    "model",
    "router",
    "engine",
    "token",
    "prefill",
    "decode",
    "cache",
    "latency",
    "request",
    "stream",
    "batch",
    "queue",
    "schedule",
    "memory",
    "tensor",
    "kernel",
    "attention",
    "layer",
    "weight",
    "vector",
    "python",
    "function",
    "return",
    "value",
    "error",
    "result",
    "index",
    "string",
    "number",
    "object",
    "method",
    "class",
    "module",
    "import",
    "system",
]


@attrs.frozen
class Job:
    kind: str  # "chat" or "completions"
    prompt_words: int
    max_tokens: int
    stream: bool
    at_s: float


@attrs.define
class Result:
    job: Job
    status: int = 0
    outcome: str = "ok"
    ttft_s: float | None = None
    tpot_s: float | None = None
    duration_s: float = 0.0


def workload(count: int, seed: int) -> list[Job]:
    """A conversation-like and a code-like mix (shapes of the Azure 2023 traces:
    conversation ~1k prompt / ~200 output tokens, code ~2k prompt / ~30 output)."""
    rng = random.Random(seed)
    jobs = []
    at = 0.0
    for _ in range(count):
        at += rng.expovariate(8.0)
        if rng.random() < 0.6:
            jobs.append(
                Job(
                    "chat",
                    int(rng.lognormvariate(6.2, 0.6)),
                    min(400, int(rng.lognormvariate(4.6, 0.7)) + 1),
                    rng.random() < 0.8,
                    at,
                )
            )
        else:
            jobs.append(
                Job(
                    "completions",
                    int(rng.lognormvariate(6.9, 0.6)),
                    min(120, int(rng.lognormvariate(2.8, 0.8)) + 1),
                    rng.random() < 0.5,
                    at,
                )
            )
    return jobs


def _body(job: Job, model: str, rng: random.Random) -> dict[str, object]:
    text = " ".join(rng.choice(_WORDS) for _ in range(max(1, job.prompt_words)))
    body: dict[str, object] = {"model": model, "max_tokens": job.max_tokens, "stream": job.stream}
    if job.kind == "chat":
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    if job.stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def _run_job(client: httpx.AsyncClient, url: str, job: Job, model: str, seed: int) -> Result:
    result = Result(job)
    path = "/v1/chat/completions" if job.kind == "chat" else "/v1/completions"
    body = _body(job, model, random.Random(seed))
    started = trio.current_time()
    try:
        if not job.stream:
            response = await client.post(url + path, json=body)
            result.status = response.status_code
            if response.status_code != 200:
                result.outcome = _error_code(response.content)
        else:
            async with client.stream("POST", url + path, json=body) as response:
                result.status = response.status_code
                if response.status_code != 200:
                    result.outcome = _error_code(await response.aread())
                else:
                    result.outcome = await _read_stream(response, started, result)
    except httpx.HTTPError as exc:
        result.outcome = f"client_error:{type(exc).__name__}"
    result.duration_s = trio.current_time() - started
    return result


async def _read_stream(response: httpx.Response, started: float, result: Result) -> str:
    first: float | None = None
    last = 0.0
    tokens = 0  # events with output
    reported = 0  # usage.completion_tokens, when the stream reports it
    outcome = "truncated"
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        payload = line[6:]
        if payload == "[DONE]":
            outcome = "ok"
            continue
        event = json.loads(payload)
        if "error" in event:
            outcome = str(event["error"].get("code", "stream_error"))
            continue
        count = usage_tokens(event, "completion_tokens")
        if count is not None:
            # An event can carry several tokens (an engine that falls behind packs them).
            reported = count
        choices = event.get("choices") or []
        if any((c.get("delta") or {}).get("content") or c.get("text") for c in choices):
            now = trio.current_time()
            if first is None:
                first = now
            last = now
            tokens += 1
    if first is not None:
        result.ttft_s = first - started
        tokens = max(tokens, reported)
        if tokens > 1:
            result.tpot_s = (last - first) / (tokens - 1)
    return outcome


def _error_code(raw: bytes) -> str:
    try:
        return str(json.loads(raw)["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return "unparsed_error"


def _percentiles(values: Sequence[float]) -> str:
    if not values:
        return "n/a"
    p50, p90, p99 = np.percentile(np.array(values) * 1000.0, [50, 90, 99])
    return f"p50 {p50:7.1f} ms   p90 {p90:7.1f} ms   p99 {p99:7.1f} ms   (n={len(values)})"


class ServeEnded(Exception):
    """The demo's own `narwhal serve` exited before it was ready."""


async def _wait_ready(
    client: httpx.AsyncClient, url: str, within_s: float, serve: subprocess.Popen[bytes]
) -> None:
    # The process is checked first at each turn: another router answering on these ports
    # must not be taken for ours (the port check at start-up leaves a short race).
    with trio.fail_after(within_s):
        while True:
            if serve.poll() is not None:
                raise ServeEnded("narwhal serve ended before it was ready")
            try:
                if (await client.get(url)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await trio.sleep(0.1)


async def drive(
    config: Config, serve: subprocess.Popen[bytes], *, requests: int, concurrency: int, seed: int
) -> tuple[list[str], str | None]:
    """Run the workload; print the final /narwhal/state. Returns the summary lines, which
    the caller prints last (after the fleet has stopped), and why the run failed, if it
    did."""
    url = f"http://{config.listen.host}:{config.listen.port}"
    admin = f"http://{config.admin.host}:{config.admin.port}"
    token = config.admin.bearer_token()
    admin_headers = {} if token is None else {"authorization": f"Bearer {token.reveal()}"}
    model = config.engines[0].model
    jobs = workload(requests, seed)
    results: list[Result] = []
    limiter = trio.CapacityLimiter(concurrency)
    async with httpx.AsyncClient(timeout=config.serving.request_timeout_s + 5) as client:
        await _wait_ready(client, url + "/health", 30.0, serve)
        started = trio.current_time()

        async def one(index: int, job: Job) -> None:
            await trio.sleep_until(started + job.at_s)
            async with limiter:
                results.append(await _run_job(client, url, job, model, seed + index))

        with trio.fail_after(config.serving.request_timeout_s * 2 + 60):
            async with trio.open_nursery() as nursery:
                for index, job in enumerate(jobs):
                    nursery.start_soon(one, index, job)
        elapsed = trio.current_time() - started
        state = (await client.get(admin + "/narwhal/state", headers=admin_headers)).json()
    outcomes = Counter(r.outcome for r in results)
    print("\n== /narwhal/state at the end ==")
    print(json.dumps(state, indent=2))
    durations = [r.duration_s for r in results if not r.job.stream and r.outcome == "ok"]
    summary = [
        "\n== Narwhal demo: summary ==",
        f"requests          {len(results)} in {elapsed:.1f} s ({len(results) / elapsed:.1f} req/s)",
        f"outcomes          {dict(sorted(outcomes.items()))}",
        f"streamed TTFT     {_percentiles([r.ttft_s for r in results if r.ttft_s is not None])}",
        f"streamed TPOT     {_percentiles([r.tpot_s for r in results if r.tpot_s is not None])}",
        f"non-stream total  {_percentiles(durations)}",
    ]
    failed = len(results) - outcomes.get("ok", 0)
    if not failed:
        return summary, None
    others = {k: v for k, v in sorted(outcomes.items()) if k != "ok"}
    return summary, f"{failed} of {len(results)} requests did not succeed: {others}"


def busy_ports(config: Config) -> list[str]:
    """The ports the demo would listen on that something else holds, each named with the
    field that sets it; the demo starts nothing then, rather than measure someone else's
    router."""
    wanted = [
        (config.listen.host, config.listen.port, "listen.port"),
        (config.admin.host, config.admin.port, "admin.port"),
    ]
    wanted += [(*spec.origin(), f"engines[{spec.id}].url") for spec in config.engines]
    busy = []
    for host, port, field in wanted:
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
            except OSError as exc:
                busy.append(f"{host}:{port} ({field}): {exc.strerror}")
    return busy


def _last_line(log: Path) -> str:
    try:
        lines = log.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return lines[-1] if lines else ""


def _start(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    handle = log.open("wb")
    return subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)


@closed_pipe_is_quiet
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="narwhal-demo", description=__doc__)
    parser.add_argument("--config", default="conf/demo.json")
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--speed", type=float, default=1.0, help="simulator speed factor")
    args = parser.parse_args(argv)
    try:
        config = load_config_file(args.config)
    except ConfigError as exc:
        print(f"narwhal-demo: {args.config}:\n{exc}", file=sys.stderr)
        return 1
    ports = sorted(spec.origin()[1] for spec in config.engines)
    if ports != list(range(ports[0], ports[0] + len(ports))):
        print("narwhal-demo: the demo fleet needs consecutive engine ports", file=sys.stderr)
        return 1
    busy = busy_ports(config)
    if busy:
        print(
            f"narwhal-demo: ports in use: {'; '.join(busy)}. Stop what holds them (another "
            "narwhal or demo?) or pass --config with other ports.",
            file=sys.stderr,
        )
        return 1
    logs = Path("runs/demo")
    logs.mkdir(parents=True, exist_ok=True)
    python = sys.executable
    started: list[subprocess.Popen[bytes]] = []
    try:
        sim_argv = [
            python,
            "-m",
            "narwhal.sim",
            "--port",
            str(ports[0]),
            "--engines",
            str(len(ports)),
            "--model",
            config.engines[0].model,
            "--speed",
            str(args.speed),
        ]
        started.append(_start(sim_argv, logs / "sim.log"))
        started.append(
            _start(
                [python, "-m", "narwhal", "serve", "--config", args.config], logs / "narwhal.log"
            )
        )
        print(
            f"narwhal-demo: fleet of {len(ports)} simulated engines on ports "
            f"{ports[0]}-{ports[-1]}, narwhal on {config.listen.host}:{config.listen.port}; "
            f"logs in {logs}/"
        )
        summary, failure = trio.run(
            lambda: drive(
                config,
                started[1],
                requests=args.requests,
                concurrency=args.concurrency,
                seed=args.seed,
            )
        )
    except trio.TooSlowError:
        summary, failure = [], "the workload did not finish in time"
    except ServeEnded as exc:
        summary, failure = [], str(exc)
    finally:
        for process in reversed(started):
            _stop(process)
    reasons = [] if failure is None else [failure]
    for process, (name, log) in zip(
        started, (("narwhal-sim", "sim"), ("narwhal serve", "narwhal")), strict=False
    ):
        if process.returncode not in (0, -signal.SIGTERM):
            said = _last_line(logs / f"{log}.log")
            reasons.append(
                f"{name} exited with {process.returncode}" + (f" ({said})" if said else "")
            )
    # The summary is what a person looks for: last, after the state document.
    for line in summary:
        print(line)
    if reasons:
        print(f"narwhal-demo: failed: {'; '.join(reasons)}; see {logs}/", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
