"""The container's HEALTHCHECK: GET /health on the client listener; exit 0 on 200, else 1.

Reads listen.host and listen.port from the config (NARWHAL_CONFIG, default
/etc/narwhal/narwhal.json) with the standard library only, so a check costs a few
milliseconds and no Narwhal import. A wildcard host (0.0.0.0, ::, "") is asked on loopback.
/health answers 503 while the daemon is degraded or shutting down, and needs no API key.
"""

from __future__ import annotations

import http.client
import json
import os
import sys

CONFIG = os.environ.get("NARWHAL_CONFIG", "/etc/narwhal/narwhal.json")
WILDCARDS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


def main() -> int:
    try:
        with open(CONFIG, encoding="utf-8") as file:
            listen = json.load(file).get("listen", {})
        host = str(listen.get("host", "127.0.0.1")).strip()
        host = WILDCARDS.get(host, host)
        connection = http.client.HTTPConnection(host, int(listen.get("port", 8000)), timeout=4)
        connection.request("GET", "/health")
        response = connection.getresponse()
        body = response.read(4096).decode("utf-8", "replace")
    except (OSError, ValueError, http.client.HTTPException) as exc:
        print(f"healthcheck: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(f"healthcheck: {response.status} {body.strip()}")
    return 0 if response.status == 200 else 1


if __name__ == "__main__":
    sys.exit(main())
