"""Just enough of the Prometheus text format to read an engine's /metrics."""

from __future__ import annotations

import math
import re

import attrs

_SAMPLE = re.compile(
    r"^(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)(?:\s+\S+)?$"
)
_LABEL = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"\s*,?')


@attrs.frozen
class Sample:
    name: str
    labels: dict[str, str]
    value: float


def parse_metrics(text: str) -> list[Sample]:
    """Every sample line; malformed lines are skipped (an engine's extra output must not
    break a probe that only needs a few gauges)."""
    out: list[Sample] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            continue
        try:
            value = float(match["value"])
        except ValueError:
            continue
        labels: dict[str, str] = {}
        raw = match["labels"] or ""
        for label in _LABEL.finditer(raw):
            labels[label.group(1)] = label.group(2).replace('\\"', '"').replace("\\\\", "\\")
        out.append(Sample(match["name"], labels, value))
    return out


def first_value(samples: list[Sample], *names: str) -> float | None:
    """The sum over label sets of the first listed metric that is present (engines with
    several data-parallel ranks publish one series per rank)."""
    for name in names:
        values = [s.value for s in samples if s.name == name and math.isfinite(s.value)]
        if values:
            return sum(values)
    return None


def first_labels(samples: list[Sample], name: str) -> dict[str, str] | None:
    for s in samples:
        if s.name == name:
            return s.labels
    return None
