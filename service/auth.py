"""The API-key check: a FastAPI dependency on the embedding and tokenize routes."""

from __future__ import annotations

import hmac

from fastapi import Request

from . import errors
from .state import get_state


async def require_api_key(request: Request) -> None:
    """401 unless the configured key is sent as `Authorization: Bearer <key>` (no key configured:
    every request passes)."""
    key = get_state(request).settings.api_key
    if key is None:
        return
    scheme, _, sent = request.headers.get("authorization", "").partition(" ")
    expected = key.get_secret_value().encode()
    # compare_digest takes the same time wherever the strings differ: no timing oracle.
    if scheme.lower() != "bearer" or not hmac.compare_digest(sent.strip().encode(), expected):
        raise errors.unauthorized()
