"""Placement decisions: pure functions of engine views."""

from ._place import (
    DEFAULT_POLICY as DEFAULT_POLICY,
    NoPlacement as NoPlacement,
    Placement as Placement,
    Policy as Policy,
    cached_load_policy as cached_load_policy,
    choose as choose,
)
