"""Server settings: environment variables `CLUSTERSERVE_<NAME>` or `clusterserve serve --<name>`.

One `Settings` object is built at start-up and passed to `create_app`; nothing reads the
environment after that. The attention fields are the server's defaults for a request's
`attention` object and are validated as an `AttentionSpec` here, so a bad value stops the
server at start-up instead of failing every request.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Annotated, Literal

import torch
from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from clusterserve.kernels import APPROXIMATE_METHODS, BACKENDS, METHODS, AttentionSpec
from clusterserve.models.planning.calibration import DEFAULT_TARGET_FIDELITY
from clusterserve.models.runtime.precision import DTYPE_SETTINGS

_DEFAULT_SPEC = AttentionSpec()


class Settings(BaseSettings):
    """Everything an operator can set. Field descriptions double as `--help` text."""

    model_config = SettingsConfigDict(env_prefix="CLUSTERSERVE_", extra="forbid")

    host: str = Field("127.0.0.1", description="interface to bind")
    port: int = Field(8000, ge=0, le=65535, description="TCP port (0 = any free port)")
    model: str | None = Field(
        None,
        description="the model to serve: a checkpoint folder (config.json, *.safetensors, tokenizer.json), a GGUF "
        "file, or a name: nomic-embed-text-v1.5 (alias nomic), all-MiniLM-L6-v2 (alias minilm); unset = "
        "nomic-embed-text-v1.5, fetched once by `clusterserve fetch`",
    )
    more_models: list[str] = Field(
        [],
        description="further models served beside `model` (names, folders or GGUF files), each picked by its name in a "
        "request's `model`; `--model` given more than once fills it (env: a JSON list)",
    )
    memory_budget_bytes: int | None = Field(
        None, ge=1, description="memory the served models' weights may take together; start-up fails when they do not "
        "fit; unset = nine tenths of the device's (CUDA: its total memory; CPU: the memory available at start-up)",
    )
    device: str = Field("auto", description='torch device for the model: "auto" (cuda if available), "cpu", "cuda:0", ...')
    dtype: Literal[DTYPE_SETTINGS] = Field(  # type: ignore[valid-type]
        "auto",
        description='precision of the weights and activations: "float32", "bfloat16", "float16" or "auto": bfloat16 on '
        "CUDA and on CPUs whose bf16 matrix instructions (AVX512-BF16, AMX) a start-up measurement finds fast, float32 "
        "elsewhere; /info, clusterserve_build_info and the log name the one that runs",
    )
    backend: Literal[BACKENDS] = Field(  # type: ignore[valid-type]
        "auto", description='attention kernels: "reference", "native", "triton" or "auto": triton on CUDA, the native C '
        "loops on a CPU where they build, the reference otherwise; resolved once at start-up (/info shows it); one "
        "that cannot run on the model's device and dtype fails start-up",
    )

    # Default attention for requests that leave a knob out (AttentionSpec's fields).
    method: Literal[METHODS] = Field(  # type: ignore[valid-type]
        "auto", description='default attention method; "auto" with target_fidelity: the fastest calibrated choice'
    )
    clusters: int = Field(_DEFAULT_SPEC.clusters, description="default query clusters")
    topk: int = Field(_DEFAULT_SPEC.topk, description="default keys recomputed per cluster (i-clustered)")
    bits: int | None = Field(
        None, description="default LSH bits for clustering; unset = each method's: 0 (no codes, the seeded "
        "start) for i-clustered without Hamming iterations, 63 otherwise"
    )
    iterations: int = Field(_DEFAULT_SPEC.iterations, description="default Hamming K-means iterations")
    refine: int | None = Field(
        None, description="default Lloyd iterations on real query vectors; unset = 2 after the seeded start, 3 after "
        "a Hamming pass"
    )
    hash_rounds: int = Field(_DEFAULT_SPEC.hash_rounds, description="default SMYRF hashing rounds")
    cluster_size: int = Field(_DEFAULT_SPEC.cluster_size, description="default SMYRF cluster size")
    band: int = Field(_DEFAULT_SPEC.band, description="default neighbouring blocks attended exactly (banded)")
    block: int = Field(_DEFAULT_SPEC.block, description="default tokens per block (banded)")
    sinks: int = Field(_DEFAULT_SPEC.sinks, description="default leading tokens every query attends exactly (banded)")
    far_blocks: int = Field(
        _DEFAULT_SPEC.far_blocks, description="default far blocks each query block attends exactly (banded)"
    )
    seed: int = Field(_DEFAULT_SPEC.seed, description="default seed of planes and centroids")
    auto_threshold: int = Field(
        _DEFAULT_SPEC.auto_threshold, description='"auto" runs full attention below this many tokens'
    )
    auto_method: Literal[APPROXIMATE_METHODS] = Field(  # type: ignore[valid-type]
        _DEFAULT_SPEC.auto_method, description='"auto" runs this method from the threshold on'
    )
    target_fidelity: float | None = Field(
        DEFAULT_TARGET_FIDELITY,
        gt=0,
        le=1,
        description='the fidelity "auto" aims at when a request names no target_fidelity and no knob it '
        "calibrates: the fastest configuration of the device's calibration table measured to keep at least "
        "this cosine to exact attention at the input's length (exact attention when none does, or when it "
        "is faster); unset = auto goes by auto_threshold",
    )
    calibration: Path | None = Field(
        None,
        description="calibration table for auto's target_fidelity (python -m clusterserve.bench.calibration.build); unset = "
        "<model folder>/calibration.<cpu|cuda>.json or the table shipped for the model, if any; "
        "a table that is named but missing, or found but malformed, fails start-up",
    )

    # Limits.
    max_input_tokens: int | None = Field(
        None, ge=1, description="longest input in tokens; unset = the model's limit"
    )
    max_batch_tokens: int = Field(
        16384, ge=1, description="token budget of one packed forward pass (real tokens; a longer input runs alone)"
    )
    max_client_batch_size: int = Field(64, ge=1, description="most inputs in one request")
    max_request_tokens: int = Field(
        262144,
        ge=1,
        description="most tokens the forward passes of one request run (chunked requests: every chunk's "
        "or window's tokens, overlaps included); more is 413",
    )
    max_request_chunks: int = Field(4096, ge=1, description="most chunks one chunked request returns; more is 413")
    max_embed_all_tokens: int = Field(
        16384, ge=1, description="most token vectors one /embed_all request returns (its JSON is ~8 KB a token); more is 413"
    )
    max_concurrent_requests: int = Field(
        64, ge=1, description="embedding requests admitted at once; more get 429"
    )
    max_body_bytes: int = Field(16 * 1024 * 1024, ge=1, description="largest request body")
    max_request_work_s: float | None = Field(
        None,
        gt=0,
        description="budget of estimated work per request, in seconds of this device's time (models.planning.cost, at the "
        "throughput measured at start-up); a request over it is refused with 422 naming the knob that drives it; "
        "unset = two inputs of the model's longest length at the most costly default method or calibrated "
        "configuration",
    )
    request_timeout_s: float = Field(
        600.0, gt=0, description="deadline of an embedding request, from arrival; 504 after it"
    )

    drain_timeout_s: float = Field(
        30.0,
        gt=0,
        description="on SIGTERM: how long uvicorn waits for open requests, then how long the "
        "scheduler gets to finish its queue",
    )

    api_key: SecretStr | None = Field(
        None, description="if set, embedding and tokenize routes need `Authorization: Bearer <key>`"
    )
    cors_origins: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="comma-separated origins allowed by CORS (empty = CORS off)"
    )
    log_level: Literal["debug", "info", "warning", "error", "critical"] = Field(
        "info", description="log level of the server and uvicorn"
    )
    log_format: Literal["text", "json"] = Field(
        "text",
        description='"json": one JSON object per log line (access lines carry the request id, '
        "route, status, tokens, times)",
    )
    warmup: bool = Field(True, description="run each method once at start-up before turning ready")
    fidelity_reference: Literal["startup", "off"] = Field(
        "startup",
        description='the float32 model that "fidelity": true compares against where the server runs another dtype: '
        '"startup" loads it (a float32 copy of the weights) before the server turns ready; "off" does not, and a '
        "request asking for fidelity gets a 422",
    )
    small_batch_weights: bool = Field(
        True,
        description="on a CPU: each linear layer also keeps its weight packed by oneDNN, for short batches in float32 "
        "(every batch where oneDNN also leads MKL on long products, timed at load) and every batch in bfloat16 "
        "(faster short texts; as many bytes again as the linear weights; on/off; docs/backends.md)",
    )
    cuda_graphs: bool = Field(
        True,
        description="on CUDA with the triton backend: pad batches to length buckets and replay each layer from a "
        "CUDA graph captured per batch shape (on/off; docs/backends.md)",
    )
    cuda_graph_signatures: int = Field(
        16, ge=1, description="batch shapes (length buckets, specs, adapter) kept captured; least recently used dropped"
    )
    cuda_graph_max_length: int = Field(
        8192, ge=1, description="batches with an input longer than this run eagerly and unpadded"
    )

    @field_validator("cors_origins", mode="before")
    @classmethod
    def _split_origins(cls, value: object) -> object:
        if isinstance(value, str):
            return [origin.strip() for origin in value.split(",") if origin.strip()]
        return value

    @field_validator("model", mode="before")
    @classmethod
    def _model_path(cls, value: object) -> object:
        # Settings(model=Path(...)) from Python means the same as the path's text in the environment.
        return os.fspath(value) if isinstance(value, os.PathLike) else value

    @field_validator("target_fidelity", mode="before")
    @classmethod
    def _unset_target(cls, value: object) -> object:
        # CLUSTERSERVE_TARGET_FIDELITY= (or "none") switches the calibrated default off.
        return None if isinstance(value, str) and value.strip().lower() in ("", "none") else value

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower_log_level(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value

    @model_validator(mode="after")
    def _check_attention(self) -> Settings:
        self.default_spec()  # AttentionSpec raises ValueError("<field>: ...") on a bad knob
        return self

    @field_validator("device")
    @classmethod
    def _check_device(cls, value: str) -> str:
        if value != "auto":
            try:
                torch.device(value)
            except RuntimeError as exc:
                raise ValueError(f"not a torch device: {exc}") from None
        return value

    def served_models(self) -> list[str | None]:
        """Every model to serve, the default first (None: the embedded default)."""
        return [self.model, *self.more_models]

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def default_spec(self) -> AttentionSpec:
        """The server's default `AttentionSpec` (request knobs are applied on top of it)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(AttentionSpec) if f.init}
        return AttentionSpec(**fields)
