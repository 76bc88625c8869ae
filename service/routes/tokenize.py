"""POST /tokenize: token ids and character offsets, in the shape of Text Embeddings Inference.

Each token is `{id, text, special, start, stop}`: `start`/`stop` are character offsets into
the input and `text` the characters they cover. The model's added tokens ([CLS], [SEP],
<s>, ...) cover no characters: they are the ones marked `special`, with empty `text`.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from ..auth import require_api_key
from ..planning import parse_inputs
from ..schemas import ERROR_RESPONSES, Token, TokenizeRequest
from ..state import get_state
from .json_body import JSONBodyRoute

router = APIRouter(
    route_class=JSONBodyRoute, tags=["tokenize"], responses=ERROR_RESPONSES, dependencies=[Depends(require_api_key)]
)


@router.post("/tokenize", response_model=list[list[Token]])
async def tokenize(body: TokenizeRequest, request: Request) -> JSONResponse:
    state = get_state(request)
    encoder, _ = state.require_ready()
    texts, _ = parse_inputs(body.inputs, "inputs", state.settings.max_client_batch_size, allow_empty_items=True)
    encoded = await run_in_threadpool(encoder.tokenize, texts)
    result = []
    for text, tokens in zip(texts, encoded):
        row = []
        for token_id, (start, stop) in zip(tokens.ids, tokens.offsets):
            special = start == stop
            if special and not body.add_special_tokens:
                continue
            row.append({"id": token_id, "text": text[start:stop], "special": special, "start": start, "stop": stop})
        result.append(row)
    return JSONResponse(result)
