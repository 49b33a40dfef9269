"""A workload with prefix structure: tenants' shared system prompts and multi-turn sessions.

Pure (numpy, no I/O). Times are model seconds, as in `workload`.

`build` turns an Azure trace and `SessionParams` into `SessionRequest`s:

* each of ``tenants`` tenants has one system prompt of ``system_tokens`` tokens, shared by
  every session of that tenant;
* a session has 1 + Geometric turns (mean ``mean_turns``, at most ``max_turns``); turn k's
  prompt is turn k-1's prompt, its answer, then the next user message, so every turn
  extends the last token for token;
* lengths come from consecutive trace requests: a session's final context is one trace
  request's prompt length (clipped to the context), split over its user messages; each
  answer (and the turn's ``max_tokens``) is one trace request's output length;
* sessions start at the trace's own arrival times scaled to ``sessions_per_s``; a next
  turn arrives ``think`` seconds (exponential, mean ``think_s``) after the previous one was
  sent (open loop, not waiting for its answer).

Prompts are text of one-token words (a space and 3-7 letters), so narwhal-sim's tokenizer
(`narwhal.sim.Tokenizer`) sees exactly the token ids the structure says are shared, and a
real tokenizer sees the same text shared. ``params.to_json()`` goes into a result file.
"""

from __future__ import annotations

import string
from typing import Any

import attrs
import numpy as np

from .workload import Limits, Trace

_LETTERS = np.array(list(string.ascii_lowercase))


@attrs.frozen(kw_only=True)
class SessionParams:
    sessions: int = 200
    tenants: int = 4
    system_tokens: int = 1024
    mean_turns: float = 4.0
    max_turns: int = 12
    think_s: float = 20.0
    # New sessions per model second (the trace's gaps, rescaled).
    sessions_per_s: float = 1.0
    seed: int = 0
    limits: Limits = attrs.Factory(Limits)

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


@attrs.frozen
class SessionRequest:
    at_s: float
    session: int
    turn: int
    tenant: int
    prompt: str
    # Words (= sim tokens) in the prompt, and in its prefix sent before: the previous
    # turn's prompt, or for a first turn the tenant's system prompt.
    prompt_words: int
    shared_words: int
    max_tokens: int


def _words(rng: np.random.Generator, n: int) -> list[str]:
    lengths = rng.integers(3, 8, size=n)
    letters = rng.choice(_LETTERS, size=int(lengths.sum()))
    out: list[str] = []
    pos = 0
    for length in lengths:
        out.append(" " + "".join(letters[pos : pos + length]))
        pos += int(length)
    return out


def build(trace: Trace, params: SessionParams) -> list[SessionRequest]:
    """Every request of the workload, sorted by arrival."""
    rng = np.random.default_rng(params.seed)
    limit = params.limits.max_model_len
    system = [_words(rng, params.system_tokens) for _ in range(params.tenants)]
    start = int(rng.integers(0, max(1, len(trace.t) - params.sessions * params.max_turns)))
    cursor = start
    gaps = np.diff(trace.t[start : start + params.sessions + 1])
    scale = (params.sessions / params.sessions_per_s) / max(float(gaps.sum()), 1e-9)
    starts = np.concatenate([[0.0], np.cumsum(gaps[: params.sessions - 1] * scale)])
    out: list[SessionRequest] = []
    for session in range(params.sessions):
        tenant = int(rng.integers(params.tenants))
        turns = min(int(rng.geometric(1.0 / params.mean_turns)), params.max_turns)
        outputs = np.clip(trace.output[cursor : cursor + turns], 1, params.limits.max_output)
        final = int(trace.prompt[cursor])
        cursor += turns
        # The context left for user messages once the system prompt, every answer and the
        # last turn's max_tokens are in.
        budget = limit - 1 - params.system_tokens - int(outputs.sum())
        if budget < turns:
            continue  # no room for this session in the context; the trace has others
        user_total = max(turns, min(final - params.system_tokens, budget))
        shares = rng.dirichlet(np.ones(turns)) * (user_total - turns)
        users = (1 + np.floor(shares)).astype(int)
        history = list(system[tenant])
        at = float(starts[session])
        shared = len(history)
        for turn in range(turns):
            history += _words(rng, int(users[turn]))
            out.append(
                SessionRequest(
                    at_s=at,
                    session=session,
                    turn=turn,
                    tenant=tenant,
                    prompt="".join(history),
                    prompt_words=len(history),
                    shared_words=shared,
                    max_tokens=int(outputs[turn]),
                )
            )
            shared = len(history)
            history += _words(rng, int(outputs[turn]))
            at += float(rng.exponential(params.think_s))
    out.sort(key=lambda r: r.at_s)
    return out


def shared_fraction(requests: list[SessionRequest]) -> float:
    """The share of all prompt tokens that an earlier request of the workload sent first
    (an upper bound on a cache's hit rate): system prompts after a tenant's first, and
    every turn's history."""
    seen_system: set[int] = set()
    shared = total = 0
    for r in sorted(requests, key=lambda r: r.at_s):
        total += r.prompt_words
        if r.turn or r.tenant in seen_system:
            shared += r.shared_words
        seen_system.add(r.tenant)
    return shared / total if total else 0.0
