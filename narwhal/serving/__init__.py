"""The serving side: the ASGI apps (clients', admin), the request flow and the HTTP server."""

from ._app import AdminApp as AdminApp, App as App
from ._connections import OpenConnections as OpenConnections
from ._context import (
    DecodeGaps as DecodeGaps,
    RequestRecord as RequestRecord,
    ServingContext as ServingContext,
)
from ._context_check import (
    ContextRule as ContextRule,
    context_rule as context_rule,
    output_bound as output_bound,
)
from ._descriptors import (
    ADMIN_MAX_CONNECTIONS as ADMIN_MAX_CONNECTIONS,
    DescriptorBudget as DescriptorBudget,
    DescriptorLimitError as DescriptorLimitError,
    OpenFileLimit as OpenFileLimit,
    capped_warning as capped_warning,
)
from ._lag import LagStatistics as LagStatistics
from ._server import serve_app as serve_app
from ._state import (
    EngineSection as EngineSection,
    StateDocument as StateDocument,
    full_state_document as full_state_document,
    state as state,
    state_document as state_document,
)
