"""/metrics of a decision core and its workers as one exposition
(docs/architecture.md#workers).

Owns
  `merged`: the core's exposition with every worker's counters, histograms and summaries
  added in, sample by sample (name and labels). Gauges are the core's alone: a gauge is a
  reading of state, and the state they read (the fleet, the gate, the books) is the
  core's; a worker's copies of it are mirrors.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

_ADDED = frozenset({"counter", "histogram", "summary"})
# A counter's creation time is when it was first used, in whichever process: not a sum.
_KEPT_SUFFIXES = ("_created",)


def merged(core: bytes, workers: Iterable[bytes]) -> bytes:
    """One exposition: `core`'s, with the samples of `workers` of the kinds that add."""
    families = {family.name: family for family in _parse(core)}
    for text in workers:
        for family in _parse(text):
            if family.type not in _ADDED:
                continue
            ours = families.get(family.name)
            if ours is None:
                families[family.name] = family
                continue
            _add(ours, family.samples)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(families.values())))
    return generate_latest(registry)


def _parse(text: bytes) -> Iterator[Metric]:
    return iter(text_string_to_metric_families(text.decode()))


def _add(family: Metric, samples: list[Sample]) -> None:
    index = {(s.name, tuple(sorted(s.labels.items()))): i for i, s in enumerate(family.samples)}
    for sample in samples:
        key = (sample.name, tuple(sorted(sample.labels.items())))
        at = index.get(key)
        if at is None:
            index[key] = len(family.samples)
            family.samples.append(sample)
        elif not sample.name.endswith(_KEPT_SUFFIXES):
            ours = family.samples[at]
            family.samples[at] = ours._replace(value=ours.value + sample.value)


class _Families:
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        yield from self._families
