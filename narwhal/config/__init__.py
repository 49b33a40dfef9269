"""Narwhal configuration: the model, its rules and the JSON loader."""

from ._model import (
    Breaker as Breaker,
    Config as Config,
    Controller as Controller,
    Ctl as Ctl,
    Engine as Engine,
    EngineSpec as EngineSpec,
    Health as Health,
    Listen as Listen,
    Log as Log,
    Profiles as Profiles,
    Reactive as Reactive,
    Recovery as Recovery,
    Serving as Serving,
    Slo as Slo,
    Thresholds as Thresholds,
)
