"""Reactive prefill/decode role control (docs/design.md#role-control).

The decision core (`decide` and everything it reads: snapshots, state, loads, demand)
is pure and imports no trio; `Controller` is the thin live wrapper the monitor loop
calls once per pass; `_fluid` is a fluid fleet model for replay and scenario tests.
"""

from ._apply import (
    FlipHistory as FlipHistory,
    FlipRecord as FlipRecord,
    MoveRejected as MoveRejected,
    RoleTarget as RoleTarget,
    apply_move as apply_move,
    check_move as check_move,
    flip_record as flip_record,
)
from ._controller import Controller as Controller, EngineSource as EngineSource
from ._decide import (
    CALLERS as CALLERS,
    GATES as GATES,
    REASONS as REASONS,
    RESULTS as RESULTS,
    Caller as Caller,
    Decision as Decision,
    FloorBreach as FloorBreach,
    FloorReport as FloorReport,
    Gate as Gate,
    Loads as Loads,
    Move as Move,
    Reason as Reason,
    Result as Result,
    Split as Split,
    decide as decide,
    live_split as live_split,
)
from ._demand import (
    Arrival as Arrival,
    DemandEstimate as DemandEstimate,
    DemandEstimator as DemandEstimator,
    EvidenceView as EvidenceView,
    EvidenceWindow as EvidenceWindow,
    demand_rising as demand_rising,
    evidence_view as evidence_view,
    pricing_demand as pricing_demand,
)
from ._expose import (
    ControllerCounters as ControllerCounters,
    ControllerSection as ControllerSection,
    Evaluation as Evaluation,
    Exposure as Exposure,
    FlipEntry as FlipEntry,
    RoleMove as RoleMove,
    SplitCounts as SplitCounts,
    controller_gauges as controller_gauges,
    counter_families as counter_families,
    flip_entry as flip_entry,
    state_section as state_section,
)
from ._fluid import (
    AffineDecode as AffineDecode,
    FluidFleet as FluidFleet,
    FluidRequest as FluidRequest,
    FluidRun as FluidRun,
    Phase as Phase,
    QuadraticPrefill as QuadraticPrefill,
    StaticProfile as StaticProfile,
    Step as Step,
    run_fluid as run_fluid,
    synthetic_trace as synthetic_trace,
)
from ._load import (
    NO_CAPACITY as NO_CAPACITY,
    DecodeDemand as DecodeDemand,
    DecodeProjection as DecodeProjection,
    PrefillDemand as PrefillDemand,
    ResidentWork as ResidentWork,
    SplitLoad as SplitLoad,
    corrected_idle_floor as corrected_idle_floor,
    decode_load as decode_load,
    improves as improves,
    prefill_load as prefill_load,
    project_decode as project_decode,
    project_prefill as project_prefill,
)
from ._profile import (
    DecodeCost as DecodeCost,
    EngineProfiles as EngineProfiles,
    MeanProfile as MeanProfile,
    PrefillCost as PrefillCost,
    Profile as Profile,
)
from ._snapshot import (
    EngineSnapshot as EngineSnapshot,
    FleetSnapshot as FleetSnapshot,
    engine_decode_load as engine_decode_load,
    measured_decode_load as measured_decode_load,
    measured_prefill_pressure as measured_prefill_pressure,
    prefill_work_s as prefill_work_s,
)
from ._state import (
    CandidateKey as CandidateKey,
    ControllerState as ControllerState,
    initial_state as initial_state,
)
