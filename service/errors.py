"""The JSON error model: every failure is `{"error": {"message", "type", "param"}}`, except on
Ollama's routes (paths under /api/), which answer as Ollama does: `{"error": message}`, with
400 where the others answer 422 (Ollama refuses every bad body with 400).

Routes raise `ServiceError` (or let FastAPI raise its own validation and HTTP errors); the
handlers installed by `install_error_handlers` turn each into the documented status and
count it in `clusterserve_request_failures_total{reason}`. A bad request never becomes a
500; an exception that escapes a route (a bug) is answered in the same format by
`middleware.RequestMiddleware`.
"""

from __future__ import annotations

from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from clusterserve.engine.errors import Cancelled, DeadlineExceeded, EngineError, OutOfMemory, Overloaded, ShuttingDown
from clusterserve.kernels import FieldError
from clusterserve.models.planning.inputs import EmptyInput, InputError, InputTooLong, NoTokens

# The fixed set of failure reasons (the `reason` label); metrics pre-creates each one.
FAILURE_REASONS = (
    "malformed_json",
    "invalid_field",
    "empty_input",
    "unauthorized",
    "not_found",
    "method_not_allowed",
    "input_too_long",
    "body_too_large",
    "batch_too_large",
    "overloaded",
    "not_ready",
    "out_of_memory",
    "over_budget",
    "deadline",
    "disconnected",
    "internal",
)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    499: "client_closed_request",
    500: "internal_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class ServiceError(Exception):
    """A failure with its HTTP status, a message for the client, and the field it concerns."""

    def __init__(
        self,
        status: int,
        reason: str,
        message: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        if reason not in FAILURE_REASONS:
            raise ValueError(f"reason: must be one of {FAILURE_REASONS}, got {reason!r}")
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message
        self.param = param
        self.headers = headers or {}


def empty_input(param: str) -> ServiceError:
    return ServiceError(400, "empty_input", f"{param}: must not be empty", param)


def invalid_field(param: str, message: str) -> ServiceError:
    return ServiceError(422, "invalid_field", f"{param}: {message}", param)


def over_budget(param: str, message: str) -> ServiceError:
    """422: the request's estimated work is over the server's budget per request."""
    return ServiceError(422, "over_budget", f"{param}: {message}", param)


def input_too_long(param: str, tokens: int, limit: int) -> ServiceError:
    return ServiceError(
        413,
        "input_too_long",
        f"{param}: {tokens} tokens is more than the limit of {limit}; "
        "shorten it or send truncate=true",
        param,
    )


def batch_too_large(param: str, size: int, limit: int) -> ServiceError:
    return ServiceError(
        413, "batch_too_large", f"{param}: {size} inputs is more than the limit of {limit}", param
    )


def request_too_large(param: str, count: int, what: str, limit: int, advice: str) -> ServiceError:
    """A request that would run or return more than a per-request bound (`what`: "tokens", ...)."""
    return ServiceError(
        413, "batch_too_large", f"{param}: {count} {what} is more than the limit of {limit} per request; {advice}", param
    )


def unauthorized() -> ServiceError:
    return ServiceError(
        401,
        "unauthorized",
        "missing or wrong API key: send `Authorization: Bearer <key>`",
        headers={"WWW-Authenticate": "Bearer"},
    )


def not_ready(message: str = "the model is still loading; retry shortly") -> ServiceError:
    return ServiceError(503, "not_ready", message, headers={"Retry-After": "1"})


def overloaded(limit: int) -> ServiceError:
    return ServiceError(
        429,
        "overloaded",
        f"server busy: {limit} embedding requests already in progress; retry later",
        headers={"Retry-After": "1"},
    )


def out_of_memory(tokens: int) -> ServiceError:
    """An input that ran out of memory even alone in its batch (after splitting the batch)."""
    return ServiceError(
        503,
        "out_of_memory",
        f"out of memory on an input of {tokens} tokens, even in a batch of its own; "
        "retry later or send a shorter input",
        headers={"Retry-After": "1"},
    )


def deadline_exceeded(timeout_s: float) -> ServiceError:
    return ServiceError(504, "deadline", f"request did not finish within its deadline of {timeout_s:g} s")


def client_disconnected() -> ServiceError:
    # 499 (nginx's "client closed request"): nobody reads it, but the access log and
    # clusterserve_requests_total{code} show what happened.
    return ServiceError(499, "disconnected", "the client disconnected before its embeddings were ready")


# The planners' typed errors (kernels.FieldError and its kinds) as answers: the first row
# whose type the error is, called with the error and the request field it names.
FIELD_ERRORS: tuple[tuple[type[FieldError], Callable[[Any, str], ServiceError]], ...] = (
    (InputTooLong, lambda exc, param: input_too_long(param, exc.tokens, exc.limit)),
    (NoTokens, lambda exc, param: invalid_field(param, exc.detail)),  # text, but no token of its own
    (EmptyInput, lambda exc, param: empty_input(param)),
    (FieldError, lambda exc, param: invalid_field(param, exc.detail)),
)


# The scheduler's typed errors as answers: the first row whose type the error is.
ENGINE_ERRORS: tuple[tuple[type[EngineError], Callable[[Any], ServiceError]], ...] = (
    (ShuttingDown, lambda exc: not_ready("the server is shutting down")),
    (Overloaded, lambda exc: overloaded(exc.limit)),
    (DeadlineExceeded, lambda exc: deadline_exceeded(exc.timeout_s)),
    (OutOfMemory, lambda exc: out_of_memory(exc.tokens)),
    (Cancelled, lambda exc: client_disconnected()),
)


def from_engine_error(exc: EngineError) -> ServiceError:
    """`exc` answered by ENGINE_ERRORS."""
    return next(answer(exc) for kind, answer in ENGINE_ERRORS if isinstance(exc, kind))


def from_field_error(exc: FieldError, inputs_param: str, params: list[str], renames: dict[str, str]) -> ServiceError:
    """`exc` answered by FIELD_ERRORS, naming the request field it concerns: an input by its
    param (`params[index]`, `inputs_param` for the inputs as a whole), a knob or a chunking
    field within its object (`attention.clusters`), or the field itself, as `renames` says
    the route calls it."""
    if isinstance(exc, InputError):
        param = inputs_param if exc.index is None else params[exc.index]
    else:
        name = f"{exc.within}.{exc.field}" if exc.within else exc.field
        param = renames.get(name, name)
    return next(answer(exc, param) for kind, answer in FIELD_ERRORS if isinstance(exc, kind))


def error_body(status: int, message: str, param: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "error"), "param": param}}


OLLAMA_PREFIX = "/api/"  # Ollama's routes: its error shape and statuses


def shaped_error(path: str, status: int, message: str, param: str | None) -> tuple[int, dict[str, Any]]:
    """The status and body of a failure on `path`, in the shape of the API it belongs to."""
    if path.startswith(OLLAMA_PREFIX):
        return (400 if status == 422 else status), {"error": message}
    return status, error_body(status, message, param)


def error_response(error: ServiceError, path: str = "") -> JSONResponse:
    status, body = shaped_error(path, error.status, error.message, error.param)
    return JSONResponse(body, status, headers=error.headers)


def param_from_loc(loc: tuple[Any, ...]) -> str | None:
    """("body", "attention", "clusters") -> "attention.clusters"; ("body", "input", 2) -> "input[2]"."""
    parts = list(loc[1:] if loc and loc[0] in ("body", "query", "header", "path") else loc)
    # Pydantic names the union branch it tried ("str", "list[str]", ...); it is no field.
    parts = [p for p in parts if not (isinstance(p, str) and ("[" in p or p in _UNION_TAGS))]
    param = ""
    for part in parts:
        param += f"[{part}]" if isinstance(part, int) else (f".{part}" if param else str(part))
    return param or None


_UNION_TAGS = {"str", "int", "list", "function-after", "function-before", "function-wrap"}


def _count(request: Request, reason: str) -> None:
    metrics = getattr(request.app.state, "metrics", None)
    if metrics is not None:
        metrics.failures.labels(reason=reason).inc()


def install_error_handlers(app: FastAPI) -> None:
    """Route every failure FastAPI and Starlette know of through the JSON error model."""

    @app.exception_handler(ServiceError)
    async def _service_error(request: Request, exc: ServiceError) -> JSONResponse:
        _count(request, exc.reason)
        return error_response(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
        if first.get("type") == "json_invalid":
            ctx = first.get("ctx") or {}
            detail = ctx.get("error", first.get("msg"))
            error = ServiceError(400, "malformed_json", f"body is not valid JSON: {detail}")
        else:
            param = param_from_loc(tuple(first.get("loc", ())))
            # Our own validators raise ValueError, which pydantic prefixes; the prefix says nothing.
            message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
            if len(errors) > 1:
                message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
            error = ServiceError(422, "invalid_field", f"{param or 'body'}: {message}", param)
        _count(request, error.reason)
        return error_response(error, request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        reasons = {404: "not_found", 405: "method_not_allowed", 401: "unauthorized", 413: "body_too_large"}
        reason = reasons.get(exc.status_code, "malformed_json" if exc.status_code == 400 else "internal")
        _count(request, reason)
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        status, body = shaped_error(request.url.path, exc.status_code, message, None)
        return JSONResponse(body, status, headers=exc.headers)
