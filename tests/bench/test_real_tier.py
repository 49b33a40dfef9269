from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import real_tier


def test_the_sampler_finds_processes_started_from_a_venv_and_sums_their_pss() -> None:
    # A child started from this interpreter's venv is found by its program's path;
    # processes started from elsewhere are not.
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(30)"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
    )
    try:
        # Popen returns once exec has begun, before the kernel has set the new program's
        # arguments: CI's loaded box once read an empty cmdline there. Running, it has them.
        assert child.stdout is not None
        assert child.stdout.readline() == b"up\n"
        found = real_tier.started_from([Path(sys.prefix)])
        assert child.pid in found
        assert real_tier.started_from([Path("/nonexistent-venv")]) == []
        assert real_tier.pss_bytes(child.pid) > 1_000_000  # an interpreter is megabytes
    finally:
        child.kill()
        child.communicate()
    assert real_tier.pss_bytes(child.pid) == 0  # gone: nothing, not an error


def test_the_summary_is_pytests_last_line(tmp_path: Path) -> None:
    log = tmp_path / "pytest.log"
    log.write_text("....F\nFAILED tests/real/x.py::t - boom\n2 failed, 73 passed in 813.31s\n\n")
    assert real_tier.summary_line(log) == "2 failed, 73 passed in 813.31s"
    log.write_text("")
    assert real_tier.summary_line(log) == ""


def test_the_default_venvs_are_the_tiers_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NARWHAL_VLLM_VENV", raising=False)
    assert real_tier.default_venv("vllm").name == "vllm-venv"
    monkeypatch.setenv("NARWHAL_VLLM_VENV", "/somewhere/else")
    assert real_tier.default_venv("vllm") == Path("/somewhere/else")


def test_test_time_is_split_between_the_vllm_and_sglang_tiers(tmp_path: Path) -> None:
    log = tmp_path / "pytest.log"
    log.write_text(
        "============ slowest durations ============\n"
        "61.13s setup    tests/real/sglang/test_conformance.py::test_x\n"
        "45.24s setup    tests/real/test_conformance.py::test_y\n"
        "2.50s call     tests/real/test_vllm_ops.py::test_z\n"
        "1.00s call     tests/real/sglang/test_ops.py::test_w\n"
        "75 passed in 734.05s (0:12:14)\n"
    )
    assert real_tier.by_engine(log) == {"vllm": 47.7, "sglang": 62.1}
