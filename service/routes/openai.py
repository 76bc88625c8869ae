"""OpenAI's API: POST /v1/embeddings, GET /v1/models and GET /v1/models/{model}.

The embeddings route is OpenAI's, plus `attention`, `truncate`, `prompt_name`,
`adapter` and `fidelity`.

Token-id inputs are the model's vocabulary ids, used exactly as sent (no [CLS]/[SEP] is
added); texts get the model's special tokens. `model` picks one of the served models by name
(service.state.ServiceState.pick: any name, or none, gets the one model a server serves
alone); `user` is accepted and ignored; the response names the model that ran.
`encoding_format="base64"` (what the official client asks for by default) is little-endian
float32 bytes, base64-encoded, as OpenAI sends them; int8, uint8, binary and ubinary are lists
of integers (service.responses.encoded_rows).
With `"fidelity": true` each data item also carries `fidelity`, the cosine of its embedding
to the exact-attention one in float32 (`fidelity_reference`; headers `x-fidelity`,
`x-fidelity-reference`, `x-exact-time-ms`). The body's
`prompt_name` and `adapter` say which prompt the texts got (the one sent, or the model's
default) and which task adapter ran; null when none.

With `chunking` each text is cut into chunks and `data` holds one item per chunk, input after
input: `index` is the input's, `chunk` the chunk's number within it, `text_span` and
`token_span` its [start, stop) characters and tokens (models.planning.chunk_plan); the official client
parses it as a list of embeddings and keeps the extra fields. With `late_chunking` (Jina's
form) the inputs are the consecutive chunks of one text and `data` has one item per input.

/v1/models lists the served models (`client.models.list()`, and the clients and tools that
look up a model there before they use it); /v1/models/{model} answers for each one's name and
the names /api/tags gives it (Ollama's, with or without ":latest"), 404 for any other. Both take
the API key where one is configured, as OpenAI's do, and answer 503 until the model is ready.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from ..auth import require_api_key
from ..pipeline import FIDELITY_REFERENCE, embed
from ..planning import EmbedOptions
from ..responses import encoded_rows, json_response
from ..schemas import ERROR_RESPONSES, EmbeddingRequest, EmbeddingResponse, ErrorResponse, ModelCard, ModelList, error_responses
from ..state import ServiceState, get_state
from .json_body import JSONBodyRoute

router = APIRouter(route_class=JSONBodyRoute, tags=["openai"], dependencies=[Depends(require_api_key)])
MODEL_ERRORS = {
    401: ERROR_RESPONSES[401],
    **error_responses(ErrorResponse, {404: "no served model has that name", 503: "not ready"}),
}
OWNED_BY = "clusterserve"


@router.post("/v1/embeddings", response_model=EmbeddingResponse, responses=ERROR_RESPONSES)
async def create_embeddings(body: EmbeddingRequest, request: Request) -> Response:
    embedded = await embed(request, body.input, EmbedOptions.of(body, "input"))

    def answer() -> dict:
        if embedded.chunks is None or body.late_chunking:  # one item per input
            items: list[dict] = [{"object": "embedding", "index": i} for i in range(embedded.vectors.shape[0])]
        else:  # one item per chunk
            items = [
                {"object": "embedding", "index": i, "chunk": j, "text_span": list(c.text_span),
                 "token_span": list(c.token_span)}
                for i, chunks in enumerate(embedded.chunks)
                for j, c in enumerate(chunks)
            ]
        data = encoded_rows(embedded.vectors, body.encoding_format, embedded.model)
        tokens = sum(embedded.tokens)
        for item, vector in zip(items, data):
            item["embedding"] = vector
        for item, cosine in zip(items, embedded.fidelity or ()):
            item["fidelity"] = cosine
        content = {
            "object": "list",
            "data": items,
            "model": embedded.model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            "attention": embedded.attention,
            "prompt_name": embedded.prompt_name,
            "adapter": embedded.adapter,
        }
        if embedded.fidelity is not None:
            content["fidelity_reference"] = FIDELITY_REFERENCE
        return content

    return await json_response(answer, embedded.headers)


def _card(state: ServiceState, name: str) -> dict:
    return {"id": name, "object": "model", "created": state.ready_since, "owned_by": OWNED_BY}


@router.get("/v1/models", response_model=ModelList, responses=MODEL_ERRORS)
async def list_models(request: Request) -> JSONResponse:
    state = get_state(request)
    state.require_ready()
    return JSONResponse({"object": "list", "data": [_card(state, name) for name in state.models]})


@router.get("/v1/models/{model}", response_model=ModelCard, responses=MODEL_ERRORS)
async def retrieve_model(model: str, request: Request) -> JSONResponse:
    state = get_state(request)
    state.require_ready()
    served = state.named(model, "GET /v1/models lists the ones that are")
    return JSONResponse(_card(state, served.name))
