"""Engine profiles: the measured latency models every prediction in Narwhal prices with.

Pure: no trio and no I/O, except `load_profiles`/`read_document`/`save_profiles` (blocking
file access).
`narwhal-profile` measures and writes the store; `narwhal-check` verifies the fleet and
may record measured facts (verified KV lease, crossed-handoff p99) into it.
"""

from ._fit import FitError as FitError
from ._models import (
    CachedPoint as CachedPoint,
    CachedPrefill as CachedPrefill,
    DecodeModel as DecodeModel,
    DecodePoint as DecodePoint,
    EngineProfile as EngineProfile,
    HandoffBucket as HandoffBucket,
    HandoffProfile as HandoffProfile,
    HandoffSample as HandoffSample,
    PrefillModel as PrefillModel,
    Quantile as Quantile,
    build_identity as build_identity,
    cached_prefill as cached_prefill,
    fit_decode as fit_decode,
    fit_prefill as fit_prefill,
    handoff_profile as handoff_profile,
)
from ._pricing import (
    DecodeCorrection as DecodeCorrection,
    Projection as Projection,
    backlog_s as backlog_s,
    corrected_idle_floor_s as corrected_idle_floor_s,
    decode_load as decode_load,
    projected_interval_s as projected_interval_s,
    projected_ttft_s as projected_ttft_s,
)
from ._quality import (
    POOR_FIT_RESIDUAL_P90 as POOR_FIT_RESIDUAL_P90,
    PoorFit as PoorFit,
    poor_fits as poor_fits,
)
from ._source import FleetProfiles as FleetProfiles
from ._store import (
    SCHEMA_VERSION as SCHEMA_VERSION,
    MeasuredFacts as MeasuredFacts,
    ProfileCheck as ProfileCheck,
    ProfileStore as ProfileStore,
    StoreBusy as StoreBusy,
    StoreDocument as StoreDocument,
    check_document as check_document,
    check_store as check_store,
    crossed_pairs as crossed_pairs,
    load_profiles as load_profiles,
    lock_store as lock_store,
    parse_document as parse_document,
    pd_server as pd_server,
    read_document as read_document,
    read_store as read_store,
    save_profiles as save_profiles,
    store_from_json as store_from_json,
    store_to_json as store_to_json,
    verify_builds as verify_builds,
    without_connector as without_connector,
)
