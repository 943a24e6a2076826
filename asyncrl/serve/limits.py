"""Request limits of the server, and the ASGI middleware that enforces the body size.

The body is read (up to the limit) before any handler runs, so an oversize upload is refused
with 413 whether or not it declared a ``Content-Length``, and never reaches JSON parsing.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional


@dataclass
class ServeLimits:
    max_tokens: int = 4096            # per request (``max_tokens`` above it: 400)
    max_concurrent: int = 256         # generation requests in flight (beyond: 429)
    max_body_bytes: int = 1 << 20     # request body (beyond: 413)
    max_weight_bytes: int = 64 << 30  # body of POST /v1/update_weights (a safetensors blob)


def _too_large(limit: int) -> bytes:
    return json.dumps({"error": {"message": f"request body is over this server's limit of {limit} bytes",
                                 "type": "invalid_request_error", "param": None,
                                 "code": "request_too_large"}}).encode()


class BodyLimit:
    """Pure ASGI middleware: 413 for a body over ``max_bytes`` (``per_path`` overrides)."""

    def __init__(self, app, max_bytes: int, per_path: Optional[dict[str, int]] = None):
        self.app, self.max_bytes, self.per_path = app, max_bytes, per_path or {}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.per_path.get(scope.get("path", ""), self.max_bytes)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return await self._refuse(send, limit)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return await self._refuse(send, limit)
            chunks.append(chunk)
            more = message.get("more_body", False)
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: wait for the disconnect, as the server would
        return await self.app(scope, replay, send)

    @staticmethod
    async def _refuse(send, limit: int) -> None:
        payload = _too_large(limit)
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": payload})
