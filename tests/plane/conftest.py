from __future__ import annotations

from ..serving.conftest import start_stack as start_stack

__all__ = ["start_stack"]
