"""EmbedOptions.of copies a request body's fields by name: every field of every request schema
the embedding routes read is either an option or one NOT_OPTIONS names, so a schema field
renamed away from its option fails here rather than being dropped at run time."""

from __future__ import annotations

import dataclasses

import pytest
from pydantic import BaseModel, Field

from clusterserve.service.ollama_schemas import OllamaEmbeddingsRequest, OllamaEmbedRequest
from clusterserve.service.planning import NOT_OPTIONS, EmbedOptions
from clusterserve.service.schemas import EmbedAllRequest, EmbeddingRequest, EmbedRequest

BODIES = [
    (EmbeddingRequest(input="x"), "input"),
    (EmbedRequest(inputs="x"), "inputs"),
    (EmbedAllRequest(inputs="x"), "inputs"),
    (OllamaEmbedRequest(model="m", input="x"), "input"),
    (OllamaEmbeddingsRequest(model="m", prompt="x"), "prompt"),
]
OPTIONS = {f.name for f in dataclasses.fields(EmbedOptions)}


@pytest.mark.parametrize("body, param", BODIES, ids=lambda b: type(b).__name__ if isinstance(b, BaseModel) else b)
def test_every_field_of_a_request_is_an_option_or_named_as_not_one(body, param):
    fields = set(type(body).model_fields)
    assert fields <= OPTIONS | NOT_OPTIONS, sorted(fields - OPTIONS - NOT_OPTIONS)
    options = EmbedOptions.of(body, param)
    for name in fields & OPTIONS:
        assert getattr(options, name) == getattr(body, name), name


def test_a_field_that_matches_no_option_is_refused_not_dropped():
    class Renamed(EmbeddingRequest):
        normalise: bool = Field(default=True)  # the option is `normalize`

    with pytest.raises(TypeError, match="normalise"):
        EmbedOptions.of(Renamed(input="x"), "input")


def test_a_value_the_body_sets_reaches_the_options_and_overrides_win():
    body = EmbedRequest(inputs="x", normalize=False, truncate=True, dimensions=8)
    options = EmbedOptions.of(body, "inputs", dimensions=4)
    assert (options.normalize, options.truncate, options.dimensions, options.param) == (False, True, 4, "inputs")
