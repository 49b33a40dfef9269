from __future__ import annotations

import loadgen
import memory
import pytest

STATUS = """Name:\tpython
State:\tS (sleeping)
VmPeak:\t  300000 kB
VmHWM:\t   81234 kB
VmRSS:\t   70000 kB
Threads:\t4
"""


def test_parse_status_reads_rss_and_high_water_mark() -> None:
    assert memory.parse_status(STATUS) == (70000, 81234)


def test_parse_status_without_memory_lines() -> None:
    with pytest.raises(ValueError, match=r"no VmRSS/VmHWM"):
        memory.parse_status("Name:\tkthreadd\nState:\tS\n")


def _s(t: float, phase: str, rss: int, retained: int | None, hwm: int = 0) -> memory.Sample:
    return memory.Sample(t, phase, rss, hwm or rss, retained, 0)


def test_flood_summary() -> None:
    samples = [
        _s(0.0, "idle_before", 50 * 1024, None),
        _s(0.1, "idle_before", 52 * 1024, 0),
        _s(0.2, "flood", 60 * 1024, 300),
        _s(0.3, "flood", 70 * 1024, 512),
        _s(0.4, "drain", 65 * 1024, 100, hwm=71 * 1024),
        _s(0.5, "idle_after", 55 * 1024, 0),
        _s(0.6, "idle_after", 57 * 1024, 0),
    ]
    out = memory.flood_summary(samples, ceiling=512)
    assert out["rss_idle_before_mib"] == 51.0
    assert out["rss_peak_mib"] == 70.0
    assert out["hwm_mib"] == 71.0
    assert out["rss_after_drain_mib"] == 56.0
    assert out["rss_growth_after_vs_before_mib"] == 5.0
    assert out["max_retained"] == 512
    assert out["retained_at_rss_peak"] == 512
    assert out["kib_per_retained_request"] == pytest.approx(19 * 1024 / 512, abs=0.1)
    series = memory.series(samples)
    assert series["rss_mib"][3] == 70.0
    assert series["retained"][0] is None


def test_flood_summary_of_nothing() -> None:
    out = memory.flood_summary([], ceiling=512)
    assert out["rss_peak_mib"] is None
    assert out["max_retained"] == 0
    assert out["kib_per_retained_request"] is None


@pytest.mark.parametrize(
    ("status", "body", "outcome"),
    [
        (200, b'{"choices": []}', "ok"),
        (429, b'{"error": {"code": "retained_ceiling", "message": "m"}}', "429 retained_ceiling"),
        (429, b'{"error": {"code": "queue_timeout"}}', "429 queue_timeout"),
        (502, b"<html>", "502 unparsed"),
        (503, b'{"error": {"code": null}}', "503 none"),
    ],
)
def test_flood_outcomes_name_the_error_code(status: int, body: bytes, outcome: str) -> None:
    assert loadgen.outcome_of(status, body) == outcome


def test_a_later_round_starts_from_the_previous_idle() -> None:
    assert memory.phase_names(1) == ("idle_before", "flood", "drain", "idle_after")
    assert memory.phase_names(2) == ("idle_after", "flood_2", "drain_2", "idle_after_2")
    assert memory.phase_names(3)[0] == "idle_after_2"
    samples = [
        _s(0.0, "idle_before", 50 * 1024, 0),
        _s(0.1, "flood", 80 * 1024, 512),
        _s(0.2, "idle_after", 80 * 1024, 0),
        _s(0.3, "flood_2", 82 * 1024, 512),
        _s(0.4, "drain_2", 81 * 1024, 10),
        _s(0.5, "idle_after_2", 81 * 1024, 0),
    ]
    second = memory.flood_summary(samples, ceiling=512, round_=2)
    assert second["rss_idle_before_mib"] == 80.0
    assert second["rss_peak_mib"] == 82.0
    assert second["rss_after_drain_mib"] == 81.0
    assert second["rss_growth_after_vs_before_mib"] == 1.0
