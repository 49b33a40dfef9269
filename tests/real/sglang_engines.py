"""Real SGLang engines for the real-engine tier: launch, wait, kill, restart, reap.

The engines run from their own venv (`tools/engines/sglang-venv.sh`, default
`~/.cache/narwhal/sglang-venv`, or `NARWHAL_SGLANG_VENV`), on free loopback ports, serving
the same tiny random-weight model as the vLLM engines (`tools/engines/tiny_model.py`). The
fleet is three engines, each a `engines.Engine` (the process handling is the same):

- ``agg``: an aggregate engine;
- ``prefill``, ``decode``: one P/D pair (`--disaggregation-mode`) moving KV over Mooncake's
  TCP transfer engine; the prefill server's bootstrap port is `SGLangFleet.bootstrap_port`.

The flags and environment are those of shared/notes/real-sglang.md: CPU device, the
torch-native attention backend, float32, and `--sleep-on-idle` on every engine (without it
each scheduler busy-polls a core). A developer can keep a fleet up between test runs:

    .venv/bin/python -m tests.real.sglang_engines up --state /tmp/sglang-fleet.json
    NARWHAL_SGLANG_FLEET=/tmp/sglang-fleet.json .venv/bin/pytest tests/real/sglang
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import attrs

from ..support import late_port
from .engines import (
    CONTEXT,
    MODEL_NAME,
    ROOT,
    Engine,
    EngineSetupError,
    RealFleet,
)

NAMES = ("agg", "prefill", "decode")


def venv() -> Path:
    """Where tools/engines/sglang-venv.sh puts the SGLang venv (the same default)."""
    if "NARWHAL_SGLANG_VENV" in os.environ:
        return Path(os.environ["NARWHAL_SGLANG_VENV"])
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "narwhal" / "sglang-venv"


def sglang_python() -> Path:
    python = venv() / "bin" / "python"
    if not python.exists():
        raise EngineSetupError(
            f"no SGLang venv at {venv()}: run `bash tools/engines/sglang-venv.sh` "
            "(the README's test command does)"
        )
    return python


def build_model(out: Path) -> Path:
    """The tiny model, built with the SGLang venv's Python (it has torch and transformers)."""
    result = subprocess.run(
        [str(sglang_python()), str(ROOT / "tools" / "engines" / "tiny_model.py"), str(out)],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    if result.returncode != 0:
        raise EngineSetupError(f"building the tiny model failed:\n{result.stderr[-4000:]}")
    return out


def sglang_env(*, pd: bool) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SGLANG_", "SGL_", "MC_", "NARWHAL_", "PYTEST", "VLLM_"))
    }
    env.update(
        # SGLang's modules choose their CPU code paths at import time by this.
        SGLANG_USE_CPU_ENGINE="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        DO_NOT_TRACK="1",
        # SIGTERM ends the server without draining its requests (the tier's engines are
        # reaped, never upgraded in place).
        SGL_FORCE_SHUTDOWN="1",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    if pd:
        env.update(
            # The bootstrap server and the transfer engine advertise this address.
            SGLANG_HOST_IP="127.0.0.1",
            # Mooncake over TCP: there is no RDMA device here.
            MC_FORCE_TCP="1",
            # The early send of a cached prefix records a CUDA event: on CPU it killed the
            # prefill server on a repeated prompt.
            SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX="0",
        )
    return env


def sglang_argv(
    model: Path, port: int, *, mode: str | None = None, bootstrap_port: int | None = None
) -> list[str]:
    argv = [
        str(sglang_python()),
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(model),
        "--served-model-name",
        MODEL_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--device",
        "cpu",
        "--attention-backend",
        "torch_native",
        "--dtype",
        "float32",
        "--context-length",
        str(CONTEXT),
        "--max-total-tokens",
        "8192",
        "--max-running-requests",
        "16",
        "--grammar-backend",
        "none",
        "--enable-metrics",
        # An idle scheduler sleeps instead of busy-polling a core.
        "--sleep-on-idle",
        "--skip-server-warmup",
    ]
    if mode is not None:
        argv += [
            "--disaggregation-mode",
            mode,
            "--disaggregation-transfer-backend",
            "mooncake_tcp",
        ]
    if mode == "prefill":
        assert bootstrap_port is not None
        argv += ["--disaggregation-bootstrap-port", str(bootstrap_port)]
    if mode == "decode":
        # The default backup of retracted requests registers CUDA host memory.
        argv += ["--disaggregation-decode-retraction-backup", "cpu_tensor"]
    return argv


@attrs.define
class SGLangEngine(Engine):
    """An SGLang server. Ready once it lists its model: its HTTP server starts only after the
    scheduler has loaded the model. (Its `/health` runs a one-token generation and answers
    after about a second, which every test's check of the fleet would pay per engine.)"""

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/v1/models", timeout=2) as answer:
                return bool(answer.status == 200)
        except (OSError, urllib.error.URLError):
            return False


@attrs.define
class SGLangFleet(RealFleet):
    """The SGLang part of the tier: ``agg`` and the ``prefill``/``decode`` pair."""

    @property
    def aggregate(self) -> list[Engine]:
        return [self.engines["agg"]]

    @property
    def bootstrap_port(self) -> int:
        argv = self.engines["prefill"].argv
        return int(argv[argv.index("--disaggregation-bootstrap-port") + 1])

    def stop(self) -> None:
        """SIGTERM every engine at once, then reap each (`Engine.stop`): an SGLang server
        drains for up to its 5 s watchdog tick before it exits."""
        for engine in self.engines.values():
            if engine.pid is not None:
                try:
                    os.killpg(engine.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        super().stop()

    @classmethod
    def attach(cls, state: Path) -> SGLangFleet:
        described = json.loads(state.read_text())
        engines: dict[str, Engine] = {
            d["name"]: SGLangEngine.attach(d, state) for d in described["engines"]
        }
        return cls(engines, Path(described["model"]), Path(described["directory"]))

    @classmethod
    def launch(cls, directory: Path, names: Sequence[str] | None = None) -> SGLangFleet:
        model = build_model(directory / "model")
        wanted = set(names or NAMES)
        engines: dict[str, Engine] = {}
        bootstrap = late_port()
        for name in NAMES:
            if name not in wanted:
                continue
            port = late_port()
            mode = None if name == "agg" else name
            engines[name] = SGLangEngine(
                name=name,
                port=port,
                argv=sglang_argv(model, port, mode=mode, bootstrap_port=bootstrap),
                env=sglang_env(pd=mode is not None),
                log=directory / f"sglang-{name}.log",
            )
        fleet = cls(engines, model, directory)
        try:
            for engine in engines.values():
                engine.start()
            fleet.wait_ready()
        except BaseException:
            fleet.stop()
            raise
        return fleet


@contextmanager
def sglang_fleet(
    directory: Path | None = None, *, state: str | None = None
) -> Iterator[SGLangFleet]:
    """The fleet of the state file `state` (default NARWHAL_SGLANG_FLEET), left running,
    or a new one, reaped at the end."""
    state = state or os.environ.get("NARWHAL_SGLANG_FLEET")
    if state:
        fleet = SGLangFleet.attach(Path(state))
        fleet.heal()
        yield fleet
        return
    own = directory or Path(tempfile.mkdtemp(prefix="nw-sglang-"))
    fleet = SGLangFleet.launch(own)
    try:
        yield fleet
    finally:
        fleet.stop()


def _up(args: argparse.Namespace) -> None:
    # Started in the background by a shell, this process would ignore SIGINT: SIGINT and
    # SIGTERM both stop it, and the engines are reaped (while starting too).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    directory = Path(args.dir or tempfile.mkdtemp(prefix="nw-sglang-"))
    directory.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    fleet = SGLangFleet.launch(directory, args.engines)
    Path(args.state).write_text(json.dumps(fleet.describe(), indent=2) + "\n")
    took = time.monotonic() - started
    print(f"SGLang fleet up in {took:.0f} s; state in {args.state}", flush=True)
    for engine in fleet.engines.values():
        print(f"  {engine.name}: {engine.url} pid {engine.pid} log {engine.log}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        SGLangFleet.attach(Path(args.state)).stop()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Run the real-engine tier's SGLang fleet.")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="launch the fleet and keep it up until interrupted")
    up.add_argument("--state", required=True, help="where to write the fleet's state file")
    up.add_argument("--dir", help="folder for the model and the logs")
    up.add_argument("--engines", nargs="*", help=f"a subset of {' '.join(NAMES)}")
    args = parser.parse_args(argv)
    if args.command == "up":
        _up(args)


if __name__ == "__main__":
    main(sys.argv[1:])
