"""What each engine has cached, as its KV cache events say (`EngineCaches`)."""

from ._service import (
    CachesSection as CachesSection,
    EngineCache as EngineCache,
    EngineCaches as EngineCaches,
    events_without_ids_warning as events_without_ids_warning,
)
