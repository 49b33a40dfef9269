"""Engine-facing I/O: the HTTP transport and the dialects' wire formats."""

from ._dialects import (
    ENDPOINT_PATHS as ENDPOINT_PATHS,
    SGLANG as SGLANG,
    SGLANG_DEFAULT_BOOTSTRAP_PORT as SGLANG_DEFAULT_BOOTSTRAP_PORT,
    VLLM as VLLM,
    Dialect as Dialect,
    EndpointKind as EndpointKind,
    Json as Json,
    dialect_for as dialect_for,
    release as release,
)
from ._errors import EngineErrorInfo as EngineErrorInfo, parse_error_body as parse_error_body
from ._sse import SseEvent as SseEvent, SseKind as SseKind, SseScanner as SseScanner
from ._transport import (
    Connect as Connect,
    ConnectError as ConnectError,
    ConnectionPool as ConnectionPool,
    PoolStatistics as PoolStatistics,
    PoolTimeout as PoolTimeout,
    RemoteProtocolError as RemoteProtocolError,
    Response as Response,
    ResponseTooLarge as ResponseTooLarge,
    TransportError as TransportError,
)
