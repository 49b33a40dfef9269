"""Admission: the global gate and queue, retries, and (with profiles) TTFT pricing."""

from ._gate import AdmissionGate as AdmissionGate, GateStatistics as GateStatistics
from ._pricing import (
    NO_ALLOWANCE as NO_ALLOWANCE,
    Allowance as Allowance,
    BacklogBook as BacklogBook,
    DecodeCurve as DecodeCurve,
    DecodeSide as DecodeSide,
    ErrorStatistics as ErrorStatistics,
    FirstTokenLag as FirstTokenLag,
    KvTurnover as KvTurnover,
    PathQuote as PathQuote,
    PrefillCurve as PrefillCurve,
    Priced as Priced,
    ProfileSource as ProfileSource,
    ProjectionErrors as ProjectionErrors,
    Verdict as Verdict,
    WindowStatistics as WindowStatistics,
    band_label as band_label,
    cached_prefill_s as cached_prefill_s,
    credited_prefill_s as credited_prefill_s,
    error_band as error_band,
    judge as judge,
    placement_policy as placement_policy,
    price_fleet as price_fleet,
    quote_paths as quote_paths,
    shared_overhead_s as shared_overhead_s,
    ttft_budget_s as ttft_budget_s,
    unstreamed_tokens as unstreamed_tokens,
)
from ._retry import (
    RetryBudget as RetryBudget,
    backoff_ceiling as backoff_ceiling,
    full_jitter as full_jitter,
)
