"""Health verdicts, residual windows, restart detection and metrics parsing (pure)."""

from __future__ import annotations

import pytest

from narwhal._records import to_json
from narwhal.config import Health
from narwhal.recovery import (
    HealthTracker,
    IdentityTracker,
    ResidualWindow,
    RestartHold,
    ScrapeError,
    Verdict,
    parse_load,
)

CFG = Health(
    failure_threshold=3, readmit_successes=2, window_s=10.0, min_samples=3, eject_ratio=2.0
)


def test_consecutive_failures_eject_and_a_success_resets_the_streak() -> None:
    health = HealthTracker()
    assert health.probe_failed(CFG, "HTTP 503") is None
    assert health.probe_failed(CFG, "HTTP 503") is None
    health.probe_ok(CFG)
    assert health.probe_failed(CFG, "HTTP 503") is None
    assert health.probe_failed(CFG, "HTTP 503") is None
    change = health.probe_failed(CFG, "GET /health returned HTTP 503")
    assert change is not None
    assert (change.old, change.new) == (Verdict.UP, Verdict.EJECTED)
    assert change.reason == (
        "3 consecutive failed health probes (recovery.health.failure_threshold=3): "
        "GET /health returned HTTP 503"
    )
    assert health.ejected_reason == change.reason


def test_readmission_needs_good_probes_then_verification() -> None:
    health = HealthTracker()
    health.eject("failed its first probe (startup): connection refused")
    assert health.probe_ok(CFG) is None
    change = health.probe_ok(CFG)
    assert change is not None
    assert change.new is Verdict.VERIFYING
    assert health.ejected_reason is not None  # still out of placement while verifying
    change = health.verify_ok("prefill on p0, decode on d0 completed")
    assert change is not None
    assert change.new is Verdict.UP
    assert health.ejected_reason is None


def test_one_good_probe_verifies_when_no_other_engine_takes_the_work() -> None:
    health = HealthTracker()
    health.eject("x")
    alone = "no other engine in placement takes decode work"
    change = health.probe_ok(CFG, alone)
    assert change is not None
    assert (change.old, change.new) == (Verdict.EJECTED, Verdict.VERIFYING)
    assert change.reason == (
        "1 good probe of recovery.health.readmit_successes=2, enough while no other engine "
        "in placement takes decode work; verifying before readmission"
    )
    assert health.snapshot().readmit_shortcuts_total == 1
    # A failed verification ejects it again; the next readmission is judged afresh.
    health.verify_failed("decode leg on d0 returned HTTP 500")
    assert health.probe_ok(CFG) is None
    assert health.probe_ok(CFG) is not None  # the full streak: no shortcut counted
    assert health.shortcuts_total == 1


def test_no_shortcut_is_counted_when_one_good_probe_is_the_setting() -> None:
    health = HealthTracker()
    health.eject("x")
    one = Health(readmit_successes=1)
    change = health.probe_ok(one, "no other engine in placement takes decode work")
    assert change is not None
    assert change.reason == (
        "1 good probe (recovery.health.readmit_successes=1); verifying before readmission"
    )
    assert health.shortcuts_total == 0


def test_a_failed_probe_or_verification_restarts_readmission() -> None:
    health = HealthTracker()
    health.eject("x")
    health.probe_ok(CFG)
    health.probe_failed(CFG, "HTTP 503")  # good streak broken
    assert health.probe_ok(CFG) is None
    assert health.probe_ok(CFG) is not None
    change = health.probe_failed(CFG, "HTTP 503")
    assert change is not None
    assert change.new is Verdict.EJECTED
    health.probe_ok(CFG)
    health.probe_ok(CFG)
    change = health.verify_failed("decode leg on d0 returned HTTP 500")
    assert change is not None
    assert change.new is Verdict.EJECTED
    assert health.good_probes == 0


def test_residual_window_ejects_on_the_median_after_min_samples() -> None:
    window = ResidualWindow()
    window.add(0.0, 10.0, CFG.window_s)
    window.add(1.0, 10.0, CFG.window_s)
    assert window.verdict(1.0, CFG) is None  # 2 < min_samples
    window.add(2.0, 1.0, CFG.window_s)
    reason = window.verdict(2.0, CFG)
    assert reason is not None
    assert reason.startswith("latency: median observed/predicted ratio 10.00 over 3 residuals")


def test_residual_window_median_ignores_one_outlier_and_old_samples_leave() -> None:
    window = ResidualWindow()
    for t, ratio in [(0.0, 50.0), (1.0, 1.0), (2.0, 1.1)]:
        window.add(t, ratio, CFG.window_s)
    assert window.verdict(2.0, CFG) is None
    window.add(20.0, 9.0, CFG.window_s)
    assert len(window) == 1  # the rest fell out of recovery.health.window_s


def test_identity_change_and_coming_back_are_restarts() -> None:
    tracker = IdentityTracker()
    first = (("instance_id", "a"), ("version", "0.11"))
    assert tracker.observe(True, first) is None
    assert tracker.observe(True, first) is None
    assert tracker.observe(None, None) is None  # a timeout tells nothing
    assert tracker.observe(True, (("instance_id", "b"), ("version", "0.11"))) == (
        "identity changed (instance_id a -> b)"
    )
    assert tracker.observe(False, None) is None
    assert tracker.observe(False, None) is None
    assert tracker.observe(True, None) == "answered again after being unreachable"
    assert tracker.observe(True, None) is None


def test_coming_back_as_the_same_instance_is_no_restart() -> None:
    # Its listener closed and its connections dropped, but /version names the process
    # that answered before: its KV and warm-up state are still there.
    tracker = IdentityTracker()
    first = (("instance_id", "a"), ("version", "0.11"))
    assert tracker.observe(True, first) is None
    assert tracker.observe(False, None) is None
    assert tracker.observe(True, first) is None
    assert tracker.snapshot().unreachable is False
    # Without an instance id (stock engines name only their version), or without an
    # answer on /version, coming back is all there is to go by.
    assert tracker.observe(False, None) is None
    assert tracker.observe(True, None) == "answered again after being unreachable"
    stock = IdentityTracker()
    assert stock.observe(True, (("version", "0.11"),)) is None
    assert stock.observe(False, None) is None
    assert stock.observe(True, (("version", "0.11"),)) == "answered again after being unreachable"
    # Another instance id is a restart whichever signal names it.
    assert tracker.observe(False, None) is None
    assert tracker.observe(True, (("instance_id", "b"), ("version", "0.11"))) == (
        "answered again after being unreachable"
    )


def test_a_new_process_start_time_is_a_restart() -> None:
    tracker = IdentityTracker()
    assert tracker.observe_metrics(None, None) is None  # not reported: no evidence
    assert tracker.observe_metrics(1700000000.25, None) is None  # the first one seen
    assert tracker.observe_metrics(1700000000.25, None) is None
    assert tracker.observe_metrics(None, None) is None  # a page without it changes nothing
    assert tracker.observe_metrics(1700000042.5, None) == (
        "process_start_time_seconds changed (1700000000.25 -> 1700000042.5)"
    )
    assert tracker.observe_metrics(1700000042.5, None) is None
    # A restart seen another way: the next value is the new process's, not a second one.
    tracker.new_instance()
    assert tracker.snapshot().process_start_time_seconds is None
    assert tracker.observe_metrics(1700000099.0, None) is None
    assert tracker.snapshot().process_start_time_seconds == 1700000099.0


def test_a_prompt_token_counter_going_backwards_is_a_restart() -> None:
    # SGLang and multi-API-server vLLM have no process metrics; their counters reset.
    tracker = IdentityTracker()
    r0, r1 = '{engine="0"}', '{engine="1"}'
    assert tracker.observe_metrics(None, [(r0, 500.0), (r1, 700.0)]) is None
    assert tracker.observe_metrics(None, [(r0, 900.0), (r1, 700.0)]) is None
    assert tracker.observe_metrics(None, None) is None  # not on this page: no evidence
    # A rank's series that disappears (or appears) is not a reset; the others still count.
    assert tracker.observe_metrics(None, [(r0, 950.0)]) is None
    assert tracker.observe_metrics(None, [(r0, 950.0), (r1, 10.0)]) is None
    assert tracker.observe_metrics(None, [(r0, 12.0), (r1, 10.0)]) == (
        'prompt_tokens_total{engine="0"} went backwards (950 -> 12)'
    )
    assert tracker.snapshot().prompt_tokens_total == 22.0
    # With both signals, the start time names the restart.
    assert tracker.observe_metrics(5.0, [(r0, 40.0)]) is None
    assert tracker.observe_metrics(6.0, [(r0, 0.0)]) == (
        "process_start_time_seconds changed (5.0 -> 6.0)"
    )


def test_load_gauges_gone_missing_are_a_restart() -> None:
    # SGLang 0.5.23: a fresh process has no load gauges (nor counter series) until its
    # scheduler reports, and keeps them once it has.
    tracker = IdentityTracker()
    assert tracker.observe_metrics(None, None, gauges_pending=True) is None  # fresh
    assert tracker.observe_metrics(None, [("", 40.0)]) is None
    assert tracker.observe_metrics(None, None, gauges_pending=True) == (
        "its load gauges went missing (a fresh process publishes them only once its scheduler "
        "has reported)"
    )
    assert tracker.observe_metrics(None, None, gauges_pending=True) is None  # still fresh
    assert tracker.observe_metrics(None, None) is None
    # A restart seen another way: the new process's missing gauges are not a second one.
    tracker.new_instance()
    assert tracker.observe_metrics(None, None, gauges_pending=True) is None


def test_after_a_detected_restart_every_signal_starts_from_the_new_instance() -> None:
    tracker = IdentityTracker()
    old = (("instance_id", "a"),)
    assert tracker.observe(True, old) is None
    assert tracker.observe_metrics(1000.0, [("", 5000.0)]) is None
    assert tracker.observe(False, None) is None  # the probe saw it down...
    assert tracker.observe_metrics(1003.0, None) is not None  # ...the monitor saw it back
    tracker.new_instance()
    # The probe's view of the old instance (down, id a) is not a second restart.
    assert tracker.observe(True, (("instance_id", "b"),)) is None
    assert tracker.identity == (("instance_id", "b"),)
    assert tracker.observe_metrics(None, [("", 3.0)]) is None  # the new counter's baseline
    assert tracker.observe_metrics(1003.0, None) is None
    # A later restart is seen again.
    assert tracker.observe(True, (("instance_id", "c"),)) == "identity changed (instance_id b -> c)"


def test_restart_hold_restarts_its_clock_on_a_second_restart() -> None:
    hold = RestartHold()
    assert hold.start(10.0, "x", 5.0)
    assert hold.verify_after == 15.0
    assert not hold.start(12.0, "y", 5.0)
    assert hold.verify_after == 17.0
    assert hold.clear()
    assert not hold.clear()


def test_a_cut_hold_verifies_at_once_and_a_new_restart_waits_again() -> None:
    hold = RestartHold()
    hold.start(10.0, "x", 5.0)
    assert hold.waiting(11.0)
    hold.cut(11.0, "cut short")
    assert (hold.waiting(11.0), hold.active, hold.verify_after) == (False, True, 11.0)
    assert hold.snapshot(11.0).cut_short == "cut short"
    hold.start(12.0, "y", 5.0)  # a second restart restarts the clock, uncut
    assert (hold.waiting(12.0), hold.cut_reason, hold.cuts_total) == (True, None, 1)
    hold.cut(12.0, "cut short again")
    assert hold.clear()
    assert to_json(hold.snapshot(12.0)) == {
        "active": False,
        "reason": None,
        "verify_in_s": None,
        "cut_short": None,
        "holds_total": 1,
        "cut_short_total": 2,
    }


def test_notes_go_into_the_reason_of_the_change_to_verifying() -> None:
    health = HealthTracker()
    health.eject("x")
    change = health.probe_ok(Health(readmit_successes=1), "alone", notes=["slow", "backoff"])
    assert change is not None
    assert change.reason == (
        "1 good probe (recovery.health.readmit_successes=1); slow; backoff; verifying before "
        "readmission"
    )


VLLM_METRICS = b"""# HELP vllm:num_requests_running Requests in execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m x"} 3.0
vllm:num_requests_running{engine="1",model_name="m x"} 2.0
vllm:num_requests_waiting{engine="0",model_name="m x"} 4.0
vllm:num_requests_waiting{engine="1",model_name="m x"} 0.0
vllm:kv_cache_usage_perc{engine="0",model_name="m x"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m x"} 0.5 1700000000000
vllm:num_requests_running_total 99
"""


def test_parse_load_sums_ranks_and_takes_the_fullest_kv() -> None:
    sample = parse_load(VLLM_METRICS, "vllm")
    assert (sample.running, sample.waiting, sample.kv_usage) == (5.0, 4.0, 0.5)


def test_parse_load_reads_the_process_start_time_when_there_is_one() -> None:
    assert parse_load(VLLM_METRICS, "vllm").started_at is None
    page = VLLM_METRICS + (
        b"# HELP process_start_time_seconds Start time of the process since unix epoch.\n"
        b"# TYPE process_start_time_seconds gauge\n"
        b"process_start_time_seconds 1.70000004225e+09\n"
    )
    assert parse_load(page, "vllm").started_at == 1700000042.25
    sglang = b"sglang:num_running_reqs 1\nsglang:num_queue_reqs 2\nprocess_start_time_seconds 7\n"
    assert parse_load(sglang, "sglang").started_at == 7.0


def test_parse_load_reads_the_prompt_counter_per_series_and_skips_bad_optional_values() -> None:
    page = VLLM_METRICS + (
        b'vllm:prompt_tokens_total{engine="0",model_name="m x"} 1234.0\n'
        b'vllm:prompt_tokens_total{engine="1",model_name="m x"} 10.0\n'
        b"vllm:prompt_tokens_created 1.7e9\n"
        b'sglang:prompt_tokens_total{tp_rank="0"} 99\n'
    )
    assert parse_load(page, "vllm").prompt_tokens == (
        ('{engine="0",model_name="m x"}', 1234.0),
        ('{engine="1",model_name="m x"}', 10.0),
    )
    sglang = b"sglang:num_running_reqs 1\nsglang:num_queue_reqs 2\nsglang:prompt_tokens_total 5\n"
    assert parse_load(sglang, "sglang").prompt_tokens == (("", 5.0),)
    # Restart detection is best effort: a malformed value there does not lose the load.
    odd = VLLM_METRICS + b"process_start_time_seconds soon\nvllm:prompt_tokens_total\n"
    sample = parse_load(odd, "vllm")
    assert (sample.running, sample.started_at, sample.prompt_tokens) == (5.0, None, None)


# A fresh SGLang 0.5.23 decode server's /metrics (excerpt): the load gauges come only once
# its scheduler first reports.
FRESH_SGLANG_DECODE = (
    b"# HELP sglang:max_total_num_tokens Maximum total number of tokens in the KV cache pool.\n"
    b"# TYPE sglang:max_total_num_tokens gauge\n"
    b'sglang:max_total_num_tokens{engine_type="decode",model_name="tiny-llama",'
    b'moe_ep_rank="0",pp_rank="0",tp_rank="0"} 8192.0\n'
)


def test_parse_load_reads_a_fresh_sglang_server_as_not_yet_loaded() -> None:
    sample = parse_load(FRESH_SGLANG_DECODE, "sglang")
    assert (sample.running, sample.waiting, sample.kv_usage) == (0.0, 0.0, None)
    assert sample.gauges_pending
    assert not parse_load(
        b"sglang:num_running_reqs 1\nsglang:num_queue_reqs 2\n", "sglang"
    ).gauges_pending
    # One gauge without the other, or a page that is not a fresh SGLang server's, is a fault.
    with pytest.raises(ScrapeError, match=r"^GET /metrics lacks sglang:num_queue_reqs$"):
        parse_load(FRESH_SGLANG_DECODE + b"sglang:num_running_reqs 1\n", "sglang")
    with pytest.raises(ScrapeError, match=r"^GET /metrics lacks sglang:num_running_reqs, "):
        parse_load(b"process_start_time_seconds 7\n", "sglang")
    with pytest.raises(ScrapeError, match=r"^GET /metrics lacks vllm:num_requests_running, "):
        parse_load(FRESH_SGLANG_DECODE, "vllm")


def test_parse_load_sglang_names_and_missing_gauges() -> None:
    sample = parse_load(b"sglang:num_running_reqs 1\nsglang:num_queue_reqs 2\n", "sglang")
    assert (sample.running, sample.waiting, sample.kv_usage) == (1.0, 2.0, None)
    with pytest.raises(ScrapeError, match=r"^GET /metrics lacks vllm:num_requests_waiting$"):
        parse_load(b"vllm:num_requests_running 1\n", "vllm")
    with pytest.raises(ScrapeError, match="bad value"):
        parse_load(b"vllm:num_requests_running x\nvllm:num_requests_waiting 1\n", "vllm")
