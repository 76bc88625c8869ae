"""clusterserve.service.errors.FIELD_ERRORS: each typed planning error answers with its status, naming the
request's field, without reading its message."""

from __future__ import annotations

import pytest

from clusterserve.kernels import FieldError
from clusterserve.models.planning.inputs import EmptyInput, InputError, InputTooLong, NoTokens
from clusterserve.models.planning.plan import UnknownAdapter
from clusterserve.models.prompts import UnknownPrompt
from clusterserve.service.errors import from_field_error

PARAMS = ["input[0]", "input[1]"]


@pytest.mark.parametrize(
    "error, status, reason, param",
    [
        (InputTooLong(1, 900, 512), 413, "input_too_long", "input[1]"),
        (EmptyInput(0, "empty"), 400, "empty_input", "input[0]"),
        (NoTokens(1, "has no tokens"), 422, "invalid_field", "input[1]"),
        (InputError(None, "must be a list"), 422, "invalid_field", "input"),
        (UnknownPrompt("query", ("document",)), 422, "invalid_field", "prompt_name"),
        (UnknownAdapter("x", ()), 422, "invalid_field", "adapter"),
        (FieldError("clusters", "must be in [1, 4096], got 0", "attention"), 422, "invalid_field", "attention.clusters"),
        (FieldError("chunking", "applies to a list of texts"), 422, "invalid_field", "late_chunking"),
    ],
)
def test_each_kind_answers_with_its_status_and_field(error, status, reason, param):
    answer = from_field_error(error, "input", PARAMS, {"chunking": "late_chunking"})
    assert (answer.status, answer.reason, answer.param) == (status, reason, param)
    assert answer.message.startswith(param)


def test_the_message_is_the_detail_not_reparsed():
    error = FieldError("size", "a: b: c", "chunking")  # colons in the detail stay in it
    assert str(error) == "size: a: b: c"
    assert from_field_error(error, "input", PARAMS, {}).message == "chunking.size: a: b: c"
