"""The control socket: protocol, server (daemon side) and client (narwhalctl)."""

from ._client import (
    CtlProtocolError as CtlProtocolError,
    DaemonUnreachable as DaemonUnreachable,
    call as call,
)
from ._protocol import (
    FIELDS as FIELDS,
    MAX_REQUEST_BYTES as MAX_REQUEST_BYTES,
    MAX_RESPONSE_BYTES as MAX_RESPONSE_BYTES,
    PIN_ROLES as PIN_ROLES,
    CtlError as CtlError,
    CtlRequest as CtlRequest,
    LineBuffer as LineBuffer,
    parse_request as parse_request,
)
from ._server import (
    LOGGED_REFUSALS as LOGGED_REFUSALS,
    MAX_CONNECTIONS as MAX_CONNECTIONS,
    MAX_REQUESTS as MAX_REQUESTS,
    ControlServer as ControlServer,
    ControlSocketError as ControlSocketError,
    create_socket as create_socket,
    inspect_path as inspect_path,
    prepare_path as prepare_path,
)
