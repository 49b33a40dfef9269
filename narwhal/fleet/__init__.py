"""The router's live engine registry."""

from ._auth import explain_refusal as explain_refusal, key_refused as key_refused
from ._engine import (
    EngineState as EngineState,
    EngineView as EngineView,
    Phase as Phase,
    PhaseGate as PhaseGate,
    Role as Role,
    control_share as control_share,
)
from ._fleet import Fleet as Fleet
from ._load import (
    Claim as Claim,
    EngineLoad as EngineLoad,
    Generated as Generated,
    LoadStatistics as LoadStatistics,
    SeenLoad as SeenLoad,
)
from ._model import model_refused as model_refused, names_model as names_model
from ._share import Share as Share
