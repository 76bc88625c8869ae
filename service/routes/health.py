"""Liveness and readiness. Both answer from the event loop without touching the model, so
they never wait behind inference (which runs on the scheduler's worker thread)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from .. import errors
from ..schemas import ErrorResponse
from ..state import get_state

router = APIRouter(tags=["health"])

_NOT_READY = {503: {"model": ErrorResponse, "description": "loading, failed to load, or draining"}}


@router.get("/health/live")
async def live(request: Request) -> JSONResponse:
    """200 while the process serves HTTP; 503 only if the model failed to load (restart it)."""
    state = get_state(request)
    if state.load_error is not None:
        return errors.error_response(errors.not_ready(f"the model failed to load: {state.load_error}"))
    return JSONResponse({"status": "live"})


@router.get("/health/ready", responses=_NOT_READY)
async def ready(request: Request) -> JSONResponse:
    """200 once the model is loaded and warmed up; 503 before, after a failed load, and while draining."""
    try:
        get_state(request).require_ready()
    except errors.ServiceError as exc:
        return errors.error_response(exc)
    return JSONResponse({"status": "ready"})


@router.get("/health", responses=_NOT_READY)
async def health(request: Request) -> JSONResponse:
    """The same as /health/ready (the path TEI and most load balancers probe)."""
    return await ready(request)
