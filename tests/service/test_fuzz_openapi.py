"""Property-based fuzzing of the service's own OpenAPI schema (hypothesis).

Request bodies are drawn from each POST route's JSON schema in `/openapi.json` (valid shapes,
with values anywhere in their types' ranges), mixed with arbitrary JSON; every answer must
be a documented status in the JSON error model, and never a 5xx other than 503/504.
Bounded: a fixed number of examples per route, no shrinking database, well under a minute.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

ALLOWED = {200, 400, 401, 404, 405, 413, 422, 429, 503, 504}
EXAMPLES = 60
ROUTES = ("/v1/embeddings", "/embed", "/", "/embed_all", "/tokenize")

short_text = st.text(max_size=40)
scalars = st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False) | short_text
any_json = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(short_text, inner, max_size=4), max_leaves=12
)


def from_schema(schema: dict[str, Any], components: dict[str, Any], depth: int = 0) -> st.SearchStrategy:
    """A strategy for values of a JSON schema (the subset FastAPI emits), near its edges."""
    if "$ref" in schema:
        return from_schema(components[schema["$ref"].rsplit("/", 1)[-1]], components, depth)
    if "anyOf" in schema or "oneOf" in schema:
        return st.one_of([from_schema(s, components, depth) for s in schema.get("anyOf", schema.get("oneOf"))])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "const" in schema:
        return st.just(schema["const"])
    kind = schema.get("type")
    if kind == "string":
        return short_text
    if kind == "integer":
        low, high = schema.get("minimum", -(2**31)), schema.get("maximum", 2**31)
        return st.integers(low - 2, high + 2)  # a little outside the range too
    if kind == "number":
        return st.floats(allow_nan=False, allow_infinity=False, min_value=-1e6, max_value=1e6)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "array":
        items = from_schema(schema.get("items", {}), components, depth + 1) if depth < 3 else st.just([])
        return st.lists(items, max_size=4)
    if kind == "object" or "properties" in schema:
        props = schema.get("properties", {})
        required = set(schema.get("required", []))
        fields = {name: from_schema(sub, components, depth + 1) for name, sub in props.items()}
        return st.fixed_dictionaries(
            {name: s for name, s in fields.items() if name in required},
            optional={name: s for name, s in fields.items() if name not in required},
        )
    return any_json


@pytest.fixture(scope="module")
def openapi(client) -> dict[str, Any]:
    return client.get("/openapi.json").json()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", ROUTES)
def test_fuzzed_bodies_never_get_an_undocumented_5xx(client, openapi, path):
    components = openapi["components"]["schemas"]
    operation = openapi["paths"][path]["post"]
    body_schema = operation["requestBody"]["content"]["application/json"]["schema"]
    bodies = from_schema(body_schema, components) | any_json

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(body=bodies)
    def check(body: Any) -> None:
        response = client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
        assert response.status_code in ALLOWED, (body, response.status_code, response.text)
        if response.status_code != 200:
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param"} and error["message"], response.text

    check()


@pytest.mark.timeout(300)
def test_fuzzed_heavy_but_legal_knobs_are_refused_or_run(client):
    """Knobs near the top of what the schema allows, on an input cut to the session's limit:
    each is refused by the work budget (422 naming a knob or the input) or runs (200)."""
    from service_helpers import license_text

    text = license_text(8000)
    methods = st.sampled_from(["clustered", "i-clustered", "smyrf"])
    heavy = st.fixed_dictionaries(
        {"method": methods},
        optional={
            "clusters": st.integers(256, 1023), "topk": st.integers(256, 1023), "iterations": st.integers(50, 100),
            "refine": st.integers(50, 100), "hash_rounds": st.integers(32, 64), "cluster_size": st.integers(256, 1023),
        },
    )  # fmt: skip

    @settings(max_examples=20, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(attention=heavy)
    def check(attention: dict[str, Any]) -> None:
        response = client.post("/v1/embeddings", json={"input": text, "truncate": True, "attention": attention})
        assert response.status_code in (200, 422), (attention, response.status_code, response.text)
        seen.add(response.status_code)
        if response.status_code == 422:
            error = response.json()["error"]
            assert "over its budget" in error["message"], error
            assert error["param"] == "input" or error["param"].removeprefix("attention.") in attention, error

    seen: set[int] = set()
    check()
    assert seen == {200, 422}, seen  # the draws cover both sides of the budget
