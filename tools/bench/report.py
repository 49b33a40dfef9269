"""Markdown tables of the latest benchmark results, for docs/benchmarks.md.

.venv/bin/python tools/bench/report.py [overhead|transport|accuracy|memory ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from benchkit import RUNS


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def overhead_tables(doc: dict[str, Any]) -> str:
    rows = doc["summary"]
    lines = [
        f"Run of {doc['started']} on {doc['machine']['cpu_model']}, {doc['machine']['cores']} "
        f"cores, Python {doc['machine']['python']}; median of {doc['config']['plan']['reps']} "
        f"interleaved repetitions; vllm-router {doc['versions'].get('vllm-router') or 'skipped'}.",
        "",
        "Non-streaming (max_tokens 4):",
        "",
        "| clients | target | req/s | router CPU ms/req | latency p50 ms | p99 ms "
        "| added p50 ms | added p99 ms |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r["mode"] != "non-stream":
            continue
        lines.append(
            f"| {r['concurrency']} | {r['target']} | {_fmt(r['requests_per_s'], 1)} "
            f"| {_fmt(r['router_cpu_ms_per_request'], 3)} | {_fmt(r['latency_p50_ms'])} "
            f"| {_fmt(r['latency_p99_ms'])} | {_fmt(r['added_latency_p50_ms'])} "
            f"| {_fmt(r['added_latency_p99_ms'])} |"
        )
    lines += [
        "",
        "Streaming (max_tokens 32):",
        "",
        "| streams | target | streams/s | router CPU ms/stream | µs/chunk | µs/token "
        "| chunks/stream | TTFT p50 ms | p99 ms | added TTFT p50 ms | added p99 ms |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r["mode"] != "stream":
            continue
        lines.append(
            f"| {r['concurrency']} | {r['target']} | {_fmt(r['requests_per_s'], 1)} "
            f"| {_fmt(r['router_cpu_ms_per_request'], 3)} "
            f"| {_fmt(r['router_cpu_us_per_chunk'], 0)} "
            f"| {_fmt(r['router_cpu_us_per_token'], 0)} | {_fmt(r['chunks_per_stream'], 1)} "
            f"| {_fmt(r['ttft_p50_ms'])} | {_fmt(r['ttft_p99_ms'])} "
            f"| {_fmt(r['added_ttft_p50_ms'])} | {_fmt(r['added_ttft_p99_ms'])} |"
        )
    probe = doc.get("alternating_c1")
    if probe:
        lines += [
            "",
            "Concurrency 1, targets alternating every "
            f"{doc['config']['plan'].get('alternating_c1_slice_s')} s within one window "
            "(same disturbance for all; added = router minus direct):",
            "",
            "| mode | target | n | router CPU ms/req | µs/chunk | latency p50 ms | TTFT p50 ms "
            "| p99 ms | added p50 ms | added p99 ms |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in probe["summary"]:
            stream = r["mode"] == "stream"
            added = "added_ttft" if stream else "added_latency"
            lines.append(
                f"| {r['mode']} | {r['target']} | {_fmt(r.get('completed_total'))} "
                f"| {_fmt(r['router_cpu_ms_per_request'], 3)} "
                f"| {_fmt(r['router_cpu_us_per_chunk'], 0)} | {_fmt(r['latency_p50_ms'])} "
                f"| {_fmt(r['ttft_p50_ms'])} | {_fmt(r['ttft_p99_ms'])} "
                f"| {_fmt(r[added + '_p50_ms'])} | {_fmt(r[added + '_p99_ms'])} |"
            )
    lines += ["", "Goals (issue 8 part 2):", ""]
    for target, g in doc["goals"].items():
        flat = g["flat_cpu"]
        lines.append(
            f"- {target}: added TTFT p50 at 64 streams {_fmt(g['added_ttft_p50_ms_at_64'])} ms "
            f"(goal < {g['added_ttft_goal_ms']} ms: {_met(g['added_ttft_met'])}); CPU per "
            f"request 512 vs 64: non-streaming x{_fmt(flat['non-stream']['ratio_512_over_64'])}, "
            f"streaming x{_fmt(flat['stream']['ratio_512_over_64'])} (goal <= "
            f"x{g['flat_cpu_goal_max_ratio']}: {_met(flat['non-stream']['met'])} / "
            f"{_met(flat['stream']['met'])})"
        )
    d = doc.get("disturbance")
    if d:
        lines += ["", _disturbance(d)]
    return "\n".join(lines)


def _met(value: Any) -> str:
    return {True: "met", False: "not met"}.get(value, "n/a")


def _disturbance(d: dict[str, Any]) -> str:
    return (
        f"Other processes on the box during the measurement windows: median "
        f"{_fmt(d['median_other_cores'])} cores, max {_fmt(d['max_other_cores'])}; "
        f"{d['cells_rerun']} of {d['cells']} cells re-run, "
        f"{d['cells_over_guard_after_reruns']} still above the guard after re-running."
    )


def transport_table(doc: dict[str, Any]) -> str:
    rows = doc["summary"]
    inflight = sorted({r["inflight"] for r in rows})
    clients = [
        c for c in ("narwhal-pool", "httpx", "httpx-sharded") if any(r["client"] == c for r in rows)
    ]
    lines = [
        f"Run of {doc['started']} on {doc['machine']['cpu_model']}, {doc['machine']['cores']} "
        f"cores; median of {doc['config']['reps']} interleaved repetitions; httpx "
        f"{doc['versions'].get('httpx')}, httpcore {doc['versions'].get('httpcore')}.",
        "",
        "Client CPU ms per request (requests/s in parentheses):",
        "",
        "| client | " + " | ".join(f"{i} in flight" for i in inflight) + " | 512 vs 16 |",
        "|---|" + "---:|" * (len(inflight) + 1),
    ]
    for client in clients:
        cells = []
        for i in inflight:
            r = next((r for r in rows if r["client"] == client and r["inflight"] == i), None)
            cells.append(
                "–"
                if r is None
                else f"{_fmt(r['client_cpu_ms_per_request'], 3)} ({_fmt(r['requests_per_s'], 0)})"
            )
        ratio = doc["flatness"].get(client, {}).get("ratio_512_over_16")
        lines.append(f"| {client} | " + " | ".join(cells) + f" | x{_fmt(ratio)} |")
    d = doc.get("disturbance")
    if d:
        lines += ["", _disturbance(d)]
    return "\n".join(lines)


def table_for(name: str, doc: dict[str, Any]) -> str:
    if name.startswith("overhead"):
        return overhead_tables(doc)
    if name.startswith("accuracy"):
        import accuracy

        return accuracy.table(doc)
    if name.startswith("memory"):
        import memory

        return memory.table(doc)
    return transport_table(doc)


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "results",
        nargs="*",
        default=["overhead", "transport", "accuracy", "memory"],
        help="result stems under runs/bench/ (default: overhead transport accuracy memory)",
    )
    for name in parser.parse_args(argv).results:
        path = RUNS / f"{name}.json"
        if not path.exists():
            print(f"({path} does not exist)\n")
            continue
        doc = json.loads(path.read_text())
        print(table_for(name, doc))
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
