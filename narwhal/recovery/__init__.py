"""Recovery: breakers, quarantine, health probes and ejection, restart holds, the monitor."""

from ._breaker import (
    RECORDED as RECORDED,
    TRANSITIONS as TRANSITIONS,
    Breaker as Breaker,
    BreakerEvent as BreakerEvent,
    BreakerSettings as BreakerSettings,
    BreakerState as BreakerState,
    Transition as Transition,
)
from ._evidence import (
    ContextReading as ContextReading,
    KeyCheck as KeyCheck,
    KeyRefusal as KeyRefusal,
    LoadSample as LoadSample,
    ModelRefusal as ModelRefusal,
    Prober as Prober,
    ProbeResult as ProbeResult,
    ScrapeError as ScrapeError,
    VerifyPair as VerifyPair,
    VerifyResult as VerifyResult,
)
from ._expose import (
    RecentChange as RecentChange,
    RecoverySection as RecoverySection,
    VerificationReport as VerificationReport,
)
from ._health import (
    HealthTracker as HealthTracker,
    Identity as Identity,
    IdentityTracker as IdentityTracker,
    ResidualWindow as ResidualWindow,
    RestartHold as RestartHold,
    Verdict as Verdict,
    VerdictChange as VerdictChange,
)
from ._legs import Predictor as Predictor
from ._load import METRICS_BODY_LIMIT as METRICS_BODY_LIMIT, parse_load as parse_load
from ._monitor import (
    EngineObservation as EngineObservation,
    Monitor as Monitor,
    MonitorPass as MonitorPass,
    MonitorSection as MonitorSection,
    PassHandler as PassHandler,
)
from ._probe import HttpProber as HttpProber
from ._record import EngineRecovery as EngineRecovery, LegObservation as LegObservation
from ._service import Recovery as Recovery
