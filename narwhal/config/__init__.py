"""Narwhal configuration: the model, its rules and the JSON loader."""

from ._describe import FieldDoc as FieldDoc
from ._describe import describe_fields as describe_fields
from ._load import ConfigError as ConfigError
from ._load import config_to_dict as config_to_dict
from ._load import load_config as load_config
from ._load import load_config_file as load_config_file
from ._model import Breaker as Breaker
from ._model import Config as Config
from ._model import Controller as Controller
from ._model import Ctl as Ctl
from ._model import Engine as Engine
from ._model import EngineSpec as EngineSpec
from ._model import Health as Health
from ._model import Listen as Listen
from ._model import Log as Log
from ._model import Profiles as Profiles
from ._model import Reactive as Reactive
from ._model import Recovery as Recovery
from ._model import Serving as Serving
from ._model import Slo as Slo
from ._model import Thresholds as Thresholds
