"""Every cross-field rule of a request's `attention` and `chunking` objects, listed once.

JSON Schema bounds each field on its own; these rules relate two or more fields (or a field
and the model). Each is a function (in kernels.spec or models.planning.chunking, beside the
object it guards) that the object's own validation calls; this list is what the service's
OpenAPI document states (in words, and as JSON Schema where the rule has a form there) and
what the fuzz hooks (tests/fuzz/cross_field.py) filter generated bodies with, so that a rule
added to the list reaches all three.

    broken_rule(body, limits)   the FieldError of the first rule a request body breaks, or None
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from clusterserve.kernels import AttentionSpec, FieldError
from clusterserve.kernels.spec import (
    ATTENTION,
    CALIBRATED_KNOBS,
    METHOD_KNOBS,
    METHODS,
    iterations_without_codes,
    knobs_beside_target,
    target_without_auto,
)
from clusterserve.models.planning.chunking import (
    CHUNKING,
    ChunkLimits,
    fields_beside_late_inputs,
    naive_chunk_within_limit,
    overlap_within_size,
    window_holds_framing,
    window_overlap_within_room,
)

# Limits that keep every served model's rules: the shortest length limit and trained positions
# of a shipped model (all-MiniLM-L6-v2: 512), more special and prompt tokens than the longest
# shipped prompt adds, and naive chunking where a body does not say (a shipped model's default:
# nomic-embed-text-v1.5's). A body that keeps the rules at these keeps them on any model.
STRICTEST_LIMITS = ChunkLimits(framing=16, max_tokens=512, native_positions=512, late=False)


@dataclass(frozen=True)
class CrossFieldRule:
    """within: the request object ("attention", "chunking"); fields: those it relates (the
    422 names one of them); statement: the rule in words; check(values, limits): the
    FieldError of an object (its fields, plus `late_chunking` for chunking) that breaks it, else
    None; schema(default): its JSON Schema form over the object given the server's default
    attention spec, where JSON Schema can state it (None: stated in words only)."""

    within: str
    fields: tuple[str, ...]
    statement: str
    check: Callable[[Mapping[str, Any], ChunkLimits], FieldError | None]
    schema: Callable[[AttentionSpec], dict[str, Any]] | None = None


def _null(*names: str) -> dict[str, Any]:
    return {"properties": {name: {"type": "null"} for name in names}}


def _no_iterations_without_codes(default: AttentionSpec) -> dict[str, Any]:
    """bits is not 0, or iterations is 0, or the method that runs reads no bits (the server's
    default method when the object names none; "auto" runs the default's auto_method)."""
    ignoring = [method for method in METHODS if method != "auto" and "bits" not in METHOD_KNOBS[method]]
    if "bits" not in METHOD_KNOBS[default.auto_method]:
        ignoring.append("auto")
    if default.method in ignoring:
        ignoring.append(None)
    return {"anyOf": [
        {"properties": {"bits": {"not": {"const": 0}}}},
        {"properties": {"iterations": {"enum": [0, None]}}},
        {"properties": {"method": {"enum": ignoring}}, "required": ["method"]} if None not in ignoring
        else {"properties": {"method": {"enum": ignoring}}},
    ]}


def _target_with_auto(default: AttentionSpec) -> dict[str, Any]:
    return {"anyOf": [_null("target_fidelity"), {"properties": {"method": {"enum": ["auto", None]}}}]}


def _no_knobs_beside_target(default: AttentionSpec) -> dict[str, Any]:
    return {"anyOf": [
        _null("target_fidelity"),
        {"properties": {"method": {"not": {"enum": ["auto", None]}}}, "required": ["method"]},
        _null(*CALIBRATED_KNOBS),
    ]}


CROSS_FIELD_RULES: tuple[CrossFieldRule, ...] = (
    CrossFieldRule(
        ATTENTION, ("bits", "iterations", "method"),
        "Hamming iterations need LSH codes: with bits 0, iterations is 0 (where the method reads bits)",
        lambda values, limits: iterations_without_codes(values), _no_iterations_without_codes,
    ),
    CrossFieldRule(
        ATTENTION, ("target_fidelity", "method"), 'target_fidelity goes with method "auto" (or none)',
        lambda values, limits: target_without_auto(values), _target_with_auto,
    ),
    CrossFieldRule(
        ATTENTION, ("target_fidelity", *CALIBRATED_KNOBS),
        f"with target_fidelity the table chooses the knobs: none of {', '.join(CALIBRATED_KNOBS)}",
        lambda values, limits: knobs_beside_target(values), _no_knobs_beside_target,
    ),
    CrossFieldRule(CHUNKING, ("overlap", "size"), "overlap below size", overlap_within_size),
    CrossFieldRule(
        CHUNKING, ("size", "late"),
        "with late false (or absent where the model's default is naive chunking), size plus the special and "
        "prompt tokens within the model's length limit",
        naive_chunk_within_limit,
    ),
    CrossFieldRule(CHUNKING, ("window",), "window above its special and prompt tokens", window_holds_framing),
    CrossFieldRule(
        CHUNKING, ("window_overlap", "window"),
        "window_overlap below the window's room for text (window, default the model's trained positions, "
        "less its special and prompt tokens)",
        window_overlap_within_room,
    ),
    CrossFieldRule(
        CHUNKING, ("late_chunking", "window", "window_overlap"),
        "with late_chunking true (the inputs are the chunks), chunking sets window and window_overlap only",
        fields_beside_late_inputs,
    ),
)


def rule_values(body: Mapping[str, Any], within: str) -> dict[str, Any] | None:
    """The fields a rule over `within` reads from a request body (None: the body has no such
    object): the object's fields that are set (an integral number as the integer the server
    reads it as: JSON's 8.0 is 8), and for chunking the body's `late_chunking`."""
    value = body.get(within)
    if within == CHUNKING and body.get("late_chunking") is True and value is None:
        value = {}
    if not isinstance(value, Mapping):
        return None
    values = {name: _as_read(field) for name, field in value.items() if field is not None}
    if within == CHUNKING:
        values["late_chunking"] = body.get("late_chunking") is True
    return values


def _as_read(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


def broken_rule(body: Any, limits: ChunkLimits = STRICTEST_LIMITS) -> FieldError | None:
    """The FieldError of the first rule that a request body breaks at these limits, or None."""
    if not isinstance(body, Mapping):
        return None
    for rule in CROSS_FIELD_RULES:
        values = rule_values(body, rule.within)
        error = None if values is None else rule.check(values, limits)
        if error is not None:
            return error
    return None
