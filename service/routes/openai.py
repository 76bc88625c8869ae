"""POST /v1/embeddings: the OpenAI embeddings API, plus `attention`, `truncate`, `prompt_name`,
`adapter` and `fidelity`.

Token-id inputs are the model's vocabulary ids, used exactly as sent (no [CLS]/[SEP] is
added); texts get the model's special tokens. `model` and `user` are accepted and ignored:
the response names the served model. `encoding_format="base64"` (what the official client
asks for by default) is little-endian float32 bytes, base64-encoded, as OpenAI sends them.
With `"fidelity": true` each data item also carries `fidelity`, the cosine of its embedding
to the exact-attention one in float32 (`fidelity_reference`; headers `x-fidelity`,
`x-fidelity-reference`, `x-exact-time-ms`). The body's
`prompt_name` and `adapter` say which prompt the texts got (the one sent, or the model's
default) and which task adapter ran; null when none.
"""

from __future__ import annotations

import base64

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from ..auth import require_api_key
from ..pipeline import FIDELITY_REFERENCE, EmbedOptions, embed
from ..schemas import ERROR_RESPONSES, EmbeddingRequest, EmbeddingResponse
from ..state import get_state

router = APIRouter(tags=["openai"])


@router.post(
    "/v1/embeddings",
    response_model=EmbeddingResponse,
    responses=ERROR_RESPONSES,
    dependencies=[Depends(require_api_key)],
)
async def create_embeddings(body: EmbeddingRequest, request: Request) -> JSONResponse:
    options = EmbedOptions(
        "input",
        body.attention,
        body.truncate,
        dimensions=body.dimensions,
        fidelity=body.fidelity,
        prompt_name=body.prompt_name,
        adapter=body.adapter,
    )
    embedded = await embed(request, body.input, options)
    if body.encoding_format == "base64":
        rows = embedded.vectors.numpy().astype("<f4")
        data = [base64.b64encode(row.tobytes()).decode("ascii") for row in rows]
    else:
        data = embedded.vectors.tolist()
    tokens = sum(embedded.tokens)
    items = [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(data)]
    for item, cosine in zip(items, embedded.fidelity or ()):
        item["fidelity"] = cosine
    content = {
        "object": "list",
        "data": items,
        "model": get_state(request).encoder.name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        "attention": embedded.attention,
        "prompt_name": embedded.prompt_name,
        "adapter": embedded.adapter,
    }
    if embedded.fidelity is not None:
        content["fidelity_reference"] = FIDELITY_REFERENCE
    return JSONResponse(content, headers=embedded.headers())
