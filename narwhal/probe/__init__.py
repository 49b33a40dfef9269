"""Direct engine probes: narwhal-profile's sweep and narwhal-check's preflight.

Unlike `narwhal.profiles` this package does I/O: it drives engines over HTTP with the
router's own transport and dialect helpers, bypassing the router.
"""

from ._builds import with_live_builds as with_live_builds
from ._cached import (
    cached_law_warning as cached_law_warning,
    cached_summary as cached_summary,
    measure_cached_prefill as measure_cached_prefill,
)
from ._check import (
    CheckPlan as CheckPlan,
    CheckReport as CheckReport,
    CheckRow as CheckRow,
    format_table as format_table,
    metrics_row as metrics_row,
    run_check as run_check,
)
from ._client import (
    EngineClient as EngineClient,
    Gauges as Gauges,
    HandoffResult as HandoffResult,
    Identity as Identity,
    KvConnector as KvConnector,
    ProbeError as ProbeError,
    crossed_handoff as crossed_handoff,
    kv_connectors as kv_connectors,
)
from ._sweep import (
    SweepFailed as SweepFailed,
    SweepPlan as SweepPlan,
    carry_facts as carry_facts,
    measure_chars_per_token as measure_chars_per_token,
    measure_decode_point as measure_decode_point,
    measure_prefill as measure_prefill,
    ordered_pairs as ordered_pairs,
    profile_fleet as profile_fleet,
    wait_idle as wait_idle,
)
from ._texts import TextMaker as TextMaker
