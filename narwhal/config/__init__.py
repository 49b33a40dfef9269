"""Narwhal configuration: the model, its rules and the JSON loader."""

from ._describe import FieldDoc as FieldDoc, describe_fields as describe_fields
from ._diff import (
    RESTART_REQUIRED as RESTART_REQUIRED,
    Change as Change,
    PlanReport as PlanReport,
    ReloadEffect as ReloadEffect,
    ReloadPlan as ReloadPlan,
    RoleChange as RoleChange,
    diff as diff,
    keep_running as keep_running,
    reload_effect as reload_effect,
)
from ._load import (
    ConfigError as ConfigError,
    config_to_dict as config_to_dict,
    load_config as load_config,
    load_config_file as load_config_file,
    load_ctl_socket as load_ctl_socket,
)
from ._model import (
    Breaker as Breaker,
    Cache as Cache,
    Cluster as Cluster,
    Config as Config,
    Controller as Controller,
    Ctl as Ctl,
    Engine as Engine,
    EngineSpec as EngineSpec,
    Health as Health,
    KvEvents as KvEvents,
    Listen as Listen,
    Log as Log,
    Profiles as Profiles,
    Reactive as Reactive,
    Recovery as Recovery,
    Secret as Secret,
    Serving as Serving,
    Slo as Slo,
    Thresholds as Thresholds,
)
from ._resolve import config_folder as config_folder, resolve_paths as resolve_paths
