"""models.planning.rules: the one list of cross-field rules agrees with what validation does.

- The rules' JSON Schema forms (what the OpenAPI document states) accept exactly the
  attention objects the server runs, for each server default method.
- Over a grid of attention objects whose every field is in range, the request path refuses an
  object only where a listed rule is broken (a rule outside the list would show here), and
  every object a rule breaks, with its method named, is refused naming one of the rule's fields.
"""

from __future__ import annotations

import itertools

import jsonschema
import pytest

from clusterserve.kernels import AttentionSpec, FieldError, resolve_auto
from clusterserve.kernels.spec import ATTENTION, METHODS
from clusterserve.models.planning.chunking import CHUNKING, ChunkLimits
from clusterserve.models.planning.rules import CROSS_FIELD_RULES, STRICTEST_LIMITS, broken_rule
from clusterserve.service.planning import chunking_spec, resolve_request_attention
from clusterserve.service.schemas import AttentionRequest, ChunkingRequest

GRID = dict(
    method=[None, *METHODS],
    bits=[None, 0, 8],
    iterations=[None, 0, 3],
    clusters=[None, 50],
    target_fidelity=[None, 0.95],
    seed=[None, 1],
)
DEFAULTS = [AttentionSpec(), AttentionSpec(method="auto"), AttentionSpec(method="smyrf"),
            AttentionSpec(method="auto", auto_method="smyrf")]


def objects():
    for values in itertools.product(*GRID.values()):
        yield {name: value for name, value in zip(GRID, values) if value is not None}


def served(default: AttentionSpec, given: dict) -> FieldError | None:
    """The error the request path gives this `attention` object (None: it runs)."""
    try:
        spec, target = resolve_request_attention(default, AttentionRequest(**given))
        resolve_auto(spec, 4096, None, target)
    except FieldError as error:
        return error
    return None


def test_the_list_holds_each_objects_rules():
    assert {rule.within for rule in CROSS_FIELD_RULES} == {ATTENTION, CHUNKING}
    assert len({rule.statement for rule in CROSS_FIELD_RULES}) == len(CROSS_FIELD_RULES)


@pytest.mark.parametrize("default", DEFAULTS, ids=lambda d: f"{d.method}/{d.auto_method}")
def test_the_json_schema_forms_accept_what_the_server_accepts(default):
    """What the OpenAPI document states of the attention object (every rule's form, allOf)
    accepts an object exactly where the server runs it."""
    forms = {"allOf": [rule.schema(default) for rule in CROSS_FIELD_RULES if rule.schema is not None]}
    validator = jsonschema.Draft202012Validator(forms)
    checked = 0
    for given in objects():
        assert validator.is_valid(given) == (served(default, given) is None), given
        checked += 1
    assert checked > 500


@pytest.mark.parametrize("default", DEFAULTS, ids=lambda d: f"{d.method}/{d.auto_method}")
def test_the_request_path_refuses_only_what_a_listed_rule_breaks(default):
    refused = 0
    for given in objects():
        error = served(default, given)
        predicted = broken_rule({"attention": given})
        if error is not None:
            refused += 1
            assert predicted is not None, f"{given} refused by a rule the list does not hold: {error}"
        method = given.get("method", "auto" if "target_fidelity" in given else default.method)
        named = {**given, "method": method, "auto_method": default.auto_method}
        broken = [rule for rule in CROSS_FIELD_RULES if rule.within == ATTENTION and rule.check(named, STRICTEST_LIMITS)]
        if broken:
            assert error is not None, f"{given} breaks a listed rule but runs"
            assert error.field in {field for rule in broken for field in rule.fields}, (given, error)
    assert refused > 10


def test_chunking_rules_name_their_field_on_the_request_path():
    limits = ChunkLimits(framing=4, max_tokens=512, native_positions=512)
    cases = {
        "overlap": ({"size": 10, "overlap": 10}, False),
        "size": ({"late": False, "size": 510}, False),
        "window": ({"window": 4}, False),
        "window_overlap": ({"window": 100, "window_overlap": 96}, False),
        "boundaries": ({"boundaries": "tokens"}, True),  # late_chunking: the window fields only
    }
    for field, (chunking, late_inputs) in cases.items():
        error = broken_rule({"chunking": chunking, "late_chunking": late_inputs}, limits)
        assert error is not None and error.field == field, (chunking, error)
    with pytest.raises(FieldError) as raised:
        chunking_spec(ChunkingRequest(boundaries="tokens"), late_inputs=True)
    assert raised.value.field == "boundaries"
    assert broken_rule({"chunking": {"size": 508, "late": False}}, limits) is None
