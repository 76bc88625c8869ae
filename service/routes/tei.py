"""POST /embed and POST /: Text Embeddings Inference's embed API, plus the `attention`,
`adapter`, `fidelity` and `chunking` extensions; POST /embed_all: TEI's token embeddings.

The root route is TEI's too: the same body and answers as /embed, so that clients which post
to the server's URL as given (huggingface_hub's `InferenceClient(model=URL).feature_extraction`,
LangChain's `HuggingFaceEndpointEmbeddings`) get vectors.

Returns a bare `[[float]]`, one row per input (integers with the `encoding_format` extension:
int8, uint8, binary, ubinary, as /v1/embeddings writes them); the resolved attention is in `x-attention`,
the prompt the texts got (sent as `prompt_name`, or the model's default) in `x-prompt-name`,
the task adapter that ran in `x-adapter`, and with `"fidelity": true` each input's cosine to
the exact embedding in `x-fidelity` (comma-separated, input order).

With `chunking` the answer is, per input, its chunks in order, each `{chunk, embedding,
text_span, token_span}` (models.planning.chunk_plan; `x-fidelity` then lists one cosine per chunk).
/embed_all answers, per input, one vector per token ([CLS] and [SEP] included, in the order
POST /tokenize lists them): the last hidden states, not normalised, as TEI does (~5 KB of
JSON a token). Every answer is built and printed off the event loop (service.responses).
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from ..auth import require_api_key
from ..pipeline import embed
from ..planning import EmbedOptions
from ..responses import encoded_rows, json_response, json_rows
from ..schemas import ERROR_RESPONSES, ChunkEmbedding, EmbedAllRequest, EmbedRequest
from .json_body import JSONBodyRoute

router = APIRouter(route_class=JSONBodyRoute, tags=["tei"], responses=ERROR_RESPONSES, dependencies=[Depends(require_api_key)])
EMBEDDINGS = list[list[float]] | list[list[int]] | list[list[ChunkEmbedding]]


@router.post("/embed", response_model=EMBEDDINGS)
@router.post("/", response_model=EMBEDDINGS, summary="Tei Embed (TEI's root route: the same as /embed)")
async def tei_embed(body: EmbedRequest, request: Request) -> Response:
    embedded = await embed(request, body.inputs, EmbedOptions.of(body, "inputs"))
    encoding = body.encoding_format
    if embedded.chunks is None:
        return await json_response(lambda: encoded_rows(embedded.vectors, encoding, embedded.model), embedded.headers)

    def answer() -> list:
        return [
            [
                {"chunk": j, "embedding": vector, "text_span": list(c.text_span), "token_span": list(c.token_span)}
                for j, (c, vector) in enumerate(zip(chunks, encoded_rows(vectors, encoding, embedded.model)))
            ]
            for chunks, vectors in zip(embedded.chunks, embedded.per_input())
        ]

    return await json_response(answer, embedded.headers)


@router.post("/embed_all", response_model=list[list[list[float]]])
async def tei_embed_all(body: EmbedAllRequest, request: Request) -> Response:
    embedded = await embed(request, body.inputs, EmbedOptions.of(body, "inputs", every_token=True, normalize=False))
    # Per input its (tokens, dim) rows: `[[[float]]]`.
    return await json_response(lambda: [json_rows(part) for part in embedded.per_input()], embedded.headers)
