"""POST /embed and POST /: Text Embeddings Inference's embed API, plus the `attention`,
`adapter`, `fidelity` and `chunking` extensions; POST /embed_all: TEI's token embeddings.

The root route is TEI's too: the same body and answers as /embed, so that clients which post
to the server's URL as given (huggingface_hub's `InferenceClient(model=URL).feature_extraction`,
LangChain's `HuggingFaceEndpointEmbeddings`) get vectors.

Returns a bare `[[float]]`, one row per input; the resolved attention is in `x-attention`,
the prompt the texts got (sent as `prompt_name`, or the model's default) in `x-prompt-name`,
the task adapter that ran in `x-adapter`, and with `"fidelity": true` each input's cosine to
the exact embedding in `x-fidelity` (comma-separated, input order).

With `chunking` the answer is, per input, its chunks in order, each `{chunk, embedding,
text_span, token_span}` (service.chunking; `x-fidelity` then lists one cosine per chunk).
/embed_all answers, per input, one vector per token ([CLS] and [SEP] included, in the order
POST /tokenize lists them): the last hidden states, not normalised, as TEI does (~5 KB of
JSON a token). Every answer is built and printed off the event loop (service.responses).
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from ..auth import require_api_key
from ..chunking import embed_chunks, embed_tokens
from ..pipeline import EmbedOptions, embed
from ..responses import json_response, json_rows
from ..schemas import ERROR_RESPONSES, ChunkEmbedding, EmbedAllRequest, EmbedRequest

router = APIRouter(tags=["tei"])


@router.post(
    "/embed",
    response_model=list[list[float]] | list[list[ChunkEmbedding]],
    responses=ERROR_RESPONSES,
    dependencies=[Depends(require_api_key)],
)
@router.post(
    "/",
    response_model=list[list[float]] | list[list[ChunkEmbedding]],
    responses=ERROR_RESPONSES,
    dependencies=[Depends(require_api_key)],
    summary="Tei Embed (TEI's root route: the same as /embed)",
)
async def tei_embed(body: EmbedRequest, request: Request) -> Response:
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
    if body.chunking is None:
        embedded = await embed(request, body.inputs, options)
        return await json_response(lambda: json_rows(embedded.vectors), embedded.headers())
    chunked = await embed_chunks(request, body.inputs, options, body.chunking)

    def answer() -> list:
        return [
            [
                {"chunk": j, "embedding": vector, "text_span": list(c.text_span), "token_span": list(c.token_span)}
                for j, (c, vector) in enumerate(zip(chunks, json_rows(vectors)))
            ]
            for chunks, vectors in zip(chunked.chunks, chunked.per_input())
        ]

    return await json_response(answer, chunked.embedded.headers())


@router.post(
    "/embed_all",
    response_model=list[list[list[float]]],
    responses=ERROR_RESPONSES,
    dependencies=[Depends(require_api_key)],
)
async def tei_embed_all(body: EmbedAllRequest, request: Request) -> Response:
    options = EmbedOptions(
        "inputs",
        body.attention,
        body.truncate,
        body.truncation_direction,
        normalize=False,
        prompt_name=body.prompt_name,
        adapter=body.adapter,
    )
    embedded = await embed_tokens(request, body.inputs, options)
    # Per input its (tokens, dim) rows: `[[[float]]]`.
    return await json_response(lambda: [json_rows(part) for part in embedded.vectors.split(embedded.tokens)],
                               embedded.headers())
