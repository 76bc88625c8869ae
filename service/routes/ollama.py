"""Ollama's embedding API, so that Ollama's clients (the `ollama` package, LangChain's
OllamaEmbeddings, LlamaIndex's OllamaEmbedding) work against this server unchanged:

    POST /api/embed        {model, input, truncate, dimensions, options, keep_alive} -> {model, embeddings,
                           total_duration, load_duration, prompt_eval_count} (durations in nanoseconds)
    POST /api/embeddings   the legacy route: {model, prompt} -> {embedding}, not normalised, as Ollama's
    GET  /api/tags         every served model, under each name it answers to
    POST /api/show         its details and model_info
    GET  /api/version

Texts are embedded as written, with no prompt (models.prompts.NO_PROMPT), whatever the model's
default prompt: Ollama adds none, and its users write nomic's `search_query: ` themselves.
Both embedding routes take this server's `attention` object and run the shared pipeline
(service.pipeline), so limits, budgets, 413, 429, headers and metrics are the other routes'.
Errors come in Ollama's shape, `{"error": "..."}` (service.errors).
"""

from __future__ import annotations

import json
import time
from typing import Callable

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from clusterserve.models import Encoder
from clusterserve.models.prompts import NO_PROMPT

from .. import __version__, errors
from ..auth import require_api_key
from ..middleware import ARRIVAL_KEY
from ..names import served_names
from ..ollama_schemas import (
    OLLAMA_ERROR_RESPONSES,
    OllamaEmbeddingsRequest,
    OllamaEmbeddingsResponse,
    OllamaEmbedRequest,
    OllamaEmbedResponse,
    OllamaShowRequest,
    OllamaShowResponse,
    OllamaTagsResponse,
    OllamaVersionResponse,
)
from ..pipeline import embed
from ..planning import EmbedOptions
from ..responses import json_response, json_rows
from ..state import get_state
from .json_body import JSONBodyRoute

router = APIRouter(tags=["ollama"], route_class=JSONBodyRoute)
AUTH = [Depends(require_api_key)]

_DTYPES = {"torch.float32": "F32", "torch.float16": "F16", "torch.bfloat16": "BF16"}


def model_for(request: Request, asked: str | None, not_found: Callable[[str], str]) -> Encoder:
    """The served encoder the request names: 400 without a name, 503 until loaded, 404 for a
    name no served model answers to, with Ollama's words for the route (`not_found(name)`)."""
    if not asked:
        raise errors.ServiceError(400, "invalid_field", "model is required", "model")
    state = get_state(request)
    state.require_ready()
    served = state.find(asked)
    if served is None:
        raise errors.ServiceError(404, "not_found", not_found(asked), "model")
    return served.encoder


def not_pulled(name: str) -> str:
    """Ollama's answer to an embedding request for a model it does not have."""
    return f"model {json.dumps(name, ensure_ascii=False)} not found, try pulling it first"


def not_found(name: str) -> str:
    """Ollama's answer to /api/show for a model it does not have."""
    return f"model '{name}' not found"


def _nanoseconds_since_arrival(request: Request) -> int:
    return int((time.monotonic() - request.scope.get(ARRIVAL_KEY, time.monotonic())) * 1e9)


@router.post("/api/embed", response_model=OllamaEmbedResponse, responses=OLLAMA_ERROR_RESPONSES, dependencies=AUTH)
async def ollama_embed(body: OllamaEmbedRequest, request: Request) -> Response:
    encoder = model_for(request, body.model, not_pulled)
    if not body.input:  # Ollama's clients send this to load a model; it is loaded
        return JSONResponse(
            {"model": body.model, "embeddings": [], "total_duration": _nanoseconds_since_arrival(request),
             "load_duration": 0, "prompt_eval_count": 0}
        )  # fmt: skip
    # As Ollama: 0, or as many as the model has or more, keeps them all.
    dimensions = body.dimensions if body.dimensions and body.dimensions < encoder.dim else None
    embedded = await embed(request, body.input, EmbedOptions.of(body, "input", dimensions=dimensions, prompt_name=NO_PROMPT))

    def answer() -> dict:
        return {
            "model": body.model,
            "embeddings": json_rows(embedded.vectors),
            "total_duration": _nanoseconds_since_arrival(request),
            "load_duration": 0,
            "prompt_eval_count": sum(embedded.tokens),
        }

    return await json_response(answer, embedded.headers)


@router.post("/api/embeddings", response_model=OllamaEmbeddingsResponse, responses=OLLAMA_ERROR_RESPONSES, dependencies=AUTH)
async def ollama_embeddings(body: OllamaEmbeddingsRequest, request: Request) -> Response:
    model_for(request, body.model, not_pulled)
    if not body.prompt:
        return JSONResponse({"embedding": []})
    # Ollama's legacy route truncates and returns the pooled vector without normalising it.
    options = EmbedOptions.of(body, "prompt", truncate=True, normalize=False, prompt_name=NO_PROMPT)
    embedded = await embed(request, body.prompt, options)
    return await json_response(lambda: {"embedding": json_rows(embedded.vectors[0])}, embedded.headers)


@router.get("/api/tags", response_model=OllamaTagsResponse, responses=OLLAMA_ERROR_RESPONSES)
async def ollama_tags(request: Request) -> JSONResponse:
    state = get_state(request)
    state.require_ready()
    models = []
    for served in state.models.values():
        encoder = served.encoder
        size = sum(p.numel() * p.element_size() for p in encoder.model.parameters())
        details = _details(encoder)
        models += [{"name": name, "model": name, "size": size, "details": details} for name in served_names(encoder.name)]
    return JSONResponse({"models": models})


@router.post("/api/show", response_model=OllamaShowResponse, responses=OLLAMA_ERROR_RESPONSES)
async def ollama_show(body: OllamaShowRequest, request: Request) -> JSONResponse:
    encoder = model_for(request, body.model or body.name, not_found)
    config, arch = encoder.model.config, encoder.architecture
    model_info = {
        "general.architecture": arch,
        "general.name": encoder.name,
        "general.parameter_count": _parameters(encoder),
        f"{arch}.context_length": encoder.max_input_tokens,
        f"{arch}.embedding_length": encoder.dim,
        f"{arch}.block_count": config.num_layers,
        f"{arch}.attention.head_count": config.num_heads,
    }
    return JSONResponse({"details": _details(encoder), "model_info": model_info, "capabilities": ["embedding"]})


@router.get("/api/version", response_model=OllamaVersionResponse)
async def ollama_version() -> JSONResponse:
    return JSONResponse({"version": __version__})


def _parameters(encoder: Encoder) -> int:
    return sum(p.numel() for p in encoder.model.parameters())


def _details(encoder: Encoder) -> dict:
    count = _parameters(encoder)
    size = f"{count / 1e9:.1f}B" if count >= 1e9 else f"{count / 1e6:.0f}M"
    return {
        "family": encoder.architecture,
        "families": [encoder.architecture],
        "parameter_size": size,
        "quantization_level": _DTYPES.get(str(encoder.dtype), str(encoder.dtype)),
    }
