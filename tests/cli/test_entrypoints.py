import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    ("module", "argv", "message"),
    [
        ("narwhal.cli.ctl", [], "narwhalctl: not implemented yet"),
    ],
)
def test_unbuilt_commands_say_so_and_exit_2(module: str, argv: list[str], message: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", module, *argv], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 2
    assert message in proc.stderr
