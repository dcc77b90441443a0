"""Anthropic's error shape on the Messages routes (``/v1/messages`` and below): every error
answer there, whoever made it (a refusal of the route, pydantic's schema errors, the API key's
401, the body or header size limits, an unknown route or method, a bug's 500), becomes
``{"type": "error", "error": {"type", "message"}}`` with the same HTTP status and headers, the
type after Anthropic's names (:func:`.protocol_anthropic.error_type`). Other routes keep OpenAI's
shape."""

from __future__ import annotations

import json
import logging
from typing import Any, MutableMapping

from pagedserve.entrypoints.openai.http_common import internal_error
from pagedserve.entrypoints.openai.protocol_anthropic import anthropic_error_body

logger = logging.getLogger("pagedserve")

MESSAGES_PREFIX = "/v1/messages"


def _anthropic_body(status: int, body: bytes, headers: list) -> bytes:
    """The OpenAI error ``body`` of an answer with ``status`` in Anthropic's shape; a body of
    another shape (a 499's empty one) as it is."""
    try:
        parsed = json.loads(body)
        message = parsed["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return body
    overloaded = status == 503 and any(k.lower() == b"retry-after" for k, _ in headers)
    return json.dumps(anthropic_error_body(str(message), status, overloaded), ensure_ascii=False).encode()


class AnthropicErrorMiddleware:
    """Pure ASGI middleware, outermost: rewrites the error answers (status >= 400) of the paths
    under ``prefix`` into Anthropic's error shape; successful answers and streams pass through
    untouched. An exception that escapes the app before its answer started is a 500 here (it is
    logged with its traceback)."""

    def __init__(self, app: Any, prefix: str = MESSAGES_PREFIX) -> None:
        self.app = app
        self.prefix = prefix

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not (path == self.prefix or path.startswith(self.prefix + "/")):
            return await self.app(scope, receive, send)
        held: dict[str, Any] = {}  # the start of an error answer, until its body is complete
        chunks: list[bytes] = []
        started = False

        async def rewrite(message: MutableMapping[str, Any]) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if message["status"] < 400:
                    return await send(message)
                held.update(message)
                return None
            if not held or message["type"] != "http.response.body":
                return await send(message)
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return None
            headers = [(k, v) for k, v in held.get("headers", []) if k.lower() != b"content-length"]
            body = _anthropic_body(held["status"], b"".join(chunks), headers)
            await send({**held, "headers": headers + [(b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body, "more_body": False})

        try:
            await self.app(scope, receive, rewrite)
        except Exception as exc:
            if started:
                raise
            await internal_error(path, exc)(scope, receive, rewrite)
