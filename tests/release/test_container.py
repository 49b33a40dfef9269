"""The container image definition: non-root, slim, config at /etc/narwhal, a working health check.

No container runtime runs in CI, so the Dockerfile is checked as text here and with hadolint
by hand; its health check script is run for real against a local HTTP server.
"""

from __future__ import annotations

import http.server
import json
import pathlib
import subprocess
import sys
import threading
import tomllib
from collections.abc import Iterator

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
DOCKERFILE = (REPO / "Dockerfile").read_text()
HEALTHCHECK = REPO / "conf" / "container" / "healthcheck.py"


def _instructions(name: str) -> list[str]:
    text = DOCKERFILE.replace("\\\n", " ")
    return [line.split(None, 1)[1] for line in text.splitlines() if line.startswith(name + " ")]


def test_the_image_is_slim_non_root_and_reads_etc_narwhal() -> None:
    assert all(base.split()[0].endswith("-slim") for base in _instructions("FROM"))
    user = _instructions("USER")[-1]
    assert user.split(":")[0] not in {"0", "root"}
    assert _instructions("CMD")[-1] == '["serve", "--config", "/etc/narwhal/narwhal.json"]'
    assert _instructions("HEALTHCHECK")
    for source in (s.split()[0] for s in _instructions("COPY") if "--from" not in s):
        assert (REPO / source).exists(), source
    # Every optional feature of the daemon works in the image: engine.tokenizer_path
    # needs the tokenizer extra, and the image has nothing else to install it with.
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    (install,) = [run for run in _instructions("RUN") if "pip install" in run]
    assert "'.[tokenizer]'" in install
    assert "tokenizer" in extras


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        body = json.dumps({"status": "ok" if self.status == 200 else "unavailable"}).encode()
        self.send_response(self.status if self.path == "/health" else 404)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass


@pytest.fixture
def server() -> Iterator[http.server.HTTPServer]:
    httpd = http.server.HTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def _check(tmp_path: pathlib.Path, listen: dict[str, object]) -> int:
    config = tmp_path / "narwhal.json"
    config.write_text(json.dumps({"engines": [], "listen": listen}))
    proc = subprocess.run(
        [sys.executable, str(HEALTHCHECK)],
        env={"NARWHAL_CONFIG": str(config)},
        capture_output=True,
        timeout=30,
        check=False,
    )
    return proc.returncode


def test_healthy_is_exit_0_on_the_client_port_even_bound_to_the_wildcard(
    tmp_path: pathlib.Path, server: http.server.HTTPServer
) -> None:
    port = server.server_address[1]
    assert _check(tmp_path, {"host": "0.0.0.0", "port": port}) == 0
    assert _check(tmp_path, {"host": "127.0.0.1", "port": port}) == 0


def test_degraded_or_down_is_exit_1(
    tmp_path: pathlib.Path, server: http.server.HTTPServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = server.server_address[1]
    monkeypatch.setattr(_Health, "status", 503)
    assert _check(tmp_path, {"host": "0.0.0.0", "port": port}) == 1
    server.shutdown()
    server.server_close()
    assert _check(tmp_path, {"host": "127.0.0.1", "port": port}) == 1
