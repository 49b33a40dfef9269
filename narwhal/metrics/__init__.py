"""Prometheus metrics on Narwhal's own registry."""

from ._metrics import GaugeSource as GaugeSource, Metrics as Metrics
