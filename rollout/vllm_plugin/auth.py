"""A bearer-token guard over every route of a vLLM server, loaded with vLLM's own `--middleware` option.

vLLM's `--api-key` guards only /v1, /v2, /inference and /cohere: the weight-update routes (/pause,
/update_weights, /collective_rpc, ...) stay open to anyone who reaches the port. A worker with
rollout.api_key set (required for a bind beyond loopback) starts vLLM with this middleware, which asks
every request except GET /health (the router's liveness probe) for `Authorization: Bearer <key>`. The
key comes from the environment (KEY_ENV), never from the command line where `ps` would show it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from typing import Any

KEY_ENV = "SLIPSTREAM_VLLM_API_KEY"
MIDDLEWARE = "rollout.vllm_plugin.auth.RequireBearer"
OPEN_PATHS = ("/health",)


class RequireBearer:
    """Pure ASGI middleware: 401 for a request without the right bearer token."""

    def __init__(self, app: Any) -> None:
        key = os.environ.get(KEY_ENV, "")
        if not key:
            raise RuntimeError(f"{MIDDLEWARE} needs the key in ${KEY_ENV} (rollout.api_key)")
        self.app = app
        self.expected = hashlib.sha256(f"Bearer {key}".encode()).digest()

    def _authorized(self, scope: dict[str, Any]) -> bool:
        given = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), b"")
        return hmac.compare_digest(hashlib.sha256(given).digest(), self.expected)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket") or scope["path"] in OPEN_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = json.dumps(
            {
                "error": {
                    "message": "missing or wrong bearer token (rollout.api_key)",
                    "type": "unauthorized",
                    "code": 401,
                }
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")],
            }
        )
        await send({"type": "http.response.body", "body": body})
