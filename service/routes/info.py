"""GET /info (?model=NAME for another served model than the default): what is served and how
it may be asked: the served models' names, the model, its limits, its prompts (and
the default one) and task adapters, every attention method with its knobs' defaults and
ranges, the calibration table's frontier (what auto's target_fidelity chooses from), the
chunking defaults, the vector encodings, the kernel backend and the device."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from clusterserve.kernels import KNOB_RANGES, METHOD_KNOBS, METHODS
from clusterserve.models import Encoder
from clusterserve.models.compact import FORMATS as COMPACT_FORMATS
from clusterserve.models.compact import calibration
from clusterserve.models.planning.chunk_defaults import chunk_defaults
from clusterserve.models.planning.chunk_plan import chunk_limits
from clusterserve.models.planning.chunking import BOUNDARIES, ChunkingSpec, window_sizes

from .. import __version__, errors
from ..schemas import CHUNK_TOKENS_MAX, ErrorResponse
from ..state import Served, ServiceState, get_state

router = APIRouter(tags=["info"])


@router.get("/info", responses={
    404: {"model": ErrorResponse, "description": "no served model has that name"},
    503: {"model": ErrorResponse, "description": "model not loaded yet"},
})  # fmt: skip
async def info(request: Request, model: str | None = None) -> JSONResponse:
    state = get_state(request)
    if state.default is None:
        raise errors.not_ready(
            f"the model failed to load: {state.load_error}" if state.load_error else "the model is still loading"
        )
    served = state.default if model is None else state.named(model)
    encoder = served.encoder
    about = encoder.info()
    return JSONResponse(
        {
            "version": __version__,
            "model": encoder.name,
            # every served model, the default first; /info?model=NAME describes another one
            "models": list(state.models),
            "architecture": about.get("architecture"),
            "dimension": encoder.dim,
            "pooling": about.get("pooling"),
            "native_positions": encoder.native_positions,
            "extended_positions": encoder.max_input_tokens,
            "position_extension": about.get("position_extension"),
            # rotary scaling the checkpoint is published with, e.g. nomic's dynamic NTK x2 past 2,048
            "position_scaling": about.get("position_scaling"),
            "max_input_tokens": encoder.max_input_tokens,
            # name -> text prepended to each text; requests without prompt_name get the default
            "prompts": about.get("prompts", {}),
            "default_prompt_name": about.get("default_prompt_name"),
            # task adapters (Jina v3); a prompt_name that names one selects it too
            "adapters": about.get("adapters", []),
            "limits": _limits(state, served),
            "attention": _attention(state, encoder),
            "chunking": _chunking(encoder),
            "encodings": _encodings(encoder),
            "backend": encoder.backend,
            "device": str(encoder.device),
            "dtype": about.get("dtype"),
            # CUDA graphs of the layers: batch shapes kept and the longest input graphed; null = off
            "cuda_graphs": about.get("cuda_graphs"),
            "auth": state.settings.api_key is not None,
        }
    )


def _limits(state: ServiceState, served: Served) -> dict[str, Any]:
    settings, encoder = state.settings, served.encoder
    return {
        "max_input_tokens": encoder.max_input_tokens,
        "max_batch_tokens": settings.max_batch_tokens,
        "max_client_batch_size": settings.max_client_batch_size,
        "max_request_tokens": settings.max_request_tokens,
        "max_request_chunks": settings.max_request_chunks,
        "max_embed_all_tokens": settings.max_embed_all_tokens,
        "max_concurrent_requests": settings.max_concurrent_requests,
        "max_body_bytes": settings.max_body_bytes,
        "request_timeout_s": settings.request_timeout_s,
        # the estimated work a request may take (models.planning.cost), in this device's seconds
        "max_request_work_s": round(served.throughput.seconds(served.work_budget), 3),
        "work_budget_units": served.work_budget,
        "throughput_units_per_s": served.throughput.units_per_s,
    }


def _chunking(encoder: Encoder) -> dict[str, Any]:
    """The `chunking` extension's defaults (window and window_overlap as they resolve for a text
    without a prompt) and bounds."""
    framing = len(encoder.tokenizer.prefix) + len(encoder.tokenizer.suffix)
    limits = chunk_limits(encoder.checkpoint, framing)
    defaults = ChunkingSpec().resolved(limits)
    room, overlap = window_sizes(defaults, limits)
    return {
        "defaults": {
            "size": defaults.size,
            "overlap": defaults.overlap,
            "boundaries": defaults.boundaries,
            "late": defaults.late,
            "window": room + framing,
            "window_overlap": overlap,
        },
        "measured": chunk_defaults(encoder.name).finding or None,
        "boundaries": list(BOUNDARIES),
        "max_size": CHUNK_TOKENS_MAX,
        "max_window": encoder.max_input_tokens,
    }


def _encodings(encoder: Encoder) -> dict[str, Any]:
    """What encoding_format takes, and the int8 calibration a client needs to map codes back."""
    calibrated = calibration(encoder.name)
    return {
        "formats": ["float", "base64", *COMPACT_FORMATS],  # base64 on /v1/embeddings only
        # int8 q = clamp(round(x * sqrt(d) * 127 / range), -127, 127); uint8 = q + 128
        "int8_range": calibrated.range,
        "int8_range_measured": calibrated.measured,
        "int8_step": "range / (127 * sqrt(d)), d the vector's dimensions",
        "binary_bit_order": "dimension 8j + 7 - b in bit b of byte j (first dimension in the high bit); binary = byte - 128",
    }


def _attention(state: ServiceState, encoder: Encoder) -> dict[str, Any]:
    """The default method, how auto decides, and every method's knobs with defaults and ranges."""
    default = state.default_spec
    methods = {}
    for method in METHODS:
        knobs = METHOD_KNOBS.get(method, tuple(name for name in KNOB_RANGES if name != "auto_threshold"))
        own = default.with_knobs(method=method)  # bits and refine default by method
        methods[method] = {
            name: {"default": getattr(own, name), "min": KNOB_RANGES[name][0], "max": KNOB_RANGES[name][1]}
            for name in knobs
        }
    return {
        "default_method": default.method,
        # auto aims at target_fidelity through the calibration table; without a table (or a
        # target) it goes by the threshold
        "auto": {
            "target_fidelity": state.settings.target_fidelity,
            "threshold": default.auto_threshold,
            "method": default.auto_method,
        },
        "methods": methods,
        # auto with target_fidelity chooses from this; null = it falls back to the threshold
        "calibration": encoder.calibration.info() if encoder.calibration is not None else None,
    }
