"""POST /embed and POST /: Text Embeddings Inference's embed API, plus the `attention`,
`adapter` and `fidelity` extensions.

The root route is TEI's too: the same body and answers as /embed, so that clients which post
to the server's URL as given (huggingface_hub's `InferenceClient(model=URL).feature_extraction`,
LangChain's `HuggingFaceEndpointEmbeddings`) get vectors.

Returns a bare `[[float]]`, one row per input; the resolved attention is in `x-attention`,
the prompt the texts got (sent as `prompt_name`, or the model's default) in `x-prompt-name`,
the task adapter that ran in `x-adapter`, and with `"fidelity": true` each input's cosine to
the exact embedding in `x-fidelity` (comma-separated, input order).
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
@router.post(
    "/",
    response_model=list[list[float]],
    responses=ERROR_RESPONSES,
    dependencies=[Depends(require_api_key)],
    summary="Tei Embed (TEI's root route: the same as /embed)",
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
        body.prompt_name,
        body.adapter,
    )
    embedded = await embed(request, body.inputs, options)
    return JSONResponse(embedded.vectors.tolist(), headers=embedded.headers())
