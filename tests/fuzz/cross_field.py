"""Schemathesis hooks (`make fuzz`, tests/fuzz/test_schemathesis.py): keep generated bodies to
those that keep every cross-field rule of `attention` and `chunking`, read from the one list
the server's validation and its OpenAPI document read too
(clusterserve.models.planning.rules.CROSS_FIELD_RULES).

JSON Schema bounds each field on its own; the rules relate fields to each other and to the
model (a naive chunk within the length limit less the prompt's tokens), which no schema can
state. The hooks check them at the strictest limits of any model served (STRICTEST_LIMITS), so
that a body they keep is one every served model accepts.
"""

from __future__ import annotations

from typing import Any

from clusterserve.models.planning.rules import STRICTEST_LIMITS, broken_rule

try:  # the hooks need schemathesis; the rules themselves are tested without it
    import schemathesis
except ImportError:
    schemathesis = None


def keeps_cross_field_rules(body: Any) -> bool:
    """Whether a request body keeps every cross-field rule (True for a body that is no object)."""
    return broken_rule(body, STRICTEST_LIMITS) is None


if schemathesis is not None:

    @schemathesis.hook
    def filter_body(context: Any, body: Any) -> bool:
        return keeps_cross_field_rules(body)
