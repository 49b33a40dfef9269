"""The real-engine tier's budget (issue 28): its wall time, installs included, and the
memory its engines take at their peak.

    .venv/bin/python tools/bench/real_tier.py                 # installs into a temp dir
    .venv/bin/python tools/bench/real_tier.py --keep-venvs    # the cached venvs as they are

By default both engine venvs are made afresh in a temporary directory with
tools/engines/{vllm,sglang}-venv.sh, side by side as tools/test.sh makes them, from
whatever pip cache this machine has (the budget assumes a warm one: CI machines keep
theirs), and the tier runs on them through
NARWHAL_VLLM_VENV and NARWHAL_SGLANG_VENV. Then `pytest tests/real -m real` runs as the
README's test command runs it, while a sampler reads the proportional set size (PSS, so that
pages the engines share are counted once) of every process started from those venvs every
half second: vLLM's API servers and engine cores, SGLang's servers and schedulers, and the
benchmarks' tokenizer helpers alike.

Budgets (issue 28): the tier within 12 minutes with a warm pip cache, installs included;
engines within 13 GB. The result says which are met.

Writes runs/bench/real-tier.json; pytest's output goes to runs/tmp/real-tier/.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import benchkit

TIER_BUDGET_S = 12 * 60
MEMORY_BUDGET_GB = 13.0
SAMPLE_S = 0.5
ENGINES = ("vllm", "sglang")


def pss_bytes(pid: int) -> int:
    """A process's proportional set size; 0 once it has gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as rollup:
            for line in rollup:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def started_from(venvs: list[Path]) -> list[int]:
    """The processes whose program is one of the venvs' (children made by fork keep it)."""
    prefixes = [str(v) + "/" for v in venvs]
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            program = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0", 1)[0].decode()
        except OSError:
            continue
        if any(program.startswith(p) for p in prefixes):
            found.append(int(entry))
    return found


class Sampler:
    """The engines' summed PSS every SAMPLE_S, on a thread, while the tier runs."""

    def __init__(self, venvs: list[Path]) -> None:
        self._venvs = venvs
        self._halt = threading.Event()
        self.peak_bytes = 0
        self.peak_processes = 0
        self.samples = 0
        self._thread = threading.Thread(target=self._run, name="pss", daemon=True)

    def _run(self) -> None:
        while not self._halt.wait(SAMPLE_S):
            pids = started_from(self._venvs)
            total = sum(pss_bytes(pid) for pid in pids)
            self.samples += 1
            if total > self.peak_bytes:
                self.peak_bytes, self.peak_processes = total, len(pids)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._halt.set()
        self._thread.join()


def install(venvs: dict[str, Path], logs: Path) -> float:
    """Both venvs made side by side, as tools/test.sh makes them; the seconds until both
    are ready (each script's log says its own)."""
    started = time.monotonic()
    running = {}
    for engine, venv in venvs.items():
        print(f"installing {engine} into {venv}", flush=True)
        out = (logs / f"{engine}-venv.log").open("w")
        script = benchkit.REPO / "tools" / "engines" / f"{engine}-venv.sh"
        running[engine] = (
            subprocess.Popen(
                ["bash", str(script), str(venv)], stdout=out, stderr=subprocess.STDOUT
            ),
            out,
        )
    for engine, (proc, out) in running.items():
        code = proc.wait()
        out.close()
        if code != 0:
            sys.exit(f"{engine}-venv.sh failed ({code}); see {logs / f'{engine}-venv.log'}")
    return time.monotonic() - started


def default_venv(engine: str) -> Path:
    name = f"NARWHAL_{engine.upper()}_VENV"
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return Path(os.environ.get(name, cache / "narwhal" / f"{engine}-venv"))


def by_engine(log: Path) -> dict[str, float]:
    """Seconds of setup, call and teardown pytest reports (--durations=0), summed for the
    SGLang tests (tests/real/sglang) and for the rest, the vLLM tier."""
    seconds = {"vllm": 0.0, "sglang": 0.0}
    for line in log.read_text().splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0].endswith("s") and parts[2].startswith("tests/real/"):
            try:
                spent = float(parts[0][:-1])
            except ValueError:
                continue
            seconds["sglang" if parts[2].startswith("tests/real/sglang/") else "vllm"] += spent
    return {k: round(v, 1) for k, v in seconds.items()}


def summary_line(log: Path) -> str:
    """pytest's last line: `N passed, M failed in S s` (with -q, bare)."""
    lines = [line for line in log.read_text().splitlines() if line.strip()]
    return lines[-1].strip("= ") if lines else ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--keep-venvs",
        action="store_true",
        help="run on the cached venvs without reinstalling (the install time is then 0)",
    )
    parser.add_argument("--out", type=Path, default=benchkit.RUNS / "real-tier.json")
    args = parser.parse_args()
    logs = benchkit.TMP / "real-tier" / time.strftime("%Y%m%d-%H%M%S")
    logs.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="real-tier-") as scratch:
        if args.keep_venvs:
            venvs = {engine: default_venv(engine) for engine in ENGINES}
            install_s = 0.0
        else:
            venvs = {engine: Path(scratch) / f"{engine}-venv" for engine in ENGINES}
            install_s = install(venvs, logs)
        env = {**os.environ}
        for engine, venv in venvs.items():
            env[f"NARWHAL_{engine.upper()}_VENV"] = str(venv)
        pytest_log = logs / "pytest.log"
        print(f"running the real tier; output in {pytest_log}", flush=True)
        started = time.monotonic()
        with Sampler(list(venvs.values())) as sampler, pytest_log.open("w") as out:
            done = subprocess.run(
                [
                    str(benchkit.REPO / ".venv" / "bin" / "pytest"),
                    *("tests/real", "-m", "real", "-q", "--durations=0", "--durations-min=0"),
                ],
                cwd=benchkit.REPO,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                check=False,
            )
        tier_s = time.monotonic() - started
    total_s = tier_s + install_s
    peak_gb = sampler.peak_bytes / 1e9
    document: dict[str, benchkit.Json] = {
        "benchmark": "real-tier",
        "machine": benchkit.machine(),
        "git": benchkit.git_revision(),
        "load_average": benchkit.load_average(),
        "config": {"fresh_venvs": not args.keep_venvs, "sample_s": SAMPLE_S},
        "results": {
            "install_s": round(install_s, 1),
            "pytest_s": round(tier_s, 1),
            "total_s": round(total_s, 1),
            "pytest_exit": done.returncode,
            "pytest_summary": summary_line(pytest_log),
            # The SGLang tier came after issue 28 set the budget for the vLLM one.
            "test_s_by_engine": by_engine(pytest_log),
            "peak_engine_pss_gb": round(peak_gb, 2),
            "peak_engine_processes": sampler.peak_processes,
            "memory_samples": sampler.samples,
        },
        "budgets": {
            "tier_s": TIER_BUDGET_S,
            "tier_met": total_s <= TIER_BUDGET_S,
            "engine_memory_gb": MEMORY_BUDGET_GB,
            "engine_memory_met": peak_gb <= MEMORY_BUDGET_GB,
        },
    }
    benchkit.publish(args.out, document)
    print(
        f"tier {total_s / 60:.1f} min (installs {install_s / 60:.1f}), "
        f"engines peak {peak_gb:.2f} GB PSS; pytest: {summary_line(pytest_log)}"
    )
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
