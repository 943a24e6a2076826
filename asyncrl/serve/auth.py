"""The API key check (``asyncrl serve --api-key``) as pure ASGI middleware.

Pure ASGI rather than ``@app.middleware("http")``: Starlette's ``BaseHTTPMiddleware`` runs each
request's app in a new anyio task group and re-streams its response through a memory stream,
where py-spy put about a third of the event loop's samples at 256 concurrent requests
(bench/RESULTS.md); Starlette's docs recommend pure ASGI middleware where speed matters.
"""
from __future__ import annotations

import json


class ApiKey:
    """401 with an OpenAI error body on ``/v1/*`` unless ``Authorization: Bearer <key>``."""

    def __init__(self, app, key: str, prefix: str = "/v1/"):
        self.app, self.prefix = app, prefix
        self.expected = f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope.get("path", "").startswith(self.prefix):
            if dict(scope.get("headers") or []).get(b"authorization", b"") != self.expected:
                return await self._refuse(send)
        return await self.app(scope, receive, send)

    @staticmethod
    async def _refuse(send) -> None:
        payload = json.dumps({"error": {"message": "invalid API key (send 'Authorization: Bearer <key>')",
                                        "type": "authentication_error", "param": None,
                                        "code": "invalid_api_key"}}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})
