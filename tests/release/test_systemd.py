"""The systemd unit, the example config and the deployment page agree on paths."""

from __future__ import annotations

import configparser
import pathlib
import re
import shlex

from narwhal.config import Config, load_config_file

REPO = pathlib.Path(__file__).resolve().parents[2]


def _service() -> configparser.SectionProxy:
    unit = configparser.ConfigParser(interpolation=None, strict=False)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read(REPO / "conf" / "narwhal.service")
    return unit["Service"]


def _example(service: configparser.SectionProxy) -> tuple[str, Config]:
    """The config file ExecStart names, and conf/narwhal.json: the example it is made from."""
    argv = shlex.split(service["ExecStart"])
    return argv[argv.index("--config") + 1], load_config_file(REPO / "conf" / "narwhal.json")


def test_the_example_configs_socket_is_in_the_units_runtime_directory() -> None:
    service = _service()
    config_path, config = _example(service)
    runtime = pathlib.PurePosixPath("/run", service["RuntimeDirectory"])
    socket = pathlib.PurePosixPath(config.ctl.socket)
    assert socket.is_absolute(), f"ctl.socket {socket} would depend on the working directory"
    assert socket.parent == runtime, f"ctl.socket {socket} is not in {runtime}/"
    # narwhalctl (ExecReload) finds the socket through the same file the daemon reads.
    assert f"narwhalctl --config {config_path} reload" in service["ExecReload"]


def test_every_socket_path_the_unit_names_is_the_example_configs() -> None:
    service = _service()
    _, config = _example(service)
    text = (REPO / "conf" / "narwhal.service").read_text()
    assert set(re.findall(r"/run/[\w./-]+\.sock", text)) == {config.ctl.socket}


def test_the_profile_store_is_where_the_unit_lets_the_daemon_write() -> None:
    service = _service()
    _, config = _example(service)
    assert service["ProtectSystem"] == "strict"  # everything else is read-only
    writable = {
        pathlib.PurePosixPath("/var/lib", service["StateDirectory"]),
        pathlib.PurePosixPath("/run", service["RuntimeDirectory"]),
    }
    store = pathlib.PurePosixPath(config.profiles.path)
    assert store.is_absolute()
    assert store.parent in writable, f"profiles.path {store} is read-only under the unit"


def test_the_deployment_page_names_the_units_paths() -> None:
    service = _service()
    config_path, config = _example(service)
    page = (REPO / "docs" / "deploy-systemd.md").read_text()
    binary = shlex.split(service["ExecStart"])[0]
    for path in (config_path, config.ctl.socket, config.profiles.path, binary):
        assert path in page, path
    assert f"sudo -u {service['User']} {pathlib.PurePosixPath(binary).parent}/narwhalctl" in page
