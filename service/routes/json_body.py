"""The route class of every route that takes a JSON body: the body is read as JSON whatever
its content type says. `curl -d '{...}'` without `-H 'content-type: application/json'` sends
a form's content type, and Ollama's documentation and clients send bodies that way; a body
that is not JSON is still refused (400, "body is not valid JSON")."""

from __future__ import annotations

from typing import Awaitable, Callable

from fastapi import Request
from fastapi.responses import Response
from fastapi.routing import APIRoute


class JSONBodyRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handler = super().get_route_handler()

        async def as_json(request: Request) -> Response:
            headers = [(k, v) for k, v in request.scope["headers"] if k.lower() != b"content-type"]
            request.scope["headers"] = [*headers, (b"content-type", b"application/json")]
            return await handler(request)

        return as_json
