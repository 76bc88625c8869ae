"""POST /embed: Text Embeddings Inference's embed API, plus the `attention` extension.

Returns a bare `[[float]]`, one row per input; the resolved attention is in `x-attention`,
and with `"fidelity": true` each input's cosine to the exact embedding is in `x-fidelity`
(comma-separated, input order).
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from ..auth import require_api_key
from ..pipeline import EmbedOptions, embed
from ..schemas import ERROR_RESPONSES, EmbedRequest

router = APIRouter(tags=["tei"])


@router.post(
    "/embed",
    response_model=list[list[float]],
    responses=ERROR_RESPONSES,
    dependencies=[Depends(require_api_key)],
)
async def tei_embed(body: EmbedRequest, request: Request) -> JSONResponse:
    options = EmbedOptions(
        "inputs",
        body.attention,
        body.truncate,
        body.truncation_direction,
        body.normalize,
        body.dimensions,
        body.fidelity,
    )
    embedded = await embed(request, body.inputs, options)
    return JSONResponse(embedded.vectors.tolist(), headers=embedded.headers())
