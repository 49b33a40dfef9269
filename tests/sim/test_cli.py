"""`narwhal-sim` / `python -m narwhal.sim` as a process."""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
from functools import partial
from pathlib import Path

import httpx
import pytest
import trio

from narwhal.cli import sim as sim_cli
from narwhal.sim import KvEventsConfig, SimEngineSpec


async def _read_lines(proc: trio.Process, n: int) -> list[str]:
    assert proc.stdout is not None
    buf = b""
    with trio.fail_after(20):
        while buf.count(b"\n") < n:
            chunk = await proc.stdout.receive_some(4096)
            assert chunk, "narwhal-sim exited before printing its URLs"
            buf += chunk
    return buf.decode().splitlines()[:n]


async def test_cli_serves_until_sigint(tmp_path: Path) -> None:
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"timing": {"step_base_s": 0.001, "max_model_len": 4096}}))
    cmd = [
        sys.executable,
        "-m",
        "narwhal.sim",
        "--port",
        "0",
        "--engines",
        "2",
        "--speed",
        "10",
        "--build",
        "cli-test",
        "--profile",
        str(profile),
    ]
    async with trio.open_nursery() as nursery:
        proc: trio.Process = await nursery.start(
            partial(trio.run_process, cmd, stdout=subprocess.PIPE, check=False)
        )
        try:
            urls = await _read_lines(proc, 2)
            assert all(u.startswith("http://127.0.0.1:") for u in urls)
            assert len(set(urls)) == 2
            async with httpx.AsyncClient(timeout=5) as client:
                for url in urls:
                    assert (await client.get(f"{url}/health")).status_code == 200
                version = (await client.get(f"{urls[0]}/version")).json()
                assert version["build"] == "cli-test"
                models = (await client.get(f"{urls[1]}/v1/models")).json()
                assert models["data"][0]["max_model_len"] == 4096
            proc.send_signal(signal.SIGINT)
            with trio.fail_after(10):
                await proc.wait()
            assert proc.returncode == 0
        finally:
            if proc.returncode is None:
                proc.kill()


def test_cli_rejects_bad_profile(tmp_path: Path) -> None:
    profile = tmp_path / "bad.json"
    profile.write_text(json.dumps({"nonsense": 1}))
    proc = subprocess.run(
        [sys.executable, "-m", "narwhal.sim", "--profile", str(profile)],
        capture_output=True,
        text=True,
        check=False,
        timeout=30,
    )
    assert proc.returncode == 2
    assert "unknown timing field(s): nonsense" in proc.stderr


def test_cli_options_reach_the_engine_spec() -> None:
    args = sim_cli.parser().parse_args(
        ["--stock-version", "--stream-interval", "4", "--build", "b-7", "--dialect", "sglang"]
    )
    spec = sim_cli.spec_from_args(args)
    assert (spec.stock_version, spec.stream_interval, spec.build, spec.dialect) == (
        True,
        4,
        "b-7",
        "sglang",
    )
    assert not sim_cli.spec_from_args(sim_cli.parser().parse_args([])).stock_version
    # SGLang 0.5.23's /tokenize, which takes messages too, by default; an older one's not.
    assert spec.tokenize_messages
    older = sim_cli.parser().parse_args(["--dialect", "sglang", "--no-tokenize-messages"])
    assert not sim_cli.spec_from_args(older).tokenize_messages
    # A request without an output bound: 256 tokens by default, or a count, or the context.
    assert spec.unbounded_max_tokens == 256
    for option, bound in (("64", 64), ("context", None)):
        bounded = sim_cli.parser().parse_args(["--unbounded-max-tokens", option])
        assert sim_cli.spec_from_args(bounded).unbounded_max_tokens == bound
    with pytest.raises(ValueError, match="--engines is 0; must be >= 1"):
        sim_cli.spec_from_args(sim_cli.parser().parse_args(["--engines", "0"]))


def test_cli_gives_each_sglang_engine_its_launch_mode() -> None:
    def modes(*argv: str) -> object:
        return sim_cli.modes_from_args(sim_cli.parser().parse_args(list(argv)))

    sglang = ("--dialect", "sglang", "--engines", "3")
    assert modes(*sglang) is None
    assert modes(*sglang, "--disaggregation-mode", "prefill,decode,null") == (
        "prefill",
        "decode",
        "null",
    )
    assert modes(*sglang, "--disaggregation-mode", "decode") == ("decode",) * 3
    with pytest.raises(ValueError, match=r"^--disaggregation-mode gives 2 modes for 3 engines"):
        modes(*sglang, "--disaggregation-mode", "prefill,decode")
    with pytest.raises(ValueError, match=r"^--disaggregation-mode 'both' is not one of"):
        modes(*sglang, "--disaggregation-mode", "both")
    with pytest.raises(ValueError, match=r"needs --dialect sglang$"):
        modes("--disaggregation-mode", "prefill")


def test_cli_plays_a_vllm_build_and_gives_each_engine_its_connector() -> None:
    def args(*argv: str) -> argparse.Namespace:
        return sim_cli.parser().parse_args(list(argv))

    assert sim_cli.spec_from_args(args()).vllm_version == "0.32.0"
    assert sim_cli.spec_from_args(args("--vllm-version", "0.29.0")).vllm_version == "0.29.0"
    with pytest.raises(SystemExit):
        args("--vllm-version", "0.30.0")
    assert sim_cli.connectors_from_args(args("--engines", "2")) is None
    four = ("--engines", "4", "--kv-connector")
    assert sim_cli.connectors_from_args(args(*four, "none,none,nixl,nixl")) == (
        False,
        False,
        True,
        True,
    )
    assert sim_cli.connectors_from_args(args(*four, "none")) == (False,) * 4
    with pytest.raises(ValueError, match=r"^--kv-connector gives 2 kinds for 4 engines"):
        sim_cli.connectors_from_args(args(*four, "none,nixl"))
    with pytest.raises(ValueError, match=r"^--kv-connector 'lmcache' is not one of nixl, none$"):
        sim_cli.connectors_from_args(args(*four, "lmcache"))


def test_cli_turns_on_the_prefix_cache_and_its_events() -> None:
    def spec(*argv: str) -> SimEngineSpec:
        return sim_cli.spec_from_args(sim_cli.parser().parse_args(list(argv)))

    plain = spec()
    assert not plain.prefix_caching
    assert plain.kv_events is None
    events = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:6000", "topic": "kv"}'
    on = spec(
        "--enable-prefix-caching",
        "--block-size",
        "128",
        "--enable-prompt-tokens-details",
        "--kv-events-config",
        events,
    )
    assert on.prefix_caching
    assert on.prompt_tokens_details
    assert on.timing.block_size == 128
    assert on.kv_events == KvEventsConfig(endpoint="tcp://*:6000", topic="kv")
    assert on.kv_events.for_engine(2).endpoint == "tcp://*:6002"
    # Events off, as vLLM reads the same object: no publisher at all.
    off = spec("--enable-prefix-caching", "--kv-events-config", '{"endpoint": "tcp://*:1"}')
    assert off.kv_events is None
    with pytest.raises(ValueError, match=r"^kv_events needs prefix_caching"):
        spec("--kv-events-config", events)
    with pytest.raises(ValueError, match=r"^unknown KV events field\(s\): bogus$"):
        spec("--enable-prefix-caching", "--kv-events-config", '{"bogus": 1}')
