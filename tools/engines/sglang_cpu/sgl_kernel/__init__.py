"""A stand-in for SGLang's `sgl_kernel` on a CPU without a build of it (the tier's SGLang venv).

PyPI's `sgl-kernel`/`sglang-kernel` wheels are CUDA builds. With `SGLANG_USE_CPU_ENGINE=1`,
SGLang 0.5.23 imports a few dozen `*_cpu` functions from `sgl_kernel` when its modules load,
but on a CPU without AMX every hot path falls back to torch-native code, and the text path
calls exactly one of them: `assign_req_to_token_pool_cpu`, written here in plain torch. Every
other name imports (SGLang's modules must load) and raises when called, naming itself, so a
path that needs a real kernel fails loudly instead of computing something else.

Installed into the venv by tools/engines/sglang-venv.sh, which also checks that SGLang still
imports this function from here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

__version__ = "0.0.0+narwhal.cpu.stand.in"


def assign_req_to_token_pool_cpu(
    req_pool_indices: Any,
    req_to_token: Any,
    start_offset: Any,
    end_offset: Any,
    out_cache_loc: Any,
    pool_len: int,
) -> None:
    """Write each request's new KV slots into its row of the request-to-token table.

    Request i (row `req_pool_indices[i]`) gets positions `start_offset[i]:end_offset[i]`,
    filled from `out_cache_loc`, which holds the new slots of all requests back to back in
    request order. `pool_len` is the row length (`req_to_token.shape[1]`).
    """
    lengths = (end_offset - start_offset).tolist()
    rows = req_pool_indices.tolist()
    starts = start_offset.tolist()
    taken = 0
    for row, start, length in zip(rows, starts, lengths, strict=True):
        if start + length > pool_len:
            raise ValueError(
                f"assign_req_to_token_pool_cpu: slots {start}..{start + length} exceed the "
                f"row length {pool_len}"
            )
        req_to_token[row, start : start + length] = out_cache_loc[taken : taken + length].to(
            req_to_token.dtype
        )
        taken += length


def _missing(name: str) -> Callable[..., NoReturn]:
    def kernel(*_args: object, **_kwargs: object) -> NoReturn:
        raise NotImplementedError(
            f"sgl_kernel.{name} was called, but this venv has only Narwhal's CPU stand-in "
            "for sgl_kernel (tools/engines/sglang_cpu), which implements "
            "assign_req_to_token_pool_cpu alone"
        )

    kernel.__name__ = name
    return kernel


def __getattr__(name: str) -> Callable[..., NoReturn]:
    if name.startswith("__"):
        raise AttributeError(name)
    return _missing(name)
