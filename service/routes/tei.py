"""POST /embed and POST /: Text Embeddings Inference's embed API, plus the `attention`,
`adapter`, `fidelity` and `chunking` extensions; POST /embed_all: TEI's token embeddings.

With several models served, `/models/{model}/embed`, `/models/{model}/embed_all` and
`/models/{model}` (a root route per model) run the named one, the unprefixed routes the default;
a name no served model answers to is a 404 naming `model`.

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
from ..schemas import ERROR_RESPONSES, ChunkEmbedding, EmbedAllRequest, EmbedRequest, ErrorResponse, error_responses
from ..state import get_state
from .json_body import JSONBodyRoute

router = APIRouter(route_class=JSONBodyRoute, tags=["tei"], responses=ERROR_RESPONSES, dependencies=[Depends(require_api_key)])
EMBEDDINGS = list[list[float]] | list[list[int]] | list[list[ChunkEmbedding]]
MODEL_NOT_FOUND = error_responses(ErrorResponse, {404: "no served model has that name"})


@router.post("/embed", response_model=EMBEDDINGS)
@router.post("/", response_model=EMBEDDINGS, summary="Tei Embed (TEI's root route: the same as /embed)")
async def tei_embed(body: EmbedRequest, request: Request) -> Response:
    return await _embed(body, request, None)


@router.post("/models/{model}/embed", response_model=EMBEDDINGS, responses=MODEL_NOT_FOUND)
@router.post("/models/{model}", response_model=EMBEDDINGS, responses=MODEL_NOT_FOUND,
             summary="Tei Embed on a named model (its root route, for clients given a URL)")  # fmt: skip
async def tei_embed_model(model: str, body: EmbedRequest, request: Request) -> Response:
    return await _embed(body, request, _served_name(request, model))


def _served_name(request: Request, model: str) -> str:
    """A path's model: one of the served models' names (404 naming `model` for any other, even
    where one model is served: a URL names a model, as /v1/models/{model} does)."""
    state = get_state(request)
    state.require_ready()
    return state.named(model).name


async def _embed(body: EmbedRequest, request: Request, model: str | None) -> Response:
    embedded = await embed(request, body.inputs, EmbedOptions.of(body, "inputs", model=model))
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
    return await _embed_all(body, request, None)


@router.post("/models/{model}/embed_all", response_model=list[list[list[float]]], responses=MODEL_NOT_FOUND)
async def tei_embed_all_model(model: str, body: EmbedAllRequest, request: Request) -> Response:
    return await _embed_all(body, request, _served_name(request, model))


async def _embed_all(body: EmbedAllRequest, request: Request, model: str | None) -> Response:
    options = EmbedOptions.of(body, "inputs", model=model, every_token=True, normalize=False)
    embedded = await embed(request, body.inputs, options)
    # Per input its (tokens, dim) rows: `[[[float]]]`.
    return await json_response(lambda: [json_rows(part) for part in embedded.per_input()], embedded.headers)
