"""Request and response bodies of every route (pydantic models; FastAPI derives /openapi.json).

Requests forbid unknown fields, so a misspelt knob (`"cluster": 8`) is a 422 naming it
instead of being silently ignored. Knob ranges come from `kernels.KNOB_RANGES`, the same
table `AttentionSpec` validates against, so the OpenAPI schema and the server agree.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PlainValidator, StrictBool, StrictFloat, StrictInt

from clusterserve.kernels import KNOB_RANGES, METHODS
from clusterserve.models.compact import FORMATS as COMPACT_FORMATS
from clusterserve.models.compact import UNIT_ENCODINGS
from clusterserve.models.planning.chunking import BOUNDARIES, WINDOW_OVERLAP_SHARE, ChunkingSpec


def _integral(value: Any) -> Any:
    """JSON has one number type: 8.0 is the integer 8 (as JSON Schema's "integer" says); 8.5,
    true and "8" are not integers and stay as they are, for the strict check to refuse."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def json_int(**bounds: int) -> Any:
    """An integer field within `bounds` (ge, le): a JSON integer, written 8 or 8.0; never a bool
    or a string. The bounds sit on the inner type, so the OpenAPI document states them."""
    return Annotated[Annotated[StrictInt, Field(**bounds)], BeforeValidator(_integral)]


def _knob(name: str) -> Any:
    low, high = KNOB_RANGES[name]
    return json_int(ge=low, le=high)


def _knob_field(name: str, description: str) -> Any:
    low, high = KNOB_RANGES[name]
    return Field(None, description=f"{description} [{low}, {high}]")


class AttentionRequest(BaseModel):
    """The per-request `attention` object; every field is optional (defaults: GET /info). The
    rules between its fields (models.planning.rules) are in the OpenAPI document once the model
    is loaded."""

    model_config = ConfigDict(extra="forbid")

    method: Literal[METHODS] | None = Field(  # type: ignore[valid-type]
        None, description="full | clustered | i-clustered | smyrf | banded | auto"
    )
    clusters: _knob("clusters") | None = _knob_field("clusters", "query clusters (clustered, i-clustered)")
    topk: _knob("topk") | None = _knob_field("topk", "keys per cluster recomputed exactly (i-clustered)")
    bits: _knob("bits") | None = _knob_field("bits", "LSH bits of the query codes (clustered, i-clustered)")
    iterations: _knob("iterations") | None = _knob_field("iterations", "Hamming K-means iterations")
    refine: _knob("refine") | None = _knob_field("refine", "Lloyd iterations on the real query vectors")
    hash_rounds: _knob("hash_rounds") | None = _knob_field("hash_rounds", "SMYRF hashing rounds")
    cluster_size: _knob("cluster_size") | None = _knob_field("cluster_size", "SMYRF queries per cluster")
    band: _knob("band") | None = _knob_field("band", "neighbouring blocks each side attended exactly (banded)")
    block: _knob("block") | None = _knob_field("block", "tokens per block; farther blocks are pooled (banded)")
    sinks: _knob("sinks") | None = _knob_field("sinks", "leading tokens (and the last) every query attends exactly (banded)")
    far_blocks: _knob("far_blocks") | None = _knob_field(
        "far_blocks", "blocks outside the band each query block attends exactly, chosen by pooled score (banded)"
    )
    seed: _knob("seed") | None = _knob_field("seed", "seed of the random planes and initial centroids")
    target_fidelity: StrictFloat | None = Field(
        None,
        gt=0,
        le=1,
        description="with method auto: the fastest calibrated configuration whose measured cosine to "
        "exact attention at the input's length is at least this (exact when none is); the other "
        "knobs except seed are chosen for you",
    )


_CHUNKING = ChunkingSpec()
# Static bounds of the chunking fields (the model's limit bounds them further: /info, 422).
CHUNK_TOKENS_MAX = 65536


class ChunkingRequest(BaseModel):
    """The `chunking` extension: every field optional (defaults: GET /info `chunking`). Sizes
    are in tokens. The rules between its fields (models.planning.rules: overlap below size,
    window_overlap below the window's room for text, ...) are in the OpenAPI document once the
    model is loaded; a body that breaks one is a 422 naming the field."""

    model_config = ConfigDict(extra="forbid")

    size: json_int(ge=1, le=CHUNK_TOKENS_MAX) | None = Field(
        None, description=f"tokens per chunk at most (the text's own tokens); default {_CHUNKING.size}"
    )
    overlap: json_int(ge=0, le=CHUNK_TOKENS_MAX - 1) | None = Field(
        None, description=f"tokens a chunk shares with the one before, below size; default {_CHUNKING.overlap}"
    )
    boundaries: Literal[BOUNDARIES] | None = Field(  # type: ignore[valid-type]
        None,
        description="tokens: fixed token windows; sentences / paragraphs: whole ones packed up to size (a longer "
        f"one is cut between tokens); default {_CHUNKING.boundaries}",
    )
    late: StrictBool | None = Field(
        None,
        description="true: one pass per context window, token states mean-pooled over each chunk (late chunking); "
        "false: each chunk embedded alone; default the model's (GET /info chunking.defaults.late: false for "
        "nomic-embed-text-v1.5, whose late chunks retrieve worse than naive ones, true otherwise)",
    )
    window: json_int(ge=1, le=CHUNK_TOKENS_MAX) | None = Field(
        None,
        description="late chunking's context window in tokens, special tokens and prompt included; default the "
        "model's (GET /info chunking.defaults.window: the checkpoint's trained positions, or the window measured "
        "best for it); longer documents run overlapping windows",
    )
    window_overlap: json_int(ge=0, le=CHUNK_TOKENS_MAX - 1) | None = Field(
        None,
        description="tokens each later window re-reads from the one before as context (its first window_overlap "
        "outputs are dropped); must be below the window's text tokens (window less its special and prompt "
        f"tokens; 422 otherwise); default {WINDOW_OVERLAP_SHARE:g} of the window's text tokens",
    )


CHUNKING_DESCRIPTION = (
    "split each text into chunks and return one vector per chunk with its character and token spans "
    "(late or naive chunking by the model's default); see GET /info chunking for the defaults and limits"
)
LATE_CHUNKING_DESCRIPTION = (
    "Jina's form: the inputs are the consecutive chunks of one text; late chunking over it returns one "
    "vector per input. `chunking` may set window and window_overlap only"
)


PROMPT_NAME_DESCRIPTION = (
    "a prompt of the model (GET /info: prompts), prepended to every text; its tokens count toward "
    "the length limit. Unset: the model's default prompt, if it names one. Where the model has a "
    "task adapter of the same name (Jina v3), that adapter runs too"
)
ADAPTER_DESCRIPTION = (
    "a task adapter of the model (GET /info: adapters; Jina v3's LoRA tasks), whatever the prompt. "
    "Unset: the adapter named like the prompt in effect, if any, else the base weights"
)

COMPACT_DESCRIPTION = (
    "int8 / uint8: each component in 255 steps of the model's calibrated range (GET /info encodings; "
    "unit vectors only, so not with normalize false); binary / ubinary: one sign bit a dimension, packed "
    "8 to a byte, first dimension in the high bit, as int8 (byte - 128) / uint8 bytes; chunk vectors too"
)
FIDELITY_DESCRIPTION = (
    "also embed with exact attention and report, per input, the cosine of the returned embedding "
    "to the exact one (x-exact-time-ms: the exact run's time); costs that exact run"
)


def _is_id(value: Any) -> bool:
    """A token id as JSON writes an integer (7 or 7.0); never a bool."""
    return (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, float) and value.is_integer())


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(_is_id(t) for t in value)


# The item shapes a list input may take, in the order they are tried: (is an item of it, the
# item as used, its name in a message). An empty list takes the first.
_TEXT_ITEMS = ((lambda v: isinstance(v, str), lambda v: v, "a string"),)
_INPUT_ITEMS = (*_TEXT_ITEMS, (_is_id, int, "a token id"), (_is_ids, lambda v: [int(t) for t in v], "a token-id list"))


def _check_list(value: Any, field: str, shapes: tuple, expected: str) -> str | list:
    """A string, or a list whose items all take one of `shapes`; otherwise one clear message
    (instead of pydantic's error per union arm) naming where the items stop matching the shape
    the first one starts: `; input[0] is a string but input[2] is null`."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        for fits, used, _ in shapes:
            if all(fits(v) for v in value):
                return [used(v) for v in value]
        first = next((shape for shape in shapes if shape[0](value[0])), None)
        if first is None:
            expected += f"; {field}[0] is {_json_kind(value[0])}"
        else:
            index = next(i for i, v in enumerate(value) if not first[0](v))
            expected += f"; {field}[0] is {first[2]} but {field}[{index}] is {_json_kind(value[index])}"
    raise ValueError(expected)


def _json_kind(value: Any) -> str:
    """What a JSON value is, as a message names it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a token id" if _is_id(value) and value >= 0 else "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list" if value else "an empty list"
    return "an object"


def _check_input(value: Any) -> str | list[str] | list[int] | list[list[int]]:
    return _check_list(value, "input", _INPUT_ITEMS,
                       "must be a string, a list of strings, a list of token ids or a list of token-id lists")


def _check_text_inputs(value: Any) -> str | list[str]:
    return _check_list(value, "inputs", _TEXT_ITEMS, "must be a string or a list of strings")


# What the OpenAPI document declares, so that it rejects what the server answers with 400
# (an empty input, an empty list, an empty item). The validators above do the checking: they
# keep pydantic's per-arm errors out of the messages, and the pipeline answers an empty
# input with 400 "empty input", never 422.
NonEmptyText = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
OpenAIInputSchema = Union[
    NonEmptyText,
    Annotated[list[NonEmptyText], Field(min_length=1)],
    TokenIds,
    Annotated[list[TokenIds], Field(min_length=1)],
]
TextInputsSchema = Union[NonEmptyText, Annotated[list[NonEmptyText], Field(min_length=1)]]
# /tokenize answers "" (and "" items) with the special tokens alone; only an empty list is a 400.
TokenizeInputsSchema = Union[str, Annotated[list[str], Field(min_length=1)]]

OpenAIInput = Annotated[
    Union[str, list[str], list[int], list[list[int]]],
    PlainValidator(_check_input, json_schema_input_type=OpenAIInputSchema),
]
TextInputs = Annotated[
    Union[str, list[str]],
    PlainValidator(_check_text_inputs, json_schema_input_type=TextInputsSchema),
]
TokenizeInputs = Annotated[
    Union[str, list[str]],
    PlainValidator(_check_text_inputs, json_schema_input_type=TokenizeInputsSchema),
]


class EmbeddingRequest(BaseModel):
    """POST /v1/embeddings (OpenAI), plus the `attention`, `truncate`, `prompt_name`, `adapter`
    and `fidelity` extensions."""

    model_config = ConfigDict(extra="forbid")

    input: OpenAIInput = Field(description="text(s) or token ids (without special tokens)")
    model: str | None = Field(
        None, description="which served model embeds (GET /v1/models); unset, or any name where one model is served: the default"
    )
    encoding_format: Literal[("float", "base64", *COMPACT_FORMATS)] = Field(  # type: ignore[valid-type]
        "float", description="base64: little-endian float32 bytes, as OpenAI; " + COMPACT_DESCRIPTION
    )
    dimensions: json_int(ge=1) | None = Field(None, description="keep the first n dimensions, then re-normalise")
    user: str | None = Field(None, description="accepted and ignored (never logged)")
    attention: AttentionRequest | None = None
    truncate: StrictBool = Field(False, description="cut inputs longer than the limit instead of 413")
    prompt_name: str | None = Field(None, description=PROMPT_NAME_DESCRIPTION)
    adapter: str | None = Field(None, description=ADAPTER_DESCRIPTION)
    fidelity: StrictBool = Field(False, description=FIDELITY_DESCRIPTION)
    chunking: ChunkingRequest | None = Field(None, description=CHUNKING_DESCRIPTION)
    late_chunking: StrictBool = Field(False, description=LATE_CHUNKING_DESCRIPTION)


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int = Field(description="the input's index (with chunking, every chunk of input i has index i)")
    embedding: list[float] | list[int] | str = Field(description="floats, base64 float32, or compact codes (encoding_format)")
    fidelity: float | None = Field(None, description="with fidelity=true: cosine of this embedding to the exact one")
    chunk: int | None = Field(None, description="with chunking: the chunk's number within its input, from 0")
    text_span: list[int] | None = Field(
        None, description="with chunking: [start, stop) characters of the input text the chunk covers"
    )
    token_span: list[int] | None = Field(
        None, description="with chunking: [start, stop) of the input's tokens as POST /tokenize lists them ([CLS] is 0)"
    )


class Usage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: Usage
    attention: dict[str, Any] = Field(description="the resolved attention spec (method and the knobs it used)")
    prompt_name: str | None = Field(description="the prompt prepended to the texts (sent, or the default), or null")
    adapter: str | None = Field(description="the task adapter that ran, or null (base weights)")


class ModelCard(BaseModel):
    id: str = Field(description="the served model's name, as /v1/embeddings answers it in `model`")
    object: Literal["model"] = "model"
    created: int = Field(description="Unix time, in seconds, at which this server had loaded the model")
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(description="the models this server serves, the default first")


class EmbedRequest(BaseModel):
    """POST /embed and POST / (Text Embeddings Inference), plus the `attention`, `adapter` and
    `fidelity` extensions."""

    # int8 and uint8 encode unit vectors (service.planning refuses them with normalize false)
    model_config = ConfigDict(extra="forbid", json_schema_extra={"not": {
        "properties": {"normalize": {"const": False}, "encoding_format": {"enum": list(UNIT_ENCODINGS)}},
        "required": ["normalize", "encoding_format"],
    }})  # fmt: skip

    inputs: TextInputs
    truncate: StrictBool = False
    truncation_direction: Literal["right", "left", "Right", "Left"] = "right"
    normalize: StrictBool = True
    dimensions: json_int(ge=1) | None = None
    encoding_format: Literal[("float", *COMPACT_FORMATS)] = Field(  # type: ignore[valid-type]
        "float", description="an extension: " + COMPACT_DESCRIPTION
    )
    prompt_name: str | None = Field(None, description=PROMPT_NAME_DESCRIPTION)
    adapter: str | None = Field(None, description=ADAPTER_DESCRIPTION)
    attention: AttentionRequest | None = None
    fidelity: StrictBool = Field(False, description=FIDELITY_DESCRIPTION + " (header x-fidelity)")
    chunking: ChunkingRequest | None = Field(
        None, description=CHUNKING_DESCRIPTION + "; the answer is then, per input, a list of chunk objects"
    )


class ChunkEmbedding(BaseModel):
    """One chunk in /embed's answer to a chunked request."""

    chunk: int = Field(description="the chunk's number within its input, from 0")
    embedding: list[float] | list[int]
    text_span: list[int] = Field(description="[start, stop) characters of the input text the chunk covers")
    token_span: list[int] = Field(description="[start, stop) of the input's tokens as POST /tokenize lists them")


class EmbedAllRequest(BaseModel):
    """POST /embed_all (Text Embeddings Inference): every token's last hidden state, plus the
    `attention` and `adapter` extensions."""

    model_config = ConfigDict(extra="forbid")

    inputs: TextInputs
    truncate: StrictBool = False
    truncation_direction: Literal["right", "left", "Right", "Left"] = "right"
    prompt_name: str | None = Field(None, description=PROMPT_NAME_DESCRIPTION)
    adapter: str | None = Field(None, description=ADAPTER_DESCRIPTION)
    attention: AttentionRequest | None = None


class TokenizeRequest(BaseModel):
    """POST /tokenize (TEI's shape)."""

    model_config = ConfigDict(extra="forbid")

    inputs: TokenizeInputs
    add_special_tokens: StrictBool = True


class Token(BaseModel):
    id: int
    text: str
    special: bool
    start: int | None = Field(description="character offset of the token's first character")
    stop: int | None = Field(description="character offset one past its last character")


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


def error_responses(model: type[BaseModel], descriptions: dict[int, str]) -> dict[int | str, dict[str, Any]]:
    """An OpenAPI `responses` table: each status, its body's model and when it is answered."""
    return {status: {"model": model, "description": description} for status, description in descriptions.items()}


# Documented on every route that can fail with them.
ERROR_RESPONSES = error_responses(
    ErrorResponse,
    {
        400: "empty input or malformed JSON",
        401: "missing or wrong API key (when one is configured)",
        413: "input longer than the limit without truncate, or body / batch too large",
        422: "invalid field (`param` names it)",
        429: "overloaded (`Retry-After`)",
        503: "not ready, or out of memory for this batch",
        504: "deadline passed",
    },
)
