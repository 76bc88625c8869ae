"""GET /metrics: the Prometheus text format of this app's registry."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..state import get_state

router = APIRouter(tags=["metrics"])


@router.get("/metrics", response_class=Response)
async def metrics(request: Request) -> Response:
    state = get_state(request)
    device = state.encoder.device if state.encoder is not None else None
    state.metrics.update_memory(device)
    state.metrics.update_graphs(state.encoder.graphs if state.encoder is not None else None)
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
