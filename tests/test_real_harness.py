"""The real-engine tier's `up` command (tests/real/engines.py) stops its engines however
often it is told to stop; without engines: a fake fleet stands in for them."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

_UP_WITH_A_FAKE_FLEET = """
import argparse, sys, time
from pathlib import Path
import tests.real.engines as engines

class FakeFleet:
    engines = {}

    @classmethod
    def launch(cls, directory, names):
        return cls()

    @classmethod
    def attach(cls, state):
        return cls()

    def describe(self):
        return {"engines": []}

    def stop(self):
        print("stopping", flush=True)
        time.sleep(1.0)  # as engines take seconds to go
        Path(sys.argv[1]).write_text("stopped")

engines.RealFleet = FakeFleet
engines._up(argparse.Namespace(dir=sys.argv[2], state=sys.argv[3], engines=None))
"""


def test_a_second_sigterm_does_not_cut_the_fleets_teardown_short(tmp_path: Path) -> None:
    done = tmp_path / "stopped"
    up = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _UP_WITH_A_FAKE_FLEET,
            str(done),
            str(tmp_path),
            str(tmp_path / "s"),
        ],
        cwd=Path(__file__).resolve().parents[1],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert up.stdout is not None
        assert up.stdout.readline().startswith("fleet up")
        up.send_signal(signal.SIGTERM)
        assert up.stdout.readline() == "stopping\n"
        up.send_signal(signal.SIGTERM)  # as a `timeout` wrapper forwards one more
        assert up.wait(timeout=30) == 0
    finally:
        up.kill()
        up.communicate()
    assert done.read_text() == "stopped"
