"""The OpenAPI document, completed with what only the loaded model knows.

Which `prompt_name` and `adapter` values a request may name, how many `dimensions` it may
keep, which token ids exist and how long a late-chunking window may be depend on the
checkpoint, so the static schemas say only "a string" or "an integer". Once the model is
loaded the document lists the names (an enum, or null alone when the model has none), bounds
`dimensions` by the model's width, token ids by its vocabulary and `chunking.window` by its
length limit, and states that prompts and chunking apply to texts only, so that a request the
document allows is never refused as invalid. The rules between the fields of `attention` and
of `chunking` (models.planning.rules.CROSS_FIELD_RULES) are stated on their schemas: in words
in the description and in `x-cross-field-rules`, and as JSON Schema (`allOf`) where the rule
has a form there; those it has not (a size against the model's limit less the prompt's
tokens) are the ones the fuzz hooks keep. With several models served, the names and bounds
are those of any of them (a request names its model). Until the models are loaded the document is built
without any of this and not cached.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from clusterserve.kernels import AttentionSpec
from clusterserve.models.planning.rules import CROSS_FIELD_RULES
from clusterserve.models.prompts import NO_PROMPT

from .state import ServiceState

# Request schema -> the field holding its inputs (texts or token ids).
_INPUT_FIELDS = {"EmbeddingRequest": "input", "EmbedRequest": "inputs", "EmbedAllRequest": "inputs"}
_TEXTS = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}


def install(app: FastAPI, state: ServiceState) -> None:
    """Replace `app.openapi` with one that adds the loaded model's prompts and adapters."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        if not state.models:
            return schema
        # With several models served, the bounds of any of them: a request names its model.
        encoders = [served.encoder for served in state.models.values()]
        prompts = list(dict.fromkeys(name for e in encoders for name in e.prompts.prompts))
        adapters = list(dict.fromkeys(name for e in encoders for name in e.adapters))
        # "" (NO_PROMPT) asks for no prompt on any model
        _name_the_model_choices(schema, [NO_PROMPT, *prompts], adapters)
        _bound_the_integers(
            schema, {"dimensions": max(e.dim for e in encoders), "input": max(e.vocab_size for e in encoders) - 1}
        )
        _bound_the_window(schema, max(e.max_input_tokens for e in encoders))
        _state_the_cross_field_rules(schema, state.default_spec)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi


def _one_of(names: list[str]) -> dict[str, Any]:
    return {"anyOf": [{"type": "string", "enum": names}, {"type": "null"}]} if names else {"type": "null"}


def _name_the_model_choices(schema: dict[str, Any], prompts: list[str], adapters: list[str]) -> None:
    for name, model in schema.get("components", {}).get("schemas", {}).items():
        properties = model.get("properties", {})
        if name not in _INPUT_FIELDS:
            continue
        for field, names in (("prompt_name", prompts), ("adapter", adapters)):
            if field in properties:
                properties[field] = {**_one_of(names), "description": properties[field].get("description", "")}
        # A prompt is prepended to texts and texts are chunked; token-id inputs are used as
        # given (422 otherwise), with no prompt or none asked for.
        texts = {"properties": {_INPUT_FIELDS[name]: _TEXTS}}
        rules = [{"anyOf": [{"properties": {"prompt_name": {"enum": [None, NO_PROMPT]}}}, texts]}]
        if "chunking" in properties:
            rules.append({"anyOf": [{"properties": {"chunking": {"type": "null"}}}, texts]})
        if "late_chunking" in properties:
            rules.append({"anyOf": [{"properties": {"late_chunking": {"const": False}}}, texts]})
        model["allOf"] = [*model.get("allOf", []), *rules]


# The request object -> its schema's name in the document.
_RULE_SCHEMAS = {"attention": "AttentionRequest", "chunking": "ChunkingRequest"}


def _state_the_cross_field_rules(schema: dict[str, Any], default: AttentionSpec) -> None:
    models = schema.get("components", {}).get("schemas", {})
    for within, name in _RULE_SCHEMAS.items():
        model = models.get(name)
        if model is None:
            continue
        rules = [rule for rule in CROSS_FIELD_RULES if rule.within == within]
        words = "; ".join(rule.statement for rule in rules)
        model["description"] = f"{model.get('description', '').rstrip()}\n\nRules between fields (422 naming one): {words}."
        model["x-cross-field-rules"] = [
            {"fields": list(rule.fields), "rule": rule.statement, "json_schema": rule.schema is not None} for rule in rules
        ]
        forms = [rule.schema(default) for rule in rules if rule.schema is not None]
        if forms:
            model["allOf"] = [*model.get("allOf", []), *forms]


def _bound_the_window(schema: dict[str, Any], max_input_tokens: int) -> None:
    """A late-chunking context window runs at most the model's tokens."""
    chunking = schema.get("components", {}).get("schemas", {}).get("ChunkingRequest", {}).get("properties", {})
    for option in chunking.get("window", {}).get("anyOf", []):
        if option.get("type") == "integer":
            option["maximum"] = max_input_tokens


def _bound_the_integers(schema: dict[str, Any], maxima: dict[str, int]) -> None:
    """Give every integer inside the named request fields its model-given maximum."""

    def bound(node: Any, maximum: int) -> None:
        if isinstance(node, dict):
            if node.get("type") == "integer":
                node["maximum"] = maximum
            for child in node.values():
                bound(child, maximum)
        elif isinstance(node, list):
            for child in node:
                bound(child, maximum)

    for name in _INPUT_FIELDS:
        properties = schema.get("components", {}).get("schemas", {}).get(name, {}).get("properties", {})
        for field, maximum in maxima.items():
            if field in properties:
                bound(properties[field], maximum)
