"""Every error status of DESIGN.md, in the JSON error model, and never a 500 for a bad request.

400, 413, 422, 404 and 405 run against the real app; 401, 429, 503, 504 and 499 against apps
with a fake encoder that can be held busy or made to fail (test_http_errors_serving.py).
"""

from __future__ import annotations

import json

import pytest
from service_helpers import assert_error, license_text

LONG = license_text(12000)  # ~2500 tokens; the session app's limit is 1024


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/embeddings", {"input": ""}, "input"),
        ("/v1/embeddings", {"input": []}, "input"),
        ("/v1/embeddings", {"input": ["a", ""]}, "input[1]"),
        ("/v1/embeddings", {"input": [[101, 102], []]}, "input[1]"),
        ("/embed", {"inputs": ""}, "inputs"),
        ("/embed", {"inputs": []}, "inputs"),
        ("/tokenize", {"inputs": []}, "inputs"),
    ],
)
def test_400_empty_input(client, path, body, param):
    error = assert_error(client.post(path, json=body), 400, param, "empty")
    assert error["type"] == "invalid_request_error"
    # The OpenAPI document declares it invalid too (minLength / minItems): it tells the truth.
    schema = request_schema(client, path)
    field = next(iter(body))
    assert not schema.is_valid(body) and schema.is_valid({field: ["a"]})


def request_schema(client, path: str):
    """A JSON Schema validator of the route's request body, as /openapi.json declares it."""
    import jsonschema

    document = client.get("/openapi.json").json()
    ref = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    return jsonschema.Draft202012Validator({"$ref": ref, "components": document["components"]})


@pytest.mark.parametrize(
    "path, raw",
    [
        ("/v1/embeddings", '{"input": "\\udbc6"}'),
        ("/v1/embeddings", '{"input": ["ok", "a\\udc0db"]}'),
        ("/embed", '{"inputs": "\\udbc6"}'),
        ("/embed", '{"inputs": ["\\udbc6\\udc0d"], "chunking": {"size": 64}}'),
        ("/embed", '{"inputs": ["   "], "chunking": {"size": 64, "late": false}}'),
        ("/tokenize", '{"inputs": "\\udbc6"}'),
    ],
)
def test_text_the_tokenizer_drops_or_refuses_is_still_text(client, path, raw):
    # A lone surrogate escape is read as U+FFFD; a private-use character or blanks have no
    # token of their own, and a chunked one is one chunk: each gets an answer, not an error.
    response = client.post(path, content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 200, response.text
    lone = client.post(path, content=raw.replace("\\udbc6", "\\ufffd").replace("\\udc0d", "\\ufffd"),
                       headers={"content-type": "application/json"})
    if "\\udbc6\\udc0d" not in raw:  # a pair is one character (U+F180D), not two U+FFFD
        assert response.json() == lone.json()


def test_tokenize_answers_an_empty_text_with_its_special_tokens_and_the_schema_allows_it(client):
    for body in ({"inputs": ""}, {"inputs": ["a", ""]}):
        assert request_schema(client, "/tokenize").is_valid(body)
        response = client.post("/tokenize", json=body)
        assert response.status_code == 200 and [t["special"] for t in response.json()[-1]] == [True, True]


@pytest.mark.parametrize(
    "path, body",
    [("/v1/embeddings", b'{"input": "a",'), ("/embed", b"{inputs: 1}"), ("/tokenize", b"\xff\xfe")],
)
def test_400_malformed_json(client, path, body):
    response = client.post(path, content=body, headers={"content-type": "application/json"})
    assert_error(response, 400, None, "not valid JSON")


@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "text/plain", None])
def test_a_json_body_is_read_whatever_its_content_type_says(client, content_type):
    """`curl -d` without -H sends a form's content type: the body is still the request."""
    headers = {"content-type": content_type} if content_type else {}
    for path, body in (("/v1/embeddings", {"input": "a"}), ("/embed", {"inputs": "a"}), ("/", {"inputs": "a"}),
                       ("/embed_all", {"inputs": "a"}), ("/tokenize", {"inputs": "a"})):  # fmt: skip
        response = client.post(path, content=json.dumps(body), headers=headers)
        assert response.status_code == 200, (path, response.text)
    assert_error(client.post("/embed", content=b"inputs=a", headers=headers), 400, None, "not valid JSON")


@pytest.mark.parametrize(
    "body, param, says",
    [
        ({"input": "a", "attention": {"clusters": 0}}, "attention.clusters", "greater than or equal to 1"),
        ({"input": "a", "attention": {"bits": 64}}, "attention.bits", "less than or equal to 63"),
        ({"input": "a", "attention": {"bits": 0, "iterations": 2}}, "attention.iterations", "need LSH codes"),
        ({"input": "a", "attention": {"topk": "many"}}, "attention.topk", None),
        ({"input": "a", "attention": {"seed": True}}, "attention.seed", None),
        ({"input": "a", "attention": {"method": "linear"}}, "attention.method", "i-clustered"),
        ({"input": "a", "attention": {"cluster": 8}}, "attention.cluster", None),
        ({"input": "a", "attention": {"method": "smyrf", "target_fidelity": 0.99}}, "attention.target_fidelity", "auto"),
        ({"input": "a", "attention": 5}, "attention", None),
        ({"input": "a", "encoding_format": "hex"}, "encoding_format", None),
        ({"input": "a", "dimensions": 0}, "dimensions", None),
        ({"input": "a", "dimensions": 385}, "dimensions", "[1, 384]"),
        ({"input": "a", "truncate": "yes"}, "truncate", None),
        ({"input": 42}, "input", "list of token ids"),
        ({"input": [1.5, 2]}, "input", "list of token ids"),
        ({"input": ["a", 1]}, "input", "input[0] is a string but input[1] is a token id"),
        ({"input": ["a", "b", None]}, "input", "input[2] is null"),
        ({"input": [[101, 102], [101, "a"]]}, "input", "input[0] is a token-id list but input[1] is a list"),
        ({"input": [[101, 10**9]]}, "input[0]", "token ids must be in [0, 30522)"),
        ({"input": [-1]}, "input", "token ids must be in"),
        ({}, "input", "required"),
        ({"input": "a", "temperature": 1}, "temperature", None),
    ],
)
def test_422_names_the_field_openai(client, body, param, says):
    error = assert_error(client.post("/v1/embeddings", json=body), 422, param, says)
    assert error["message"].startswith(param)


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/embed", {"inputs": "a", "truncation_direction": "up"}, "truncation_direction"),
        ("/embed", {"inputs": "a", "normalize": "no"}, "normalize"),
        ("/embed", {"inputs": [[1, 2]]}, "inputs"),
        ("/embed", {"inputs": "a", "attention": {"refine": -1}}, "attention.refine"),
        ("/tokenize", {"inputs": 3}, "inputs"),
        ("/tokenize", {"inputs": "a", "add_special_tokens": 2}, "add_special_tokens"),
    ],
)
def test_422_names_the_field_other_routes(client, path, body, param):
    assert_error(client.post(path, json=body), 422, param)


def test_422_names_the_first_item_that_breaks_the_inputs_shape(client):
    assert_error(client.post("/embed", json={"inputs": ["a", "b", 7]}), 422, "inputs",
                 "inputs[0] is a string but inputs[2] is a token id")


def test_422_body_not_an_object(client):
    assert_error(client.post("/v1/embeddings", json=["a"]), 422, None)


def test_413_input_too_long(client):
    response = client.post("/v1/embeddings", json={"input": ["short", LONG]})
    error = assert_error(response, 413, "input[1]", "more than the limit of 1024")
    assert "truncate" in error["message"]
    assert_error(client.post("/embed", json={"inputs": LONG}), 413, "inputs")
    assert_error(client.post("/v1/embeddings", json={"input": list(range(1000, 3000))}), 413, "input")


def test_413_batch_too_large(client):
    assert_error(client.post("/v1/embeddings", json={"input": ["a"] * 9}), 413, "input", "9 inputs")
    assert_error(client.post("/tokenize", json={"inputs": ["a"] * 9}), 413, "inputs")


def test_413_body_too_large(client):
    big = {"input": "word " * 20000}  # ~100 kB, the session limit is 64 KiB
    assert_error(client.post("/v1/embeddings", json=big), 413, None, "limit")

    def chunks():  # no Content-Length: the limit is enforced while reading
        for _ in range(100):
            yield b"x" * 1024

    response = client.post("/embed", content=chunks(), headers={"content-type": "application/json"})
    assert_error(response, 413, None, "limit")


def test_404_and_405(client):
    assert_error(client.get("/v2/nothing"), 404, None)
    assert_error(client.get("/v1/embeddings"), 405, None)


def test_bad_requests_never_500(client):
    bodies = [b"", b"null", b"[]", b"1", b'"x"', b'{"input": null}', b'{"input": {"a": 1}}',
              b'{"input": [[]]}', b'{"input": [[-5]]}', b'{"input": "a", "dimensions": 1e9}',
              b'{"input": "a", "attention": {"seed": 1e30}}', b'{"input": "a", "attention": []}']
    for path in ("/v1/embeddings", "/embed", "/tokenize"):
        for body in bodies:
            response = client.post(path, content=body, headers={"content-type": "application/json"})
            assert 400 <= response.status_code < 500, (path, body, response.text)
            assert set(response.json()["error"]) == {"message", "type", "param"}


# --- statuses that need a server in a particular state --------------------------------


@pytest.mark.parametrize(
    "attention, status",
    [
        ({"target_fidelity": 0.9, "clusters": 3}, 422),
        ({"target_fidelity": 0.9, "method": "full"}, 422),
        ({"target_fidelity": 0.9, "seed": 3}, 200),
        ({"target_fidelity": None, "method": "clustered", "clusters": 3}, 200),
    ],
)
def test_the_schema_states_which_knobs_target_fidelity_excludes(client, attention, status):
    body = {"inputs": "a short text", "attention": attention}
    assert request_schema(client, "/embed").is_valid(body) == (status == 200)
    assert client.post("/embed", json=body).status_code == status


def test_a_request_over_the_work_budget_is_refused_before_it_runs_naming_the_knob(client):
    import re

    from service_helpers import license_text

    limits = client.get("/info").json()["limits"]
    assert limits["max_request_work_s"] > 0 and limits["work_budget_units"] > 0
    text = license_text(6000)  # over the session limit of 1024 tokens: cut to it
    heavy = {"method": "i-clustered", "clusters": 900, "topk": 128, "iterations": 100, "refine": 100}
    counted = 'clusterserve_request_failures_total{reason="over_budget"} '
    before = float(client.get("/metrics").text.split(counted)[1].split()[0])  # present from start-up
    response = client.post("/v1/embeddings", json={"input": text, "truncate": True, "attention": heavy})
    error = assert_error(response, 422, "attention.clusters", "over its budget")
    largest = int(re.search(r"at 1024 tokens, clusters can be at most (\d+)", error["message"]).group(1))
    others = {name: int(value) for name, value in re.findall(r"with (\w+) at most (\d+)", error["message"])}
    assert 1 <= largest < 900 and set(others) <= {"topk", "iterations", "refine", "bits"}
    assert float(client.get("/metrics").text.split(counted)[1].split()[0]) == before + 1
    # The largest value it names runs.
    within = {**heavy, **others, "clusters": largest}
    fits = client.post("/v1/embeddings", json={"input": text, "truncate": True, "attention": within})
    assert fits.status_code == 200, fits.text
