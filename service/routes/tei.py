"""POST /embed: Text Embeddings Inference's embed API, plus the `attention` extension.

Returns a bare `[[float]]`, one row per input; the resolved attention is in `x-attention`,
and with `"fidelity": true` each input's cosine to the exact embedding is in `x-fidelity`
(comma-separated, input order).
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from ..schemas import ERROR_RESPONSES, EmbedRequest
from .common import embed, require_api_key

router = APIRouter(tags=["tei"])


@router.post(
    "/embed",
    response_model=list[list[float]],
    responses=ERROR_RESPONSES,
    dependencies=[Depends(require_api_key)],
)
async def tei_embed(body: EmbedRequest, request: Request) -> JSONResponse:
    embedded = await embed(
        request,
        body.inputs,
        param="inputs",
        attention=body.attention,
        truncate=body.truncate,
        truncation_direction=body.truncation_direction,
        normalize=body.normalize,
        dimensions=body.dimensions,
        fidelity=body.fidelity,
    )
    return JSONResponse(embedded.vectors.tolist(), headers=embedded.headers())
