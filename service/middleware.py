"""The outermost ASGI layer: request ids, the body limit, timing headers, request metrics and,
where tracing is configured, each request's span (service.tracing).

It runs before FastAPI parses anything, so a body over `max_body_bytes` is refused with 413
after reading at most that many bytes (a declared Content-Length is refused unread), and
it sees every response, errors included, to stamp `x-request-id` and `x-total-time-ms`
and to count `clusterserve_requests_total{endpoint, method, code}`. An exception that
escapes a route is answered here as a JSON 500 (a bug, never a bad request).
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from typing import Any

from opentelemetry.trace import Span
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import shaped_error
from .logs import log_request
from .metrics import INFERENCE_ENDPOINTS, NO_METHOD, OTHER_ENDPOINTS, Metrics
from .tracing import Tracing, finish_request_span

log = logging.getLogger("clusterserve")

# Keys this middleware (and routes) leave in the ASGI scope.
REQUEST_ID_KEY = "clusterserve.request_id"
ARRIVAL_KEY = "clusterserve.arrival"  # time.monotonic() when the request arrived
METHOD_KEY = "clusterserve.method"  # attention method, set by the embedding routes
MODEL_KEY = "clusterserve.model"  # the served model that took an embedding request

# Response headers copied into the access line (timings and size; nothing the client sent).
_LOGGED_HEADERS = {
    b"x-input-tokens": b"tokens",
    b"x-queue-time-ms": b"queue_ms",
    b"x-inference-time-ms": b"inference_ms",
}
_KNOWN_ENDPOINTS = frozenset(INFERENCE_ENDPOINTS + OTHER_ENDPOINTS)
_CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


class RequestMiddleware:
    def __init__(self, app: ASGIApp, metrics: Metrics, max_body_bytes: int, tracing: Tracing | None = None) -> None:
        self.app = app
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.tracing = tracing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.tracing is None or not self.tracing.enabled:
            await self._serve(scope, receive, send, None)
            return
        with self.tracing.request_span(scope) as span:
            await self._serve(scope, receive, send, span)

    async def _serve(self, scope: Scope, receive: Receive, send: Send, span: Span | None) -> None:
        arrival = time.monotonic()
        request_id = _request_id(scope)
        scope[REQUEST_ID_KEY] = request_id
        scope[ARRIVAL_KEY] = arrival
        status = 500
        started = False
        sent_headers: dict[bytes, bytes] = {}

        async def send_with_headers(message: Message) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                status, started = message["status"], True
                headers = list(message.get("headers", []))
                sent_headers.update((k.lower(), v) for k, v in headers if k.lower() in _LOGGED_HEADERS)
                headers.append((b"x-request-id", request_id.encode()))
                headers.append((b"x-total-time-ms", f"{(time.monotonic() - arrival) * 1e3:.3f}".encode()))
                message = {**message, "headers": headers}
            await send(message)

        try:
            body_or_error = await self._read_body(scope, receive)
            if body_or_error is None:  # the client went away while sending
                return
            if isinstance(body_or_error, tuple):
                code, reason, message = body_or_error
                self.metrics.failures.labels(reason=reason).inc()
                await _send_json(send_with_headers, *shaped_error(scope.get("path", ""), code, message, None))
                return
            await self.app(scope, _replay(body_or_error, receive), send_with_headers)
        except Exception:
            log.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            self.metrics.failures.labels(reason="internal").inc()
            if not started:
                await _send_json(send_with_headers, *shaped_error(scope.get("path", ""), 500, "internal server error", None))
        finally:
            self._record(scope, request_id, status, time.monotonic() - arrival, sent_headers)
            if span is not None:
                method = scope.get(METHOD_KEY)
                finish_request_span(span, scope.get("method", ""), getattr(scope.get("route"), "path", None), status, {
                    "clusterserve.request_id": request_id, "clusterserve.attention.requested": method,
                })  # fmt: skip

    def _record(self, scope: Scope, request_id: str, status: int, total_s: float, sent_headers: dict[bytes, bytes]) -> None:
        """Count and time the answered request, and write its access line."""
        route = scope.get("route")
        path = getattr(route, "path", None)
        endpoint = path if path in _KNOWN_ENDPOINTS else "other"
        method = scope.get(METHOD_KEY, NO_METHOD)
        self.metrics.requests.labels(endpoint=endpoint, method=method, code=str(status)).inc()
        self.metrics.request_duration.labels(endpoint=endpoint, method=method).observe(total_s)
        if MODEL_KEY in scope:
            self.metrics.model_requests.labels(model=scope[MODEL_KEY], code=str(status)).inc()
        logged = {
            name.decode(): sent_headers[key].decode("latin-1") for key, name in _LOGGED_HEADERS.items() if key in sent_headers
        }
        log_request(
            {
                "request_id": request_id,
                "http_method": scope.get("method"),
                "route": endpoint,
                "path": scope.get("path"),
                "status": status,
                "attention": None if method == NO_METHOD else method,
                **logged,
                "total_ms": round(total_s * 1e3, 3),
            }
        )

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes | tuple[int, str, str] | None:
        """The whole body, an (status, reason, message) refusal, or None on disconnect."""
        limit = self.max_body_bytes
        declared = _header(scope, b"content-length")
        if declared is not None:
            if not declared.isdigit():
                return 400, "malformed_json", "Content-Length is not a number"
            if int(declared) > limit:
                return 413, "body_too_large", f"body of {int(declared)} bytes is more than the limit of {limit}"
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return 413, "body_too_large", f"body is more than the limit of {limit} bytes"
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that yields the buffered body once, then defers to the client's (disconnects)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value.decode("latin-1").strip()
    return None


def _request_id(scope: Scope) -> str:
    sent = _header(scope, b"x-request-id")
    if sent is not None and _CLIENT_REQUEST_ID.fullmatch(sent):
        return sent
    return uuid.uuid4().hex


async def _send_json(send: Send, status: int, body: dict[str, Any]) -> None:
    payload = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": payload})
