"""Narwhal configuration: the model, its rules and the JSON loader."""

from ._model import (
    Breaker as Breaker,
)
from ._model import (
    Config as Config,
)
from ._model import (
    Controller as Controller,
)
from ._model import (
    Ctl as Ctl,
)
from ._model import (
    Engine as Engine,
)
from ._model import (
    EngineSpec as EngineSpec,
)
from ._model import (
    Health as Health,
)
from ._model import (
    Listen as Listen,
)
from ._model import (
    Log as Log,
)
from ._model import (
    Profiles as Profiles,
)
from ._model import (
    Reactive as Reactive,
)
from ._model import (
    Recovery as Recovery,
)
from ._model import (
    Serving as Serving,
)
from ._model import (
    Slo as Slo,
)
from ._model import (
    Thresholds as Thresholds,
)
