"""Router memory under a request flood (issue 8 part 4): Narwhal's RSS stays bounded by the
retained-request ceiling (serving.max_connections + serving.queue_capacity), however many
requests are offered.

    .venv/bin/python tools/bench/memory.py              # 2 x 2,000 and 2 x 10,000; ~2.5 min
    .venv/bin/python tools/bench/memory.py --replot     # redraw the PNG from the JSON
    .venv/bin/python tools/bench/memory.py --workers 2 --out runs/bench/memory-workers.json

For each flood size, on a fresh fleet and a fresh router: 4 simulated engines (2P2D) in slow
motion (`--speed`, so a served request takes seconds), Narwhal with queueing on
(max_connections 256, queue_capacity 256, queue_timeout_s 2, open admission, controller
off), then a flood client (loadgen.py in flood mode, its own process) with `--concurrency`
keep-alive sockets that sends the flood's requests as fast as the router answers them.
Phases: idle (before), flood, drain (until nothing is retained), idle (after). Every
~100 ms the driver reads the router's VmRSS and VmHWM from /proc/PID/status (with
`--workers`, summed over its worker processes too), and a second
task polls /narwhal/state for the retained and queued counts.

Each flood runs `--rounds` times against the same router (drain and idle in between), so
a second round shows whether a flood's memory is reused or added to. Reported per round:
RSS before (idle), peak (max sampled VmRSS and the kernel's VmHWM), RSS after the drain, the
most retained requests seen against the ceiling, RSS above the idle level per retained
request at the peak, and the client's outcome counts. Bounded memory means the 10,000-request
floods peak about where the 2,000-request ones do and later rounds add nothing; see
docs/benchmarks.md for what the latest run showed.

Writes runs/bench/memory.json and runs/bench/memory.png; logs go to
runs/tmp/memory/<timestamp>/ (git-ignored).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import attrs
import benchkit
import httpx
import numpy as np
import trio
from benchkit import Json, harness

OUT = benchkit.RUNS / "memory.json"
SAMPLE_EVERY_S = 0.1
SERVING: dict[str, int | float] = {
    "max_connections": 256,
    "queue_capacity": 256,
    "queue_timeout_s": 2.0,
    "handoff_timeout_s": 30.0,
    "prefill_concurrency": 64,
    "decode_concurrency": 128,
}
CEILING = int(SERVING["max_connections"] + SERVING["queue_capacity"])  # retained requests


# ---------------------------------------------------------------------- pure parts


def parse_status(text: str) -> tuple[int, int]:
    """(VmRSS, VmHWM) in KiB from the text of /proc/PID/status."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            values[key] = int(rest.split()[0])
    if len(values) != 2:
        raise ValueError("no VmRSS/VmHWM in the status text (a kernel thread, or exited)")
    return values["VmRSS"], values["VmHWM"]


@attrs.frozen
class Sample:
    t: float  # wall seconds since the run's first sample
    phase: str
    rss_kib: int
    hwm_kib: int
    retained: int | None  # the latest /narwhal/state answer (None: none yet)
    queued: int | None


def mib(kib: float) -> float:
    return round(kib / 1024, 1)


def phase_names(round_: int) -> tuple[str, str, str, str]:
    """(idle before, flood, drain, idle after) of a round; a round's idle before is the
    previous round's idle after."""

    def name(phase: str, r: int) -> str:
        return phase if r == 1 else f"{phase}_{r}"

    before = "idle_before" if round_ == 1 else name("idle_after", round_ - 1)
    return before, name("flood", round_), name("drain", round_), name("idle_after", round_)


def flood_summary(samples: Sequence[Sample], ceiling: int, round_: int = 1) -> dict[str, Json]:
    """RSS and retained figures of one flood round's samples."""

    def of(phase: str) -> list[Sample]:
        return [s for s in samples if s.phase == phase]

    idle_before, flood, drain, idle_after = phase_names(round_)
    before = [s.rss_kib for s in of(idle_before)]
    after = [s.rss_kib for s in of(idle_after)]
    busy = of(flood) + of(drain)
    window = of(idle_before) + busy + of(idle_after)
    peak = max(busy, key=lambda s: s.rss_kib, default=None)
    retained = [s.retained for s in busy if s.retained is not None]
    idle = float(np.median(before)) if before else None
    max_retained = max(retained, default=0)
    per_request = None
    if peak is not None and idle is not None and max_retained:
        per_request = round((peak.rss_kib - idle) / max_retained, 1)
    return {
        "rss_idle_before_mib": None if idle is None else mib(idle),
        "rss_peak_mib": None if peak is None else mib(peak.rss_kib),
        # VmHWM only rises: its value at the end of the round.
        "hwm_mib": mib(max(s.hwm_kib for s in window)) if window else None,
        "rss_after_drain_mib": mib(float(np.median(after))) if after else None,
        "rss_growth_after_vs_before_mib": (
            mib(float(np.median(after)) - idle) if after and idle is not None else None
        ),
        "max_retained": max_retained,
        "retained_ceiling": ceiling,
        "retained_at_rss_peak": None if peak is None else peak.retained,
        # RSS above idle at the peak, per retained request at most: an upper bound on the
        # memory one retained request costs (connections and buffers included).
        "kib_per_retained_request": per_request,
        "samples": len(samples),
    }


def series(samples: Sequence[Sample]) -> dict[str, Json]:
    """The time series for the plot, column-wise and rounded (a few hundred points)."""
    return {
        "t": [round(s.t, 2) for s in samples],
        "phase": [s.phase for s in samples],
        "rss_mib": [mib(s.rss_kib) for s in samples],
        "retained": [s.retained for s in samples],
        "queued": [s.queued for s in samples],
    }


# ----------------------------------------------------------------------------- run


class Watch:
    """Samples one process's RSS every SAMPLE_EVERY_S and Narwhal's retained count."""

    def __init__(self, pid: int, state_url: str) -> None:
        self.pid = pid
        self.state_url = state_url
        self.phase = "idle_before"
        self.samples: list[Sample] = []
        self.retained: int | None = None
        self.queued: int | None = None
        self.state_errors = 0
        self.t0 = trio.current_time()
        self._drained = trio.Event()

    async def rss_loop(self) -> None:
        while True:
            now = trio.current_time()
            rss, hwm = await self._tree_status()
            self.samples.append(
                Sample(now - self.t0, self.phase, rss, hwm, self.retained, self.queued)
            )
            await trio.sleep_until(now + SAMPLE_EVERY_S)

    async def _tree_status(self) -> tuple[int, int]:
        """(VmRSS, VmHWM) of the router and its worker processes (serving.workers), summed:
        the sum of their peaks is at least the tree's peak."""
        rss, hwm = parse_status(await trio.Path(f"/proc/{self.pid}/status").read_text())
        for child in benchkit.descendants(self.pid):
            try:
                text = await trio.Path(f"/proc/{child}/status").read_text()
                child_rss, child_hwm = parse_status(text)
            except (OSError, ValueError):
                continue  # gone meanwhile
            rss, hwm = rss + child_rss, hwm + child_hwm
        return rss, hwm

    async def state_loop(self) -> None:
        async with httpx.AsyncClient(timeout=5.0) as client:
            while True:
                now = trio.current_time()
                try:
                    admission = (await client.get(self.state_url)).json()["admission"]
                    self.retained = int(admission["retained"])
                    self.queued = int(admission["queue_depth"])
                except (httpx.HTTPError, ValueError, KeyError, TypeError):
                    self.state_errors += 1
                if self.phase.startswith("drain") and self.retained == 0:
                    self._drained.set()
                await trio.sleep_until(now + SAMPLE_EVERY_S)

    async def wait_drained(self, phase: str, within_s: float) -> bool:
        self._drained = trio.Event()
        self.phase = phase
        with trio.move_on_after(within_s):
            await self._drained.wait()
            return True
        return False


async def one_flood(args: argparse.Namespace, requests: int, run_dir: Path) -> Json:
    await trio.Path(run_dir).mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    async with harness.Procs(run_dir, args.niceness) as procs:
        groups = await harness.start_fleet(
            procs, engines=4, speed=args.speed, model=harness.MODEL, seed=args.seed
        )
        urls, roles = harness.assign_roles(groups, 2)
        config = harness.narwhal_config(
            urls,
            roles,
            port=harness.free_port(),
            speed=args.speed,
            admission="open",
            controller=False,
            ttft_slo_s=0.5,
            tpot_slo_s=0.05,
            socket_path=str(run_dir / "narwhal.sock"),
            # The flood stands for many clients, but all of it comes from 127.0.0.1: the
            # per-client limits are raised to the global ones, as behind a proxy.
            extra={
                "serving": {
                    **SERVING,
                    "max_pending_bodies_per_client": CEILING,
                    "workers": args.workers,
                },
                "listen": {"max_open_connections_per_client": 4096},
            },
        )
        url = await harness.start_narwhal(procs, config, run_dir)
        await harness.warm_up(url, count=1)
        watch = Watch(procs.find("narwhal").pid, harness.admin_url(config) + "/narwhal/state")
        spec = {
            "mode": "flood",
            "url": url,
            "requests": requests,
            "concurrency": args.concurrency,
            "prompt_tokens": args.prompt_tokens,
            "max_tokens": args.max_tokens,
            "model": harness.MODEL,
            "request_timeout_s": 60.0,
            "deadline_s": args.flood_limit_s,
        }
        argv = [sys.executable, str(benchkit.BENCH / "loadgen.py"), json.dumps(spec)]
        busy0 = benchkit.machine_cpu_seconds()[0]
        cpu0 = procs.cpu()
        rounds: list[dict[str, Json]] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch.rss_loop)
            nursery.start_soon(watch.state_loop)
            await trio.sleep(args.idle_s)
            for r in range(1, args.rounds + 1):
                _, flood, drain, idle_after = phase_names(r)
                watch.phase = flood
                client = await procs.start(flood, argv, stdout_pipe=True)
                lines = await harness.read_lines(client, 1, args.flood_limit_s + 30.0)
                drained = await watch.wait_drained(drain, args.drain_limit_s)
                rounds.append({"round": r, "client": json.loads(lines[0]), "drained": drained})
                watch.phase = idle_after
                await trio.sleep(args.idle_s)
            nursery.cancel_scope.cancel()
        wall = time.monotonic() - started
        cpu1 = procs.cpu()
        busy = benchkit.machine_cpu_seconds()[0] - busy0
    span = watch.samples[-1].t if watch.samples else 0.0
    ours = sum(r["client"]["cpu_s"] for r in rounds) + sum(
        (cpu1[k] or 0.0) - (cpu0.get(k) or 0.0) for k in cpu1 if cpu1[k] is not None
    )
    ceiling = CEILING
    return {
        "requests": requests,
        "wall_s": round(wall, 1),
        "rounds": [
            {**r, "memory": flood_summary(watch.samples, ceiling, r["round"])} for r in rounds
        ],
        "state_errors": watch.state_errors,
        "disturbance": {
            "other_cpu_share": round(max(0.0, busy - ours) / span, 3) if span else None,
            "narwhal_cpu_share": round(
                ((cpu1.get("narwhal") or 0.0) - (cpu0.get("narwhal") or 0.0)) / span, 3
            )
            if span
            else None,
        },
        "series": series(watch.samples),
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--floods", default="2000,10000", help="requests per flood")
    p.add_argument("--rounds", type=int, default=2, help="floods per router process")
    p.add_argument("--concurrency", type=int, default=1500, help="client sockets")
    p.add_argument("--speed", type=float, default=0.1, help="simulator speed (slow fleet)")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--idle-s", type=float, default=3.0, help="idle sampling before and after")
    p.add_argument("--flood-limit-s", type=float, default=200.0)
    p.add_argument("--drain-limit-s", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--niceness", type=int, default=5)
    p.add_argument(
        "--workers", type=int, default=1, help="serving.workers; RSS is the process tree's"
    )
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--replot", action="store_true", help="redraw the PNG from --out")
    return p.parse_args(argv)


def table(doc: Json) -> str:
    lines = [
        "| flood | sockets | offered req/s | ok | refused (429) | other | max retained / ceiling "
        "| RSS before MiB | RSS peak MiB | VmHWM MiB | RSS after drain MiB |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for f, r in ((fl, r) for fl in doc["floods"] for r in fl["rounds"]):
        m, c = r["memory"], r["client"]
        outcomes = c["outcomes"]
        ok = outcomes.get("ok", 0)
        refused = sum(v for k, v in outcomes.items() if k.startswith("429"))
        flood = f"{f['requests']}" + ("" if r["round"] == 1 else f" (round {r['round']})")
        lines.append(
            f"| {flood} | {doc['config']['concurrency']} | {c['offered_per_s']} | {ok} "
            f"| {refused} | {c['answered'] - ok - refused} "
            f"| {m['max_retained']} / {m['retained_ceiling']} | {m['rss_idle_before_mib']} "
            f"| {m['rss_peak_mib']} | {m['hwm_mib']} | {m['rss_after_drain_mib']} |"
        )
    return "\n".join(lines)


def plot(doc: Json, path: Path) -> None:
    plt = benchkit.pyplot()
    floods = doc["floods"]
    fig, axes = plt.subplots(1, len(floods), figsize=(6 * len(floods), 4.2), squeeze=False)
    top = max((max(f["series"]["rss_mib"], default=0) for f in floods), default=1) * 1.1
    for ax, f in zip(axes[0], floods, strict=True):
        s = f["series"]
        ax.plot(s["t"], s["rss_mib"], color="C0", label="router VmRSS")
        ax.set_ylim(0, top)
        ax.set_xlabel("wall time (s)")
        ax.set_ylabel("RSS (MiB)", color="C0")
        right = ax.twinx()
        retained = [np.nan if v is None else v for v in s["retained"]]
        right.plot(s["t"], retained, color="C1", label="retained")
        ceiling = f["rounds"][0]["memory"]["retained_ceiling"]
        right.axhline(ceiling, color="C1", linestyle=":", linewidth=0.8)
        right.set_ylim(0, ceiling * 1.15)
        right.set_ylabel("retained requests", color="C1")
        for i, phase in enumerate(s["phase"]):
            if i and phase != s["phase"][i - 1]:
                ax.axvline(s["t"][i], color="0.6", linewidth=0.7)
        peaks = " / ".join(str(r["memory"]["rss_peak_mib"]) for r in f["rounds"])
        ax.set_title(
            f"{len(f['rounds'])} x {f['requests']} requests, {doc['config']['concurrency']} "
            f"sockets: peak {peaks} MiB",
            fontsize=9,
        )
    fig.suptitle("Narwhal RSS under a flood (retained ceiling dotted)", fontsize=10)
    benchkit.save_figure(fig, path)


async def run(args: argparse.Namespace) -> int:
    run_dir = benchkit.TMP / "memory" / time.strftime("%Y%m%d-%H%M%S")
    floods = []
    for n in (int(x) for x in args.floods.split(",")):
        print(f"memory: flood of {n} ...", flush=True)
        floods.append(await one_flood(args, n, run_dir / f"flood-{n}"))
    doc = {
        "benchmark": "memory",
        "generated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": benchkit.machine(),
        "versions": benchkit.versions(["narwhal", "trio", "h11", "hypercorn"]),
        "git": benchkit.git_revision(),
        "load_average": benchkit.load_average(),
        "config": {
            "engines": "4 simulated (2P2D), one process",
            "speed": args.speed,
            "serving": {**SERVING, "workers": args.workers},
            "admission": "open",
            "concurrency": args.concurrency,
            "rounds": args.rounds,
            "prompt_tokens": args.prompt_tokens,
            "max_tokens": args.max_tokens,
            "idle_s": args.idle_s,
            "sample_every_s": SAMPLE_EVERY_S,
            "niceness": args.niceness,
            "logs": str(run_dir.relative_to(benchkit.REPO)),
        },
        "floods": floods,
    }
    benchkit.publish(args.out, doc, plot=plot, table=table)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot:
        return benchkit.show(args.out, replot=plot, table=table)
    if args.concurrency < 1 or args.rounds < 1 or any(int(n) < 1 for n in args.floods.split(",")):
        print("memory: --floods, --rounds and --concurrency must be positive", file=sys.stderr)
        return 2
    return trio.run(harness.run_guarded, partial(run, args))


if __name__ == "__main__":
    sys.exit(main())
