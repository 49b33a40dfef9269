"""Narwhal's CPU workaround for SGLang's Mooncake prefill sender (the tier's SGLang venv only).

WHY: SGLang 0.5.23's `MooncakeKVSender` declares `supports_host_tensor_indices = True`, so
the prefill scheduler copies each request's page indices into pinned memory and records a
`torch.cuda.Event` before sending; on a CPU-only host the first P/D request kills the prefill
scheduler. With the class attribute False it takes the generic path the other transfer
backends take (plain `kv_to_page_indices`), which is all a CPU needs.

The attribute is set when `sglang.srt.disaggregation.mooncake.conn` is first imported (an
import hook, so no other process in the venv pays for importing SGLang here). Installed by
tools/engines/sglang-venv.sh, which checks the attribute still exists in the pinned SGLang
and says so when a new version no longer has it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType

TARGET = "sglang.srt.disaggregation.mooncake.conn"


class _Patch(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def __getattr__(self, name: str) -> object:
        # get_source, get_filename, is_package...: the wrapped loader's (tracebacks read
        # the module's source through them).
        return getattr(self._loader, name)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        sender = getattr(module, "MooncakeKVSender", None)
        if sender is not None and hasattr(sender, "supports_host_tensor_indices"):
            sender.supports_host_tensor_indices = False


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Patch(spec.loader)
                return spec
        return None


sys.meta_path.insert(0, _Finder())
