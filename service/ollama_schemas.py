"""Request and response bodies of Ollama's routes (service.routes.ollama), as Ollama's API
defines them, plus this server's `attention` extension.

Requests forbid unknown fields, as every route here does, so a misspelt knob is a 400 naming
it. `options` and `keep_alive` are accepted with any content Ollama allows and ignored: one
server serves one model, loaded once, with its own settings.
"""

from __future__ import annotations

from typing import Annotated, Any, Union

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, StrictBool, StrictFloat, StrictInt, WithJsonSchema

from .schemas import AttentionRequest, error_responses, json_int


def _check_texts(value: Any) -> str | list[str]:
    """One message for both input shapes instead of pydantic's error per union arm."""
    if isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        return value
    raise ValueError("must be a string or a list of strings")


# Ollama answers an empty input ("" or []) with no vectors; an empty item in a list is a 400,
# which the schema states (minLength of the list's items).
OllamaInput = Annotated[
    Union[str, list[str]],
    PlainValidator(_check_texts, json_schema_input_type=Union[str, list[Annotated[str, Field(min_length=1)]]]),
]
MODEL_DESCRIPTION = (
    "the served model's name (GET /api/tags), or Ollama's name for it (nomic-embed-text for "
    "nomic-embed-text-v1.5), with or without the tag :latest; another name is a 404"
)
OPTIONS_DESCRIPTION = "Ollama's model options (num_ctx, num_thread, ...): accepted and ignored"
KEEP_ALIVE_DESCRIPTION = "accepted and ignored: the model stays loaded for the server's lifetime"
# Ollama answers a body without a model "model is required" (400): the server checks it itself,
# so that the words are Ollama's, and the schema says it (a non-empty string, required).
def _name(description: str) -> Any:
    """An optional string the schema states as a non-empty one."""
    return Annotated[Union[str, None], WithJsonSchema({"type": "string", "minLength": 1, "description": description})]


ModelName = _name(MODEL_DESCRIPTION)
ATTENTION_DESCRIPTION = "extension: the attention method and knobs, as on every embedding route (echo: x-attention)"


class OllamaEmbedRequest(BaseModel):
    """POST /api/embed (Ollama), plus the `attention` extension. Texts get no prompt."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"required": ["model"]})

    model: ModelName = None
    input: OllamaInput | None = Field(
        None, description='text(s) to embed as written; "" or [] loads nothing and returns no vectors, as Ollama does'
    )
    truncate: StrictBool = Field(True, description="cut inputs longer than the limit (Ollama's default) instead of 413")
    dimensions: json_int(ge=0) | None = Field(
        None, description="keep the first n dimensions, then re-normalise (Matryoshka); 0, unset or the width or more: all"
    )
    options: dict[str, Any] | None = Field(None, description=OPTIONS_DESCRIPTION)
    keep_alive: Union[StrictInt, StrictFloat, str, None] = Field(None, description=KEEP_ALIVE_DESCRIPTION)
    attention: AttentionRequest | None = Field(None, description=ATTENTION_DESCRIPTION)


class OllamaEmbedResponse(BaseModel):
    model: str = Field(description="the model name as the request gave it (as Ollama answers)")
    embeddings: list[list[float]] = Field(description="per input, its L2-normalised vector")
    total_duration: int = Field(description="nanoseconds from the request's arrival to its answer")
    load_duration: int = Field(description="nanoseconds spent loading the model for this request: 0, it is loaded at start-up")
    prompt_eval_count: int = Field(description="tokens of all inputs after truncation, special tokens included")


class OllamaEmbeddingsRequest(BaseModel):
    """POST /api/embeddings (Ollama's legacy route), plus the `attention` extension."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"required": ["model"]})

    model: ModelName = None
    prompt: str | None = Field(None, description='the text to embed as written; "" or unset returns no vector')
    options: dict[str, Any] | None = Field(None, description=OPTIONS_DESCRIPTION)
    keep_alive: Union[StrictInt, StrictFloat, str, None] = Field(None, description=KEEP_ALIVE_DESCRIPTION)
    attention: AttentionRequest | None = Field(None, description=ATTENTION_DESCRIPTION)


class OllamaEmbeddingsResponse(BaseModel):
    embedding: list[float] = Field(description="the pooled vector, not normalised (as Ollama's legacy route)")


class OllamaShowRequest(BaseModel):
    """POST /api/show; `name` is Ollama's older spelling of `model`."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"anyOf": [{"required": ["model"]}, {"required": ["name"]}]})

    model: ModelName = None
    name: _name("the same as model (Ollama's older field)") = None  # type: ignore[valid-type]
    verbose: StrictBool = Field(False, description="accepted; the answer is the same")


class OllamaDetails(BaseModel):
    family: str = Field(description="the architecture (nomic-bert, bert, ...)")
    families: list[str]
    parameter_size: str = Field(description='parameters, as Ollama prints them ("137M")')
    quantization_level: str = Field(description="the served weights' dtype: F32, F16 or BF16")


class OllamaModel(BaseModel):
    name: str
    model: str
    size: int = Field(description="bytes of the served weights")
    details: OllamaDetails


class OllamaTagsResponse(BaseModel):
    models: list[OllamaModel] = Field(description="the served model, under each name it answers to")


class OllamaShowResponse(BaseModel):
    details: OllamaDetails
    model_info: dict[str, Any] = Field(description="general.* and <architecture>.* facts: context and embedding length, ...")
    capabilities: list[str] = Field(description='["embedding"]')


class OllamaVersionResponse(BaseModel):
    version: str = Field(description="this server's version")


class OllamaError(BaseModel):
    error: str


OLLAMA_ERROR_RESPONSES = error_responses(
    OllamaError,
    {
        400: "malformed JSON, a missing model, an empty item, or an invalid field (the message names it)",
        401: "missing or wrong API key (when one is configured)",
        404: "a model this server does not serve",
        413: "input longer than the limit with truncate false, or body / batch too large",
        429: "overloaded (`Retry-After`)",
        503: "not ready, or out of memory for this batch",
        504: "deadline passed",
    },
)
