"""Real vLLM engines for the real-engine tier: launch, wait, kill, restart, reap.

The engines run from their own venv (`tools/engines/vllm-venv.sh`, default
`~/.cache/narwhal/vllm-venv`, or `NARWHAL_VLLM_VENV`), on free loopback ports, serving the tiny random-weight model that
`tools/engines/tiny_model.py` builds at test time. The fleet is:

- ``agg0``, ``agg1``: aggregate engines, no KV connector (``agg1`` publishes its KV cache
  events on a PUB it binds, with a replay socket, and reports the prompt tokens it found
  cached in its answers' usage, `--enable-prompt-tokens-details`);
- ``prefill``, ``decode``: one NixlConnector P/D pair (`kv_buffer_device: cpu`, each with
  its own side-channel port).

A developer can keep one fleet up between test runs and point the tier at it:

    .venv/bin/python -m tests.real.engines up --state /tmp/real-fleet.json
    NARWHAL_REAL_FLEET=/tmp/real-fleet.json bash tools/test.sh tests/real

The state file names each engine's url, pid, argv and log, so tests that kill an engine can
relaunch it the same way; an engine attached from a state file writes its new pid back to
that file whenever it is started again (`Engine.restart`), so the file stays valid for the
next run and for `up`'s own reaping.
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
from typing import Any

import attrs

from narwhal.engines._dialects import vllm_decode_body, vllm_prefill_body

# The benchmarks' package reads /proc for them and for us; they import it top-level.
_BENCH = str(Path(__file__).resolve().parents[2] / "tools" / "bench")
if _BENCH not in sys.path:
    sys.path.insert(0, _BENCH)
from benchkit import descendants  # noqa: E402

from ..support import late_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MODEL_NAME = "tiny-llama"
CONTEXT = 2048
# Start-up is 35-60 s per engine on a quiet box and ~100 s when four start at once on
# two cores; the bound is for a box loaded by the rest of the suite as well.
READY_WITHIN_S = 480.0
NIXL = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}


class EngineSetupError(RuntimeError):
    """The engines' venv is missing or broken, or an engine did not come up."""


def venv() -> Path:
    """Where tools/engines/vllm-venv.sh puts the engines' venv (the same default)."""
    if "NARWHAL_VLLM_VENV" in os.environ:
        return Path(os.environ["NARWHAL_VLLM_VENV"])
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "narwhal" / "vllm-venv"


def engine_python() -> Path:
    python = venv() / "bin" / "python"
    if not python.exists():
        raise EngineSetupError(
            f"no engine venv at {venv()}: run `bash tools/engines/vllm-venv.sh` "
            "(the README's test command does)"
        )
    return python


def build_model(out: Path) -> Path:
    """The tiny model, built with the engines' own Python (it has torch and transformers)."""
    result = subprocess.run(
        [str(engine_python()), str(ROOT / "tools" / "engines" / "tiny_model.py"), str(out)],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    if result.returncode != 0:
        raise EngineSetupError(f"building the tiny model failed:\n{result.stderr[-4000:]}")
    return out


@attrs.define
class Engine:
    """One vLLM API server process (and its engine core child)."""

    name: str
    port: int
    argv: list[str]
    env: dict[str, str]
    log: Path
    process: subprocess.Popen[bytes] | None = None
    pid: int | None = None
    # The fleet's state file when attached from one: a restart records its new pid there.
    state: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        with self.log.open("ab") as out:
            out.write(f"\n=== start {time.strftime('%H:%M:%S')} {' '.join(self.argv)}\n".encode())
            out.flush()
            self.process = subprocess.Popen(
                self.argv,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.pid = self.process.pid
        if self.state is not None:
            record_pid(self.state, self.name, self.pid)

    def alive(self) -> bool:
        if self.process is not None:
            return self.process.poll() is None
        if self.pid is None:
            return False
        try:
            stat = Path(f"/proc/{self.pid}/stat").read_text()
        except OSError:
            return False
        # An attached engine is another process's child (`up`'s): once dead it stays a
        # zombie until that process reaps it, and a signal 0 to a zombie succeeds.
        return stat.rsplit(")", 1)[-1].split()[0] != "Z"

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as answer:
                return bool(answer.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def wait_ready(self, within_s: float = READY_WITHIN_S) -> None:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise EngineSetupError(f"engine {self.name} exited:\n{self.tail()}")
            if self.healthy():
                return
            time.sleep(0.5)
        raise EngineSetupError(f"engine {self.name} not healthy in {within_s} s:\n{self.tail()}")

    def children(self) -> list[int]:
        """Pids of the API server's descendants (the engine core is one of them)."""
        if self.pid is None:
            return []
        return descendants(self.pid)

    def model_pids(self) -> list[int]:
        """The EngineCore and its descendants: vLLM 0.32 runs the model in a
        `VLLM::Worker` child of the core."""
        core = self.engine_core_pid()
        return [core, *descendants(core)]

    def engine_core_pid(self) -> int:
        """The EngineCore process (vLLM v1 runs the model outside the API server)."""
        for pid in self.children():
            try:
                name = Path(f"/proc/{pid}/comm").read_text().strip()
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            if "EngineCore" in name or b"EngineCore" in cmdline:
                return pid
        raise EngineSetupError(f"engine {self.name}: no EngineCore among {self.children()}")

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the whole process group, then SIGKILL what is left."""
        if self.pid is None:
            return
        try:
            os.killpg(self.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + grace_s
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self.process is not None:
            self.process.wait(timeout=grace_s)
        self.process = None

    def restart(self) -> None:
        self.stop()
        self.start()
        self.wait_ready()

    def tail(self, lines: int = 60) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return f"(no log at {self.log})"
        return "\n".join(text.splitlines()[-lines:])

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as answer:
            return str(answer.read().decode())

    def log_size(self) -> int:
        try:
            return self.log.stat().st_size
        except OSError:
            return 0

    def log_since(self, offset: int, lines: int = 80) -> str:
        """The last `lines` lines the engine logged after byte `offset` of its log."""
        try:
            with self.log.open("rb") as log:
                log.seek(offset)
                text = log.read().decode(errors="replace")
        except OSError:
            return f"(no log at {self.log})"
        return "\n".join(text.splitlines()[-lines:])

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "port": self.port,
            "pid": self.pid,
            "argv": self.argv,
            "env": self.env,
            "log": str(self.log),
        }

    @classmethod
    def attach(cls, described: dict[str, Any], state: Path | None = None) -> Engine:
        return cls(
            name=described["name"],
            port=described["port"],
            argv=list(described["argv"]),
            env=dict(described["env"]),
            log=Path(described["log"]),
            pid=described["pid"],
            state=state,
        )


def post(url: str, body: dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:
            document: dict[str, Any] = json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        raise EngineSetupError(f"{url}: HTTP {exc.code}: {exc.read()[:2000]!r}") from None
    except OSError as exc:
        raise EngineSetupError(f"{url}: {exc}") from None
    return document


# Tries of the pair's first handoff (see warm_pair).
WARM_ATTEMPTS = 3


def warm_pair(prefill: Engine, decode: Engine, *, timeout_s: float = READY_WITHIN_S) -> None:
    """One handoff from `prefill` to `decode`, as Narwhal's two legs make it.

    NIXL connects a pair at its first handoff (a handshake over the side channel, then
    UCX); on a loaded 2-core box that has taken minutes. Paying it here keeps it out of
    the first test's deadlines, and a pair that cannot hand off fails the session
    saying so, with both logs. The handshake itself may fail once (the decode side's
    ZMQ request to the prefill's side channel answered `Resource temporarily
    unavailable`, and vLLM fails that request with a KV load failure): the handoff is
    made again, up to `WARM_ATTEMPTS` times, each with a new prompt."""
    failures: list[str] = []
    for attempt in range(WARM_ATTEMPTS):
        body = {
            "model": MODEL_NAME,
            "prompt": f"def warm_{attempt}():\n    return 1\n",
            "max_tokens": 1,
        }
        try:
            first = post(
                f"{prefill.url}/v1/completions", vllm_prefill_body(body), timeout_s=timeout_s
            )
            params = first.get("kv_transfer_params")
            if not params:
                raise EngineSetupError(f"the prefill leg gave no kv_transfer_params: {first}")
            post(
                f"{decode.url}/v1/completions",
                vllm_decode_body(body, params),
                timeout_s=timeout_s,
            )
            return
        except EngineSetupError as exc:
            failures.append(str(exc))
            time.sleep(2.0)
    raise EngineSetupError(
        f"the pair's first handoff failed {WARM_ATTEMPTS} times: {failures}"
        f"\n--- {prefill.name}:\n{prefill.tail(30)}\n--- {decode.name}:\n{decode.tail(30)}"
    )


def record_pid(state: Path, name: str, pid: int) -> None:
    """Write engine `name`'s new pid into the fleet's state file (atomically)."""
    described = json.loads(state.read_text())
    for entry in described["engines"]:
        if entry["name"] == name:
            entry["pid"] = pid
    fresh = state.with_name(f".{state.name}.{os.getpid()}")
    fresh.write_text(json.dumps(described, indent=2) + "\n")
    fresh.replace(state)


def sample(metrics: str, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`, in Prometheus text.

    Raises KeyError when no sample matches: a metric the engine does not export is a
    finding, not a zero."""
    total = 0.0
    found = False
    for line in metrics.splitlines():
        if not line.startswith(name) or line[len(name) : len(name) + 1] not in ("{", " "):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{key}="{want}"' in head for key, want in labels.items()):
            total += float(value)
            found = True
    if not found:
        raise KeyError(f"no sample of {name} with {labels} in the engine's /metrics")
    return total


def engine_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "NARWHAL_", "PYTEST"))}
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    env.update(extra or {})
    return env


def engine_argv(
    model: Path,
    port: int,
    *,
    kv: dict[str, Any] | None = None,
    kv_events: dict[str, Any] | None = None,
) -> list[str]:
    # NIXL's progress thread polls a core even when the engine is idle (UCX backend, no
    # setting reaches it through vLLM's NixlConnector): a connector engine runs niced, so
    # its polling yields to the test process and the other engines on a two-core box.
    argv = ["nice", "-n", "15"] if kv is not None else []
    argv += [
        str(engine_python()),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        MODEL_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        str(CONTEXT),
        "--max-num-seqs",
        "16",
        # No torch.compile: it took 15-18 s of each start (and every restart recompiles:
        # vLLM 0.32's AOT cache fails to load on CPU); the tiny model gains nothing by it.
        "--enforce-eager",
    ]
    if kv is not None:
        argv += ["--kv-transfer-config", json.dumps(kv)]
    if kv_events is not None:
        # The cache-aware engine also says what it found cached, which Narwhal logs
        # beside its own estimate (tests/real/test_vllm_cache_index.py).
        argv += ["--kv-events-config", json.dumps(kv_events), "--enable-prompt-tokens-details"]
    return argv


def kv_events_config(engine: Engine) -> dict[str, Any] | None:
    """The engine's --kv-events-config, when it publishes KV cache events."""
    if "--kv-events-config" not in engine.argv:
        return None
    config: dict[str, Any] = json.loads(engine.argv[engine.argv.index("--kv-events-config") + 1])
    return config


@attrs.define
class RealFleet:
    """The tier's four engines, by name."""

    engines: dict[str, Engine]
    model: Path
    directory: Path

    def __getitem__(self, name: str) -> Engine:
        return self.engines[name]

    @property
    def aggregate(self) -> list[Engine]:
        return [self.engines["agg0"], self.engines["agg1"]]

    @property
    def pair(self) -> tuple[Engine, Engine]:
        return self.engines["prefill"], self.engines["decode"]

    def wait_ready(self) -> None:
        for engine in self.engines.values():
            if not engine.healthy():
                engine.wait_ready()

    def heal(self) -> list[str]:
        """Wait for every engine to be healthy, relaunching each that is gone or going
        (a test killed it and failed before its own restart); the names relaunched."""
        relaunched = []
        for engine in self.engines.values():
            if engine.healthy():
                continue
            try:
                engine.wait_ready()
            except EngineSetupError:
                if engine.alive():
                    raise  # up but never healthy: a real failure, not a leftover
                engine.restart()
                relaunched.append(engine.name)
        return relaunched

    def stop(self) -> None:
        for engine in self.engines.values():
            engine.stop()

    def describe(self) -> dict[str, Any]:
        return {
            "model": str(self.model),
            "directory": str(self.directory),
            "engines": [e.describe() for e in self.engines.values()],
        }

    @classmethod
    def attach(cls, state: Path) -> RealFleet:
        described = json.loads(state.read_text())
        engines = {d["name"]: Engine.attach(d, state) for d in described["engines"]}
        return cls(engines, Path(described["model"]), Path(described["directory"]))

    @classmethod
    def launch(cls, directory: Path, names: Sequence[str] | None = None) -> RealFleet:
        model = build_model(directory / "model")
        wanted = set(names or ("agg0", "agg1", "prefill", "decode"))
        engines: dict[str, Engine] = {}
        for name in ("agg0", "agg1", "prefill", "decode"):
            if name not in wanted:
                continue
            port = late_port()
            extra: dict[str, str] = {}
            kv = None
            kv_events = None
            if name == "agg1":
                # Its KV cache events: a PUB it binds (vLLM's default form; Narwhal connects
                # to it at the engine's host) and a replay socket on loopback
                # (tests/real/test_vllm_prefix_cache.py, test_vllm_cache_index.py).
                kv_events = {
                    "enable_kv_cache_events": True,
                    "publisher": "zmq",
                    "endpoint": f"tcp://*:{late_port()}",
                    "replay_endpoint": f"tcp://127.0.0.1:{late_port()}",
                    "topic": "kv",
                }
            if name in ("prefill", "decode"):
                kv = NIXL
                extra["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(late_port())
                extra["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
            engines[name] = Engine(
                name=name,
                port=port,
                argv=engine_argv(model, port, kv=kv, kv_events=kv_events),
                env=engine_env(extra),
                log=directory / f"{name}.log",
            )
        fleet = cls(engines, model, directory)
        try:
            for engine in engines.values():
                engine.start()
            fleet.wait_ready()
            if "prefill" in engines and "decode" in engines:
                # Both ways: NIXL connects each direction apart, and the sweep of
                # narwhal-profile, the role flips and the connector probes hand off
                # decode -> prefill too (that first handshake took 60 s in one CI run).
                warm_pair(engines["prefill"], engines["decode"])
                warm_pair(engines["decode"], engines["prefill"])
        except BaseException:
            fleet.stop()
            raise
        return fleet


@contextmanager
def real_fleet(
    directory: Path | None = None,
    names: Sequence[str] | None = None,
    *,
    state: str | None = None,
) -> Iterator[RealFleet]:
    """The fleet of the state file `state` (default NARWHAL_REAL_FLEET), left running, or
    a new one of `names` (default all four), reaped at the end."""
    state = state or os.environ.get("NARWHAL_REAL_FLEET")
    if state:
        fleet = RealFleet.attach(Path(state))
        fleet.heal()
        yield fleet
        return
    own = directory or Path(tempfile.mkdtemp(prefix="nw-real-"))
    fleet = RealFleet.launch(own, names)
    try:
        yield fleet
    finally:
        fleet.stop()


def _up(args: argparse.Namespace) -> None:
    # SIGTERM (a plain `kill`) reaps the fleet like Ctrl-C; it used to end `up` alone and
    # leave its engines running.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    directory = Path(args.dir or tempfile.mkdtemp(prefix="nw-real-"))
    directory.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    fleet = RealFleet.launch(directory, args.engines)
    Path(args.state).write_text(json.dumps(fleet.describe(), indent=2) + "\n")
    took = time.monotonic() - started
    print(f"fleet up in {took:.0f} s; state in {args.state}", flush=True)
    for engine in fleet.engines.values():
        print(f"  {engine.name}: {engine.url} pid {engine.pid} log {engine.log}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        # Nothing cuts the teardown short: a second SIGTERM came when `pkill -f` matched
        # a `timeout` wrapper of this command too, and left the engines running.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        RealFleet.attach(Path(args.state)).stop()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Run the real-engine tier's vLLM fleet.")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="launch the fleet and keep it up until interrupted")
    up.add_argument("--state", required=True, help="where to write the fleet's state file")
    up.add_argument("--dir", help="folder for the model and the logs")
    up.add_argument("--engines", nargs="*", help="a subset of agg0 agg1 prefill decode")
    args = parser.parse_args(argv)
    if args.command == "up":
        _up(args)


if __name__ == "__main__":
    main(sys.argv[1:])
