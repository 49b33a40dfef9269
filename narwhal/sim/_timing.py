"""The latency law of a simulated engine, as plain arithmetic.

Shapes and default coefficients are those of docs/design.md#simulated-latency (Llama-3-8B bf16 on
one H100, TP1). Everything here is in *model* seconds, i.e. at speed 1; the engine divides by its
speed factor when it sleeps.
"""

from __future__ import annotations

import math
import random
from typing import Any

import attrs


def _non_negative(_inst: object, attr: attrs.Attribute[Any], value: float) -> None:
    if value < 0:
        raise ValueError(f"{attr.name} is {value!r}; must be >= 0")


def _positive_int(_inst: object, attr: attrs.Attribute[Any], value: int) -> None:
    if value < 1:
        raise ValueError(f"{attr.name} is {value!r}; must be >= 1")


def _positive(_inst: object, attr: attrs.Attribute[Any], value: float) -> None:
    if not value > 0:
        raise ValueError(f"{attr.name} is {value!r}; must be > 0")


@attrs.frozen(kw_only=True)
class SimTiming:
    """Latency law and capacity of one simulated engine (seconds at speed 1).

    A forward pass ("step") costs

        step_base_s
        + Σ over prefill chunks [s, e):  prefill_token_s·(e−s) + prefill_quad_s·(e²−s²)
        + decode_kv_token_s·K + decode_seq_s·B

    where K is the KV held by the B requests that decode in the step. A step that only
    prefills one chunk [0, n) costs exactly ``a + b·n + c·n²``; a pure decode step costs
    exactly ``t0 + α·K + β·B``. The quadratic term is split as ``e² − s²`` so that the
    chunks of a long prompt add up to ``c·n²``; each chunk is a separate forward pass and so
    pays ``step_base_s`` again, as chunked prefill does on a real engine.
    """

    step_base_s: float = attrs.field(default=6.0e-3, validator=_non_negative)
    prefill_token_s: float = attrs.field(default=2.0e-5, validator=_non_negative)
    prefill_quad_s: float = attrs.field(default=7.0e-10, validator=_non_negative)
    decode_kv_token_s: float = attrs.field(default=4.4e-8, validator=_non_negative)
    decode_seq_s: float = attrs.field(default=3.0e-5, validator=_non_negative)
    # vLLM's max_num_batched_tokens: the per-step token budget that chunks long prompts.
    chunk_tokens: int = attrs.field(default=2048, validator=_positive_int)
    kv_capacity_tokens: int = attrs.field(default=450_000, validator=_positive_int)
    block_size: int = attrs.field(default=16, validator=_positive_int)
    max_model_len: int = attrs.field(default=8192, validator=_positive_int)
    max_num_seqs: int = attrs.field(default=256, validator=_positive_int)
    kv_bytes_per_token: int = attrs.field(default=131_072, validator=_non_negative)
    kv_link_bytes_per_s: float = attrs.field(default=50e9, validator=_positive)
    kv_transfer_base_s: float = attrs.field(default=5.0e-4, validator=_non_negative)
    # Multiplicative lognormal noise per step (and per transfer); 0 disables it.
    noise_sigma: float = attrs.field(default=0.05, validator=_non_negative)
    # Floor on a step's duration. The law never needs it; the zero law does, so that an
    # engine with work still sleeps between steps instead of spinning the CPU.
    min_step_s: float = attrs.field(default=0.0, validator=_non_negative)

    @classmethod
    def zero(cls, *, min_step_s: float = 1.0e-3) -> SimTiming:
        """An (almost) instant engine for measuring router overhead.

        Every latency term is 0 and there is no noise; steps still take ``min_step_s`` so a
        busy engine sleeps instead of spinning, which bounds its CPU use and its chunk rate.
        """
        return cls(
            step_base_s=0.0,
            prefill_token_s=0.0,
            prefill_quad_s=0.0,
            decode_kv_token_s=0.0,
            decode_seq_s=0.0,
            kv_transfer_base_s=0.0,
            kv_bytes_per_token=0,
            noise_sigma=0.0,
            min_step_s=min_step_s,
        )

    @property
    def total_blocks(self) -> int:
        return self.kv_capacity_tokens // self.block_size

    def prefill_law_s(self, n: int) -> float:
        """The closed-form prefill law ``a + b·n + c·n²`` (one forward pass, no chunking)."""
        return self.step_base_s + self.prefill_token_s * n + self.prefill_quad_s * n * n

    def chunk_cost_s(self, start: int, end: int) -> float:
        """Work of prefilling prompt positions [start, end) on top of a step's base cost."""
        return self.prefill_token_s * (end - start) + self.prefill_quad_s * (
            end * end - start * start
        )

    def prefill_s(self, n: int) -> float:
        """Prefill time of an n-token prompt on an idle engine, chunked as the engine does.

        Equals `prefill_law_s(n)` for n <= chunk_tokens; longer prompts pay one extra
        ``step_base_s`` per extra chunk.
        """
        if n <= 0:
            return max(self.step_base_s, self.min_step_s)
        total = 0.0
        start = 0
        while start < n:
            end = min(n, start + self.chunk_tokens)
            total += max(self.step_base_s + self.chunk_cost_s(start, end), self.min_step_s)
            start = end
        return total

    def decode_step_s(self, kv_tokens: float, batch: float) -> float:
        """A pure decode step: ``t0 + α·K + β·B``."""
        law = self.step_base_s + self.decode_kv_token_s * kv_tokens + self.decode_seq_s * batch
        return max(law, self.min_step_s)

    def step_s(self, chunk_cost_s: float, decode_kv_tokens: int, decode_batch: int) -> float:
        """A mixed step: base + prefill chunk work + decode terms (before noise)."""
        law = (
            self.step_base_s
            + chunk_cost_s
            + self.decode_kv_token_s * decode_kv_tokens
            + self.decode_seq_s * decode_batch
        )
        return max(law, self.min_step_s)

    def kv_transfer_s(self, tokens: int) -> float:
        """``0.5 ms + bytes / link bandwidth``, charged to TTFT on the decode side."""
        return self.kv_transfer_base_s + tokens * self.kv_bytes_per_token / self.kv_link_bytes_per_s


class Noise:
    """Seeded multiplicative lognormal noise with mean 1 (so the law stays unbiased)."""

    def __init__(self, sigma: float, seed: int | str) -> None:
        self._sigma = sigma
        self._mu = -0.5 * sigma * sigma
        self._rng = random.Random(seed)

    def __call__(self) -> float:
        if self._sigma == 0.0:
            return 1.0
        return self._rng.lognormvariate(self._mu, self._sigma)


def blocks_for(tokens: int, block_size: int) -> int:
    return math.ceil(tokens / block_size) if tokens > 0 else 0
