"""Everything that runs beside the requests, under one nursery."""

from ._control import ProfilesUnavailable as ProfilesUnavailable
from ._notify import Notifier as Notifier
from ._operations import Operations as Operations
from ._preflight import Finding as Finding, Preflight as Preflight, preflight as preflight
from ._reload import (
    ReloadReport as ReloadReport,
    ReloadResult as ReloadResult,
    apply_config as apply_config,
)
from ._state import (
    STATE_SECTIONS as STATE_SECTIONS,
    ProfilesSection as ProfilesSection,
    SupervisorSection as SupervisorSection,
    profiles_section as profiles_section,
)
from ._supervisor import (
    CLEANUP_S as CLEANUP_S,
    ListenError as ListenError,
    Supervisor as Supervisor,
)
