"""What the HTTP server checks before a route runs: the API keys and the body size.

Keys as SGLang has them: with `--api-key` every route needs `Authorization: Bearer <key>` (or
`x-api-key: <key>`, as Anthropic's client sends it); with
`--admin-api-key` the admin routes (ADMIN_PATHS) need that key instead (and the normal key does not
open them); health, readiness and metrics probes stay open, so Kubernetes and Prometheus need no
secret. Comparison is constant-time; a refusal is a 401 that never echoes the key. A body over
--max-request-bytes is a 413 before it is read to the end. Both answer in OpenAI's error shape
(http_common.openai_error_body), Anthropic's on /v1/messages, and run as plain ASGI middleware, so streamed
responses and client disconnects pass through untouched.
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any

import orjson

from srt.http_common import anthropic_error_body, openai_error_body

ADMIN_PATHS = (  # SGLang's admin-level routes that srt has
    "/flush_cache",
    "/update_weights_from_disk",
    "/update_weight_version",
    "/pause_generation",
    "/continue_generation",
    "/hicache/storage-backend/clear",
)
OPEN_PREFIXES = ("/health", "/ready", "/metrics")  # probes: never behind a key (as SGLang)

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


ANTHROPIC_PREFIX = "/v1/messages"  # answered in Anthropic's error shape


def _key_matches(authorization: str | None, x_api_key: str | None, key: str) -> bool:
    if x_api_key and secrets.compare_digest(x_api_key.strip().encode(), key.encode()):
        return True
    if not authorization:
        return False
    scheme, _, token = authorization.partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), key.encode())


def auth_refusal(
    path: str,
    method: str,
    authorization: str | None,
    api_key: str | None,
    admin_api_key: str | None,
    x_api_key: str | None = None,
) -> str | None:
    """Why the request may not pass (a 401), or None. Pure: the tests call it directly."""
    if method == "OPTIONS" or path.startswith(OPEN_PREFIXES):
        return None
    if path in ADMIN_PATHS and admin_api_key:
        if _key_matches(authorization, x_api_key, admin_api_key):
            return None
        return "this route needs the admin API key"
    if api_key and not _key_matches(authorization, x_api_key, api_key):
        return (
            "a valid API key is required (Authorization: Bearer <key>, or x-api-key)"
            if authorization or x_api_key
            else "an API key is required (Authorization: Bearer <key>, or x-api-key)"
        )
    return None


async def _reply(
    send: Send, status: int, body: dict[str, Any], headers: Sequence[tuple[bytes, bytes]] = ()
) -> None:
    payload = orjson.dumps(body)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload})


class RequestGuard:
    """ASGI middleware: the key check, then the body-size cap."""

    def __init__(
        self, app: ASGIApp, api_key: str | None, admin_api_key: str | None, max_body_bytes: int
    ) -> None:
        self.app = app
        self.api_key = api_key
        self.admin_api_key = admin_api_key
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        refusal = auth_refusal(
            scope["path"],
            scope["method"],
            headers.get("authorization"),
            self.api_key,
            self.admin_api_key,
            headers.get("x-api-key"),
        )
        if refusal is not None:
            if scope["path"].startswith(ANTHROPIC_PREFIX):
                body = anthropic_error_body(401, refusal)
            else:
                body = openai_error_body(401, refusal, code="invalid_api_key")
            await _reply(send, 401, body, [(b"www-authenticate", b"Bearer")])
            return
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            await self._too_large(send)
            return
        await self.app(scope, self._counting(receive, send), send)

    def _counting(self, receive: Receive, send: Send) -> Receive:
        """receive() that stops a chunked body at the cap (the route then sees a disconnect)."""
        seen = 0
        cap = self.max_body_bytes

        async def counted() -> MutableMapping[str, Any]:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > cap:
                    raise BodyTooLarge(cap)
            return message

        return counted

    async def _too_large(self, send: Send) -> None:
        await _reply(send, 413, too_large_body(self.max_body_bytes))


class BodyTooLarge(Exception):
    def __init__(self, cap: int) -> None:
        super().__init__(f"the request body is over --max-request-bytes ({cap})")
        self.cap = cap


def too_large_body(cap: int) -> dict[str, Any]:
    return openai_error_body(413, f"the request body is over --max-request-bytes ({cap} bytes)", code=413)
