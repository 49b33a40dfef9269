"""What a relayed engine stream carries, read by read, with no I/O
(docs/design.md#streaming-failures).

Owns
  `StreamMeter`: fed each read of an engine's event stream and the time it came, it
  says what goes to the client now and what is held, when the first generated token
  came, how many token events each read brought, the intervals between them, the
  engine's own `usage.completion_tokens`, and whether the stream is done. `GapLoad`:
  the engine's load over those intervals. The async relay around them
  (`_legs.relay`) only reads, sends and applies timers.

Invariants
  Only complete events are forwarded, so a terminal error event the router adds can
  never be glued onto half an engine line. Events before the first generated token
  (chat's role chunk, say) are held, bounded by serving.max_response_bytes, and sent
  with the first token; while the caller does not release output (an SGLang pair's
  prefill leg has not answered yet) everything is held. A usage-only chunk only the
  router asked for is dropped, never relayed. A read's token events share the time
  since the previous read as their intervals; the engine's final
  `usage.completion_tokens` rescales them to tokens (`outcome`). At most `MAX_GAPS`
  intervals are kept per stream.

Errors
  `feed` names what makes the stream fail as a `StreamFault` in its step (an error
  event, an event over the scanner's bound, held output over the limit) after
  accounting what came before it in the read; the relay raises it as a leg failure.
"""

from __future__ import annotations

import bisect
import json
import re
from typing import NamedTuple

from ..engines import SseEvent, SseKind, SseScanner
from ..engines._dialects import usage_cached_tokens, usage_tokens
from ..engines._sse import SseOverflow
from ..fleet import EngineLoad, EngineState, LoadStatistics
from ._context import DecodeGaps
from ._failure import FailureKind

# Gaps kept per stream for the decode correction; a window this size is plenty for a
# median, and it bounds the memory of very long generations.
MAX_GAPS = 256
# A usage object, not the `"usage": null` of every completions chunk.
_USAGE_OBJECT = re.compile(rb'"usage"\s*:\s*\{')


class StreamFault(NamedTuple):
    """Why a stream fails: `kind` and `detail`, or the engine's own error `event`."""

    kind: FailureKind
    detail: str
    event: SseEvent | None = None


class Step(NamedTuple):
    """What one read brought. `send`: the bytes for the client now, or None. `first`:
    the first generated token came in it. `tokens`: its token events from the first on,
    of which `gaps` intervals were kept. `fault`: the stream fails here."""

    send: bytes | None
    first: bool
    tokens: int
    gaps: int
    fault: StreamFault | None = None


class StreamMeter:
    __slots__ = (
        "_held",
        "_held_bytes",
        "_limit",
        "_own_usage",
        "_scanner",
        "done",
        "first_at",
        "gaps",
        "last_at",
        "reported",
        "reported_cached",
        "tokens",
    )

    def __init__(self, *, limit: int, own_usage: bool) -> None:
        self._limit = limit  # serving.max_response_bytes, for the output held back
        self._own_usage = own_usage  # the usage-only chunk is the router's, not relayed
        self._scanner = SseScanner()
        self._held: list[bytes] = []
        self._held_bytes = 0
        self.done = False  # [DONE] came
        self.first_at: float | None = None
        self.last_at = 0.0
        self.tokens = 0  # token events from the first token on
        self.gaps: list[float] = []  # decode token intervals, for the decode correction
        self.reported: int | None = None  # the engine's usage.completion_tokens
        # Its usage.prompt_tokens_details.cached_tokens, when it reports them.
        self.reported_cached: int | None = None

    @property
    def held(self) -> bool:
        return bool(self._held)

    def feed(self, chunk: bytes, now: float, *, release: bool) -> Step:
        """One read's bytes; `release`: output may go to the client now."""
        try:
            events = self._scanner.feed(chunk)
        except SseOverflow as exc:
            return Step(None, False, 0, 0, StreamFault(FailureKind.BAD_STREAM, str(exc)))
        out: list[bytes] = []
        first = False
        read_tokens = 0
        for event in events:
            kind = event.kind
            if kind is SseKind.ERROR:
                return Step(None, first, 0, 0, StreamFault(FailureKind.STREAM_ERROR, "", event))
            if kind is SseKind.DONE:
                self.done = True
            elif kind is SseKind.DATA:
                usage_only = False
                payload = event.payload
                if b'"usage"' in payload:  # cheaper than the search, and mostly absent
                    usage = usage_report(payload)
                    if usage is not None:
                        self.reported, usage_only, self.reported_cached = usage
                        if usage_only and self._own_usage:
                            continue
                if self.first_at is None and not usage_only and has_token(payload):
                    self.first_at = now
                    first = True
                if self.first_at is not None and not usage_only:
                    read_tokens += 1
            if self.first_at is None:
                self._held.append(event.raw)
                self._held_bytes += len(event.raw)
            else:
                out.append(event.raw)
            if self.done:
                break
        kept = 0
        if read_tokens:
            if self.tokens:
                kept = min(read_tokens, MAX_GAPS - len(self.gaps))
                self.gaps.extend([(now - self.last_at) / read_tokens] * kept)
            self.tokens += read_tokens
            self.last_at = now
        if self.first_at is None and self._held_bytes + self._scanner.pending > self._limit:
            detail = f"pre-output buffer exceeds serving.max_response_bytes={self._limit}"
            fault = StreamFault(FailureKind.HELD_TOO_LARGE, detail)
            return Step(None, first, read_tokens, kept, fault)
        if not out:
            return Step(None, first, read_tokens, kept)
        if not release:
            self._held.extend(out)
            return Step(None, first, read_tokens, kept)
        if self._held:
            out = [*self._held, *out]
            self._held = []
            self._held_bytes = 0
        return Step(b"".join(out), first, read_tokens, kept)

    def take_held(self) -> bytes:
        """The output still held when the stream ended, for the client."""
        held = b"".join(self._held)
        self._held = []
        self._held_bytes = 0
        return held

    def outcome(self, n: int) -> tuple[int, list[float]]:
        """The tokens the stream generated per sequence and its token intervals, rescaled
        to the engine's usage report where events carried several tokens each; no
        intervals for n > 1, whose sequences' events interleave within a decode step."""
        generated, gaps = self.tokens, self.gaps
        reported = self.reported
        if reported is not None and reported > self.tokens > 1:
            scale = (self.tokens - 1) / (reported - 1)
            gaps = [gap * scale for gap in gaps]
            generated = reported
        if n > 1:
            return generated // n, []
        return generated, gaps

    def tpot_s(self, generated: int) -> float | None:
        """Time per output token from the first token to the last read."""
        if generated > 1 and self.first_at is not None:
            return (self.last_at - self.first_at) / (generated - 1)
        return None


class GapLoad:
    """The engine's load over a stream's counted gaps, for `DecodeGaps`, and what else
    went into those gaps.

    A gap is the time between two reads shared by the tokens the second brought, so a
    client write that blocked the relay (or the router's loop, busy elsewhere) is spread
    over the tokens that piled up meanwhile, which is their rate, except where no more
    came: a stall that outlasted the stream inflates the gaps of the tokens the engine
    made during it, at most as many as fit in the stall. A stream whose longest write
    spans a quarter of its gaps' time or more is left out of latency residuals (`alone`);
    below that, the inflated gaps are too few to carry the median. (Dropping streams at
    any write longer than one gap would drop most of a busy router's, whose writes wait
    for the loop.) A prefill leg on the engine meanwhile (a `both` engine, or one the
    controller just moved) puts prefill chunks into the decode steps, which the decode
    profile does not model."""

    __slots__ = ("active", "kv_tokens", "longest_write_s", "max_active", "max_kv", "prefill")

    def __init__(self) -> None:
        self.active = 0
        self.kv_tokens = 0
        self.max_active = 0
        self.max_kv = 0
        self.prefill = False
        self.longest_write_s = 0.0

    def add(self, engine: EngineState, gaps: int, now: float) -> None:
        if gaps <= 0:
            return
        # The fleet's load, as pricing sees it (one replica's ledger is the fleet's).
        load: EngineLoad | LoadStatistics = (
            engine.load if engine.load_scale == 1 else engine.fleet_load(now)
        )
        active, kv = load.decode_active, load.decode_tokens
        self.active += gaps * active
        self.kv_tokens += gaps * kv
        self.max_active = max(self.max_active, active)
        self.max_kv = max(self.max_kv, kv)
        self.prefill = self.prefill or load.prefill_inflight > 0

    def summary(self, gaps: list[float]) -> DecodeGaps | None:
        """The stream's gaps and their load, summarised once for the serving signals and
        the leg observer; None without any gaps."""
        if not gaps:
            return None
        ordered = sorted(gaps)
        count = len(ordered)
        # Gaps are differences of readings of a clock that never goes back, so none is
        # negative: those that are not positive are the zeros, first in order.
        zeros = bisect.bisect_right(ordered, 0.0)
        return DecodeGaps(
            count=count,
            median_s=_sorted_median(ordered, 0),
            positive=count - zeros,
            positive_median_s=_sorted_median(ordered, zeros) if zeros < count else 0.0,
            mean_active=self.active / count,
            mean_kv_tokens=self.kv_tokens / count,
            max_active=self.max_active,
            max_kv_tokens=self.max_kv,
        )

    def alone(self, summary: DecodeGaps) -> bool:
        """Whether the gaps were the engine's decoding alone, for a latency residual."""
        return not self.prefill and self.longest_write_s * 4 < summary.median_s * summary.count


def _sorted_median(ordered: list[float], start: int) -> float:
    """`statistics.median(ordered[start:])` of a sorted list, without copying it."""
    size = len(ordered) - start
    middle = start + size // 2
    if size % 2:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) / 2


def has_token(payload: bytes) -> bool:
    """Whether a chunk carries generated output (not just chat's role announcement)."""
    try:
        document = json.loads(payload)
    except (ValueError, RecursionError):
        return True  # not ours to judge: the engine sent something, count it
    if not isinstance(document, dict):
        return True
    choices = document.get("choices")
    if not isinstance(choices, list):
        return False
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        if choice.get("text") or choice.get("finish_reason") or choice.get("token_ids"):
            return True
        delta = choice.get("delta")
        if isinstance(delta, dict) and any(
            delta.get(key)
            for key in ("content", "reasoning_content", "reasoning", "tool_calls", "function_call")
        ):
            return True
    return False


def usage_report(payload: bytes) -> tuple[int, bool, int | None] | None:
    """The `usage.completion_tokens` of an event that carries a usage object, whether
    the event is the usage-only chunk (`choices: []`), and the prompt's cached tokens
    when the engine reports them (`usage_cached_tokens`); None otherwise. Completions
    chunks carry `"usage": null`, so the value is looked at before anything is parsed."""
    if _USAGE_OBJECT.search(payload) is None:
        return None
    try:
        document = json.loads(payload)
    except (ValueError, RecursionError):
        return None
    count = usage_tokens(document, "completion_tokens")
    if count is None or count < 0:
        return None
    assert isinstance(document, dict)  # usage_tokens found a count in it
    return count, document.get("choices") == [], usage_cached_tokens(document)
