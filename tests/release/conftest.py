"""The serving tests' simulated stack, for the monitoring test."""

from ..serving.conftest import start_stack as start_stack
